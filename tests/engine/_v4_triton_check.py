"""vLLM's own DeepSeek-V4 metadata kernels, run by Triton's interpreter on CPU tensors, against
the plugin's torch stand-ins on random batches: ``python -m tests.engine._v4_triton_check SEED
TRIALS`` prints ``RESULT`` and a JSON list of the cases whose outputs differ (whole output
buffers compared exactly, the parts a kernel must leave alone included).

A child process of tests/engine/test_v4_plugin.py: the interpreter has to be on before Triton is
first imported, and vLLM's CPU build only takes Triton when it has a CPU backend, so a stand-in
entry for one is added to Triton's backend table before vLLM is imported (vLLM then imports the
real Triton, whose ``jit`` is the interpreter's).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json
import random
import sys
import types
from typing import Any

import torch

I32 = torch.int32
Pair = tuple[Any, Any]  # (vLLM's kernel, the stand-in)


def _enable_interpreted_triton() -> None:
    from triton.backends import backends

    backends.setdefault("cpu", types.SimpleNamespace(driver=None))
    from vllm.triton_utils import HAS_TRITON

    assert HAS_TRITON, "vLLM did not take the interpreted Triton"


def _equal(theirs: tuple[torch.Tensor, ...], ours: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


class Batch:
    """A random batch: decode requests first (query length 1), then prefills after cached
    prefixes, then vLLM's padding requests (empty queries); a block table of distinct
    blocks, each row wide enough for its request; padded token lanes past the batch."""

    def __init__(self, rng: random.Random) -> None:
        self.block_size = rng.choice([4, 8])
        n = rng.randint(1, 4)
        self.num_decodes = n // 2
        reqs = [(rng.randint(0, 40), 1 if i < n // 2 else rng.randint(1, 24)) for i in range(n)]
        reqs += [(0, 0)] * rng.randint(0, 2)
        self.num_reqs = len(reqs)
        starts = [0]
        for _, q in reqs:
            starts.append(starts[-1] + q)
        self.qsl = torch.tensor(starts, dtype=I32)
        self.seq = torch.tensor([p + q for p, q in reqs], dtype=I32)
        self.prefixes = [p for p, _ in reqs]
        self.tokens = starts[-1]
        self.padded = rng.randint(0, 3)
        width = int(self.seq.max()) // self.block_size + 3
        ids = list(range(1, 1 + self.num_reqs * width))
        rng.shuffle(ids)
        self.block_table = torch.tensor(ids, dtype=I32).view(self.num_reqs, width)


def _token_to_request(pair: Pair, b: Batch) -> tuple[bool, torch.Tensor]:
    outs = []
    for fn in pair:
        out = torch.full((b.tokens + b.padded + 2,), -9, dtype=I32)
        fn(b.qsl, out, b.tokens, b.tokens + b.padded)
        outs.append((out,))
    return _equal(*outs), outs[1][0][: b.tokens + b.padded]


def _swa(
    pair: Pair, gather_pair: Pair, b: Batch, rng: random.Random, t2r: torch.Tensor
) -> list[str]:
    n = b.tokens + b.padded
    valid = torch.tensor([i < b.tokens and rng.random() > 0.15 for i in range(n)])
    window = rng.choice([4, 8, 16])
    replay = torch.tensor(
        [rng.randint(0, p) if rng.random() < 0.3 else 0 for p in b.prefixes], dtype=I32
    )
    left = torch.tensor([rng.randint(0, window + 4) for _ in range(n)], dtype=I32)
    right = torch.tensor([rng.randint(0, 2) for _ in range(n)], dtype=I32)
    failed = []
    parts = {"decode": (b.num_decodes, 0), "prefill": (b.tokens - b.num_decodes, b.num_decodes)}
    for part, (count, offset) in parts.items():
        if count == 0:
            continue
        image = part == "prefill" and rng.random() < 0.5
        width = window + (rng.randint(1, 6) if part == "prefill" else 0)
        outs = []
        for kernel in pair:
            idx = torch.full((count + 2, 1, width + 2), 77, dtype=I32)
            lens = torch.full((count + 2,), 77, dtype=I32)
            kernel(
                idx, lens, window, width, left if image else lens, right if image else lens,
                b.qsl, b.seq, t2r, valid, b.block_table, b.block_size, replay,
                num_tokens=count, token_offset=offset, has_image=image,
            )  # fmt: skip
            outs.append((idx, lens))
        if not _equal(*outs):
            failed.append(part)
    prefills = b.num_reqs - b.num_decodes
    outs = []
    for kernel in gather_pair:
        gather = torch.full((prefills + 1,), 55, dtype=I32)
        kernel(gather, b.seq, b.qsl, replay, prefills, b.num_decodes, window)
        outs.append((gather,))
    if not _equal(*outs):
        failed.append("prefill_gather_lens")
    return failed


def _compressed_slots(pair: Pair, b: Batch, rng: random.Random) -> bool:
    ratio, entries_per_block = rng.choice([4, 8]), rng.choice([2, 4])
    slots = torch.arange(b.tokens, dtype=torch.int64)
    slots[torch.rand(b.tokens) < 0.1] = -1  # tokens whose KV is cached already
    world, interleave = rng.choice([(1, 1), (2, ratio), (2, 2 * ratio)])
    outs = []
    for kernel in pair:
        out = torch.full((b.tokens + 3,), -1, dtype=torch.int64)
        kernel(out, slots, b.qsl, b.seq, b.block_table, entries_per_block, ratio, world, interleave)
        outs.append((out,))
    return _equal(*outs)


def _prefill_chunk(pair: Pair, b: Batch, rng: random.Random) -> bool:
    ratio = rng.choice([4, 8])
    cu = torch.zeros(b.num_reqs + 1, dtype=I32)
    cu[1:] = torch.cumsum(b.seq // ratio, 0)
    start = rng.randint(0, b.tokens - 1)
    stop = rng.randint(start + 1, b.tokens)
    world, rank = rng.choice([(1, 0), (2, 0), (2, 1)])
    outs = []
    for kernel in pair:
        ks = torch.full((stop - start,), 33, dtype=I32)
        ke = torch.full((stop - start,), 33, dtype=I32)
        owner = torch.full((int(cu[-1]) + 2,), 33, dtype=I32)
        kernel(
            b.qsl, b.seq, cu, cu, owner, ks, ke, start, stop, rank, world, 1,
            num_reqs=b.num_reqs, COMPRESS_RATIO=ratio,
        )  # fmt: skip
        outs.append((ks, ke, owner))
    return _equal(*outs)


def _uniform_decode(pair: Pair, rng: random.Random) -> bool:
    per_req, reqs = rng.choice([1, 2, 3]), rng.randint(1, 4)
    seq_lens = torch.tensor([rng.choice([0, rng.randint(1, 30)]) for _ in range(reqs)], dtype=I32)
    table = torch.randint(0, 50, (reqs, 5), dtype=I32)
    rows = reqs * per_req
    outs = []
    for kernel in pair:
        lens = torch.full((rows + 2,), 44, dtype=I32)
        expanded = torch.full((rows + 2, 5), 44, dtype=I32)
        decode_lens = torch.full((rows + 2,), 44, dtype=I32)
        kernel(seq_lens, lens, table, expanded, decode_lens, rows, per_req)
        outs.append((lens, expanded, decode_lens))
    return _equal(*outs)


def run(seed: int, trials: int) -> list[str]:
    _enable_interpreted_triton()
    from tessera_v4_cpu import metadata as mine
    from vllm.v1.attention.backends.mla import compressor_utils, indexer, sparse_swa
    from vllm.v1.attention.ops import metadata as theirs

    swa = (sparse_swa.ComputeSWAIndicesAndLensKernel(), mine.SWAIndicesAndLens())
    gather = (sparse_swa.ComputePrefillMetadataKernel(), mine.PrefillGatherLens())
    rng = random.Random(seed)
    failed: list[str] = []
    for trial in range(trials):
        b = Batch(rng)
        same, t2r = _token_to_request(
            (theirs.compute_token_to_req_indices, mine.token_to_request), b
        )
        if not same:
            failed.append(f"token_to_request/{trial}")
        failed += [f"swa/{p}/{trial}" for p in _swa(swa, gather, b, rng, t2r)]
        slots = (compressor_utils.CompressedSlotMappingKernel(), mine.CompressedSlotMapping())
        if not _compressed_slots(slots, b, rng):
            failed.append(f"compressed_slots/{trial}")
        chunk = (indexer.BuildPrefillChunkMetadataKernel(), mine.PrefillChunkMetadata())
        if not _prefill_chunk(chunk, b, rng):
            failed.append(f"prefill_chunk/{trial}")
        if not _uniform_decode((indexer.PrepareUniformDecodeKernel(), mine.UniformDecode()), rng):
            failed.append(f"uniform_decode/{trial}")
    return failed


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(int(sys.argv[1]), int(sys.argv[2]))))
