"""The test-support vLLM plugin of tests/engine/v4_plugin (``tessera_v4_cpu``): its torch
stand-ins for vLLM's DeepSeek-V4 Triton metadata kernels on small hand-made batches, each
expected value written from what the kernel computes (decode, prefill, mixed batches, the
window's edge, padded lanes); that it changes nothing until vLLM imports its V4 CPU model, and
then everything it should; and, where Triton's interpreter can run vLLM's own kernels on this
CPU, the stand-ins against them on random batches.

vLLM's engines load the plugin through its entry point; ``make test-engine`` installs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("tessera_v4_cpu", reason="make test-engine installs tests/engine/v4_plugin")

from tessera_v4_cpu import metadata

I32 = torch.int32
ROOT = Path(__file__).resolve().parents[2]


def t(*values: int, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# --- token -> request -----------------------------------------------------------------------


def test_token_to_request_skips_empty_queries_and_zeroes_unmapped_tokens() -> None:
    # Request 1 has an empty query (vLLM's padding): tokens 3 and 4 belong to request 2.
    out = torch.full((8,), -7, dtype=I32)
    got = metadata.token_to_request(t(0, 3, 3, 5), out, num_mapped_tokens=5, num_tokens=7)
    assert got.tolist() == [0, 0, 0, 2, 2, 0, 0]  # tokens 5 and 6 are past the mapped ones
    assert out[7] == -7  # nothing written past num_tokens
    assert got.data_ptr() == out.data_ptr()


def test_token_to_request_decode_batch_and_tokens_past_every_end() -> None:
    out = torch.zeros(4, dtype=I32)
    assert metadata.token_to_request(t(0, 1, 2, 3), out, 3, 3).tolist() == [0, 1, 2]
    # Mapped tokens past the last query's end go to the last request.
    assert metadata.token_to_request(t(0, 2, 3), out, 4, 4).tolist() == [0, 0, 1, 1]


# --- sliding-window indices -------------------------------------------------------------------


def swa(
    *,
    qsl: torch.Tensor,
    seq_lens: torch.Tensor,
    t2r: torch.Tensor,
    valid: list[bool],
    block_table: torch.Tensor,
    window: int,
    width: int,
    num_tokens: int,
    offset: int,
    replay: torch.Tensor | None = None,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    row_width: int | None = None,
    block_size: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.full((num_tokens + 1, 1, row_width or width), 99, dtype=I32)
    lens = torch.full((num_tokens + 1,), 99, dtype=I32)
    replay = replay if replay is not None else torch.zeros(len(seq_lens), dtype=I32)
    has_image = left is not None
    metadata.SWAIndicesAndLens()(
        indices, lens, window, width,
        left if has_image else lens, right if has_image else lens,
        qsl, seq_lens, t2r, torch.tensor(valid), block_table, block_size, replay,
        num_tokens=num_tokens, token_offset=offset, has_image=has_image,
    )  # fmt: skip
    return indices[:, 0], lens


def test_swa_decode_batch_crosses_a_block_and_starts_at_zero() -> None:
    # Request 0 decodes position 5: window 2..5 spans blocks 7 (positions 0-3) and 3 (4-7).
    # Request 1 decodes position 1: the window starts at position 0.
    idx, lens = swa(
        qsl=t(0, 1, 2), seq_lens=t(6, 2), t2r=t(0, 1), valid=[True, True],
        block_table=torch.tensor([[7, 3], [5, 0]], dtype=I32),
        window=4, width=4, num_tokens=2, offset=0,
    )  # fmt: skip
    assert idx[:2].tolist() == [[30, 31, 12, 13], [20, 21, -1, -1]]
    assert lens[:2].tolist() == [4, 2]
    assert idx[2].tolist() == [99] * 4 and lens[2] == 99  # rows past num_tokens untouched


def test_swa_prefill_after_a_decode_reads_from_the_token_offset() -> None:
    # Batch: request 0 decodes (token 0); request 1 prefills positions 3, 4, 5 (tokens 1-3)
    # after a cached prefix of 3. Output rows start at 0 for the prefill's first token.
    # The prefill rows are wider than the window (index_width 6): the rest is padding.
    idx, lens = swa(
        qsl=t(0, 1, 4), seq_lens=t(9, 6), t2r=t(0, 1, 1, 1), valid=[True] * 4,
        block_table=torch.tensor([[1, 2, 3], [4, 6, 0]], dtype=I32),
        window=4, width=6, num_tokens=3, offset=1,
    )  # fmt: skip
    assert idx[:3].tolist() == [
        [16, 17, 18, 19, -1, -1],  # position 3: positions 0..3, all in block 4
        [17, 18, 19, 24, -1, -1],  # position 4: 1..4, the last in block 6
        [18, 19, 24, 25, -1, -1],  # position 5: 2..5
    ]
    assert lens[:3].tolist() == [4, 4, 4]


def test_swa_window_edge_replay_start_and_padded_lanes() -> None:
    # One request prefilling positions 0..4 with window 4, then a padded token (slot < 0).
    # Position 3 is the last whose window still starts at 0; position 4 drops position 0.
    idx, lens = swa(
        qsl=t(0, 5), seq_lens=t(5), t2r=t(0, 0, 0, 0, 0, 0),
        valid=[True] * 5 + [False], block_table=torch.tensor([[2, 9]], dtype=I32),
        window=4, width=4, num_tokens=6, offset=0,
    )  # fmt: skip
    assert idx[3].tolist() == [8, 9, 10, 11] and lens[3] == 4
    assert idx[4].tolist() == [9, 10, 11, 36] and lens[4] == 4
    assert idx[5].tolist() == [-1, -1, -1, -1] and lens[5] == 0  # the padded lane is cleared
    # With bounded replay from position 2, no window reaches below it.
    idx, lens = swa(
        qsl=t(0, 5), seq_lens=t(5), t2r=t(0, 0, 0, 0, 0), valid=[True] * 5,
        block_table=torch.tensor([[2, 9]], dtype=I32), window=4, width=4,
        num_tokens=5, offset=0, replay=t(2),
    )  # fmt: skip
    assert idx[1].tolist() == [-1, -1, -1, -1] and lens[1] == 0  # position 1 < replay start
    assert idx[3].tolist() == [10, 11, -1, -1] and lens[3] == 2
    assert idx[4].tolist() == [10, 11, 36, -1] and lens[4] == 3


def test_swa_image_spans_widen_the_window_and_row_stride_is_respected() -> None:
    # Position 9 sees 6 tokens to its left inside an image (3 past the window's reach) and 1
    # to its right: positions 3..10. Rows are 10 wide; only index_width (8) are written.
    idx, lens = swa(
        qsl=t(0, 11), seq_lens=t(11), t2r=torch.zeros(11, dtype=I32), valid=[True] * 11,
        block_table=torch.tensor([[0, 1, 2]], dtype=I32), window=4, width=8,
        num_tokens=1, offset=9, left=torch.full((11,), 6, dtype=I32),
        right=torch.full((11,), 1, dtype=I32), row_width=10,
    )  # fmt: skip
    assert idx[0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 99, 99]
    assert lens[0] == 8


# --- prefill gather lengths ---------------------------------------------------------------------


def test_prefill_gather_lens_cap_the_prefix_at_the_window() -> None:
    # Request 0 decodes; request 1 prefills 3 tokens after a prefix of 7 (the window of 4
    # reaches 3 of them); request 2 prefills 2 with no prefix.
    out = torch.full((3,), -1, dtype=I32)
    metadata.PrefillGatherLens()(out, t(9, 10, 2), t(0, 1, 4, 6), t(0, 0, 0), 2, 1, 4)
    assert out.tolist() == [6, 2, -1]
    # Bounded replay from position 5: only 2 prefix tokens hold window KV.
    metadata.PrefillGatherLens()(out, t(9, 10, 2), t(0, 1, 4, 6), t(0, 5, 0), 2, 1, 4)
    assert out.tolist() == [5, 2, -1]


# --- compressed slots ---------------------------------------------------------------------------


def test_compressed_slots_mixed_batch() -> None:
    # Ratio 4, 2 compressed entries per block. Request 0 prefills positions 0..9: positions
    # 3 and 7 close entries 0 and 1 (block 5), but position 7's own slot is PAD (its KV is
    # cached), so it writes nothing. Request 1 decodes position 11: entry 2 (its block 1).
    slots = torch.arange(11, dtype=torch.int64)
    slots[7] = -1
    out = torch.full((12,), -5, dtype=torch.int64)
    bt = torch.tensor([[5, 8], [3, 9]], dtype=I32)
    metadata.CompressedSlotMapping()(out, slots, t(0, 10, 11), t(10, 12), bt, 2, 4, 1, 1)
    expected = [-1, -1, -1, 10, -1, -1, -1, -1, -1, -1, 18]
    assert out[:11].tolist() == expected
    assert out[11] == -5  # past the batch's tokens: left to vLLM's fill


def test_compressed_slots_under_decode_context_parallelism() -> None:
    # Two ranks dealing 4 positions at a time: position 15 is this rank's local position 7,
    # which closes its local entry 1.
    out = torch.full((1,), -5, dtype=torch.int64)
    bt = torch.tensor([[6]], dtype=I32)
    slots = t(0, dtype=torch.int64)
    metadata.CompressedSlotMapping()(out, slots, t(0, 1), t(16), bt, 2, 4, 2, 4)
    assert out.tolist() == [13]


# --- indexer prefill chunk -----------------------------------------------------------------------


def chunk(
    qsl: torch.Tensor,
    lens: torch.Tensor,
    cu: torch.Tensor,
    start: int,
    stop: int,
    world: int = 1,
    rank: int = 0,
) -> tuple[list[int], list[int], list[int]]:
    n = stop - start
    ks, ke = torch.full((n,), -9, dtype=I32), torch.full((n,), -9, dtype=I32)
    seq = torch.full((int(cu[-1]) + 1,), -9, dtype=I32)
    metadata.PrefillChunkMetadata()(
        qsl, lens, cu, cu, seq, ks, ke, start, stop, rank, world, 1,
        num_reqs=len(lens), COMPRESS_RATIO=4,
    )  # fmt: skip
    return ks.tolist(), ke.tolist(), seq.tolist()


def test_prefill_chunk_rows_whole_and_sliced() -> None:
    # Request 0: 3 new tokens at positions 7..9 (2 compressed entries each, gathered at rows
    # 0..1); request 1: 2 new tokens at positions 3..4 (1 entry each, row 2).
    qsl, lens, cu = t(0, 3, 5), t(10, 5), t(0, 2, 3)
    ks, ke, seq = chunk(qsl, lens, cu, 0, 5)
    assert ks == [0, 0, 0, 2, 2]
    assert ke == [2, 2, 2, 3, 3]
    assert seq == [0, 0, 1, -9]  # the gathered rows' requests; past them untouched
    ks, ke, _ = chunk(qsl, lens, cu, 1, 4)  # only tokens 1..3, written from 0
    assert ks == [0, 0, 2] and ke == [2, 2, 3]


def test_prefill_chunk_rank_share_under_dcp() -> None:
    # Position 9 has 10 // 4 = 2 entries in its context; dealt one at a time to two ranks,
    # rank 1 holds 1 of them, as does rank 0.
    for rank in (0, 1):
        ks, ke, _ = chunk(t(0, 1), t(10), t(0, 2), 0, 1, world=2, rank=rank)
        assert ks == [0] and ke == [1]


# --- uniform decode ------------------------------------------------------------


def test_uniform_decode_expands_each_request_per_query_token() -> None:
    # Two query tokens per request (MTP-style); request 2 is padding (sequence length 0).
    seq_lens = torch.full((6,), -3, dtype=I32)
    expanded = torch.full((7, 2), -3, dtype=I32)
    lens = torch.full((7,), -3, dtype=I32)
    bt = torch.tensor([[1, 2], [3, 4], [0, 0]], dtype=I32)
    metadata.UniformDecode()(t(5, 9, 0), seq_lens, bt, expanded, lens, 6, 2)
    assert seq_lens.tolist() == [4, 5, 8, 9, 0, 0]
    assert expanded[:6].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [0, 0], [0, 0]]
    assert lens[:6].tolist() == [1] * 6
    assert expanded[6].tolist() == [-3, -3] and lens[6] == -3


# --- the plugin in vLLM --------------------------------------------------------

_PLUGIN_CHECK = """
import json, sys, torch
import tessera_v4_cpu
from tessera_v4_cpu import metadata, patches
tessera_v4_cpu.register()
import vllm.model_executor.models.deepseek_v2  # an MLA model vLLM serves without V4
from vllm.v1.attention.backends.mla import compressor_utils, indexer, sparse_swa
from vllm.v1.attention.ops import metadata as ops_metadata

def state():
    return {
        "trigger_imported": patches.TRIGGER_MODULE in sys.modules,
        "swa_kernel": type(sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL).__name__,
        "prefill_kernel": type(sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL).__name__,
        "slot_kernel": type(compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL).__name__,
        "chunk_kernel": type(indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL).__name__,
        "decode_kernel": type(indexer._PREPARE_UNIFORM_DECODE_KERNEL).__name__,
        "token_to_req": ops_metadata.compute_token_to_req_indices.__name__,
        "token_to_req_in_sparse_swa": sparse_swa.compute_token_to_req_indices.__name__,
        "has_flash_mla_op": hasattr(torch.ops._C, "flash_mla_with_kvcache_cpu"),
    }

before = state()
# vLLM's CPU model runner imports this for any model: still nothing may change.
from vllm.models.deepseek_v4.cpu import cpu_mla, cpu_sparse
imported = state()
try:  # building a V4 attention layer is what switches the plugin on (arguments aside)
    cpu_sparse.DeepseekV4CPUAttention()
except TypeError:
    pass
after = state()
builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
after["tile_scheduler"] = builder.build_tile_scheduler(None, 3)
print("RESULT " + json.dumps({"before": before, "imported": imported, "after": after}))
"""


def _plugin_state() -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PLUGIN_CHECK)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"plugin check failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def test_plugin_waits_for_a_v4_model_then_patches_every_holder() -> None:
    got = _plugin_state()
    before, imported, after = got["before"], got["imported"], got["after"]
    # An MLA model's modules, vLLM's shared metadata modules: all vLLM's own, also once the
    # V4 module is imported (vLLM's CPU workers import it whatever they serve).
    assert imported == {**before, "trigger_imported": True}
    assert before == {
        "trigger_imported": before["trigger_imported"],
        "swa_kernel": "ComputeSWAIndicesAndLensKernel",
        "prefill_kernel": "ComputePrefillMetadataKernel",
        "slot_kernel": "CompressedSlotMappingKernel",
        "chunk_kernel": "BuildPrefillChunkMetadataKernel",
        "decode_kernel": "PrepareUniformDecodeKernel",
        "token_to_req": "compute_token_to_req_indices",
        "token_to_req_in_sparse_swa": "compute_token_to_req_indices",
        "has_flash_mla_op": before["has_flash_mla_op"],  # whatever vLLM's library has
    }
    assert after["trigger_imported"] is True
    assert after["swa_kernel"] == "SWAIndicesAndLens"
    assert after["prefill_kernel"] == "PrefillGatherLens"
    assert after["slot_kernel"] == "CompressedSlotMapping"
    assert after["chunk_kernel"] == "PrefillChunkMetadata"
    assert after["decode_kernel"] == "UniformDecode"
    # The function is rebound where it is defined and where it was imported by name.
    assert after["token_to_req"] == after["token_to_req_in_sparse_swa"] == "token_to_request"
    assert after["has_flash_mla_op"] is True  # vLLM's, or the stand-in where it lacks it
    assert after["tile_scheduler"] == dict.fromkeys(["swaonly", "c4a", "c128a", "c1a", "c2a"])


def test_stand_ins_match_vllms_kernels_under_the_triton_interpreter() -> None:
    """vLLM's own Triton kernels, run by Triton's interpreter (tests/engine/_v4_triton_check.py),
    against the stand-ins on random batches: every output buffer equal."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-m", "tests.engine._v4_triton_check", "0", "12"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"interpreter check failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    assert json.loads(lines[-1][len("RESULT ") :]) == []
