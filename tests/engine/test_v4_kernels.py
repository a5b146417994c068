"""The plugin's torch stand-ins for vLLM's DeepSeek-V4 C++ kernels (tests/engine/v4_plugin,
``tessera_v4_cpu.kernels``; registered only where vLLM's CPU library lacks them): cache bytes
written and read back, attention against a plain softmax with sinks, the compressor's pooling,
the indexer's scores and top-k, routing, and their registration.

Values are chosen exactly representable (fp8 values at scale 1, rotation at position 0) where
a test compares numbers, so the expectations are the kernels' definitions, not their rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("tessera_v4_cpu", reason="make test-engine installs tests/engine/v4_plugin")

from tessera_v4_cpu import kernels

TOKEN_BYTES, SCALE_BYTES = 576, 8  # fp8_ds_mla: 448 fp8 + 64 bf16 values; 7 scales + a pad


def cos_sin(positions: int, half: int = 32) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(half) / half))
    angle = torch.arange(positions)[:, None] * inv[None, :]
    return torch.cat([angle.cos(), angle.sin()], 1).float().contiguous()


def pooled_cache(blocks: int, block_size: int, row_bytes: int, pad: int = 40) -> torch.Tensor:
    """A [blocks, block bytes] view whose rows are further apart than their width, as a
    layer's view into vLLM's shared pool is."""
    width = block_size * row_bytes
    return torch.zeros(blocks, width + pad, dtype=torch.uint8)[:, :width]


def exact_rows(n: int, seed: int) -> torch.Tensor:
    """[n, 512] bf16 rows every value of which fp8 holds exactly at scale 1 (each 64-value
    tile's largest magnitude is 256, so its power-of-two scale is 1)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = grid[torch.randint(0, 8, (n, 512), generator=gen)]
    rows *= torch.where(torch.rand(n, 512, generator=gen) < 0.5, -1.0, 1.0)
    rows[:, 0:448:64] = 256.0
    return rows.to(torch.bfloat16)


def test_window_insert_writes_only_its_rows_and_attention_reads_them_back() -> None:
    cache = pooled_cache(3, 2, TOKEN_BYTES + SCALE_BYTES)
    kv = exact_rows(2, 0)
    q = torch.randn(2, 3, 512).to(torch.bfloat16)
    q_out = kernels.fused_qnorm_rope_kv_insert_cpu(
        q, kv, torch.zeros(2, dtype=torch.int64), cache, torch.tensor([3, -1]), cos_sin(4),
        4, 1e-6, 2,
    )  # fmt: skip
    # Queries: per-head unit RMS (rotation keeps norms), the padded fourth head zero.
    rms = q_out[:, :3].float().square().mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones(2, 3), atol=1e-2)
    assert not q_out[:, 3].any()
    # Slot 3 = block 1, row 1: its 576 bytes, its scales (exponent 127 = 2^0, then a zero pad
    # byte), nothing else; the slot marked -1 writes nothing.
    written = cache.clone()
    written[1, TOKEN_BYTES : 2 * TOKEN_BYTES] = 0
    written[1, 2 * TOKEN_BYTES + SCALE_BYTES : 2 * TOKEN_BYTES + 2 * SCALE_BYTES] = 0
    assert not written.any()
    scales = cache[1, 2 * TOKEN_BYTES + SCALE_BYTES :][:SCALE_BYTES]
    assert scales.tolist() == [127] * 7 + [0]
    # One key, no sink: attention returns its row.
    out = torch.empty(1, 3, 512, dtype=torch.bfloat16)
    kernels.flash_mla_with_kvcache_cpu(
        out, q[:1], cache, torch.tensor([[3]]), 2, cache, torch.zeros(1, 0, dtype=torch.int64),
        1, torch.full((3,), -math.inf), 0.1,
    )  # fmt: skip
    assert torch.equal(out[0], kv[0].expand(3, 512))


def test_attention_is_a_softmax_over_valid_slots_with_a_sink() -> None:
    window_cache = pooled_cache(4, 2, TOKEN_BYTES + SCALE_BYTES)
    compressed_cache = pooled_cache(2, 4, TOKEN_BYTES + SCALE_BYTES)
    keys = exact_rows(5, 1)
    zero = torch.zeros(5, dtype=torch.int64)
    q = torch.randn(5, 2, 512).to(torch.bfloat16)
    kernels.fused_qnorm_rope_kv_insert_cpu(
        q[:3], keys[:3], zero[:3], window_cache, torch.tensor([0, 5, 7]), cos_sin(1), 2, 1e-6, 2
    )
    kernels.fused_qnorm_rope_kv_insert_cpu(
        q[:2], keys[3:], zero[:2], compressed_cache, torch.tensor([1, 6]), cos_sin(1), 2, 1e-6, 4
    )
    # Token 0: slot 5 twice (counted twice), -1 and 8 (past the cache) ignored, plus
    # compressed slot 6. Token 1: nothing valid, so zeros.
    window = torch.tensor([[0, 5, 5, -1, 8], [-1, -1, -1, -1, 99]])
    compressed = torch.tensor([[6, -1], [-1, -1]])
    sink = torch.tensor([0.5, -1.0])
    out = torch.empty(2, 2, 512, dtype=torch.bfloat16)
    kernels.flash_mla_with_kvcache_cpu(
        out, q[:2], window_cache, window, 2, compressed_cache, compressed, 4, sink, 0.01
    )
    rows = keys.double()[[0, 1, 1, 4]]  # slots 0, 5, 5, then compressed slot 6
    logits = 0.01 * rows @ q[0].double().T  # [keys, heads]
    weights = logits.exp()
    expected = (weights.T @ rows) / (weights.sum(0) + sink.double().exp())[:, None]
    assert torch.allclose(out[0].double(), expected, rtol=1e-2, atol=1e-2)
    assert not out[1].any()


def test_indexer_compressor_pools_each_closed_window() -> None:
    # Ratio 4 with overlapping windows: a window of 8 states, the older 4 contributing their
    # first 128 channels, the newer 4 their second 128. States in 4-row blocks.
    gen = torch.Generator().manual_seed(2)
    kv, score = torch.randn(8, 256, generator=gen), torch.randn(8, 256, generator=gen)
    ape = torch.randn(4, 256, generator=gen)
    positions = torch.arange(8)
    state = torch.zeros(3, 4, 512)
    kernels.save_partial_states_cpu(kv, score, ape, positions, state, positions + 4)
    assert torch.equal(state[1:3].reshape(8, 512), torch.cat([kv, score + ape[positions % 4]], 1))
    cache = pooled_cache(2, 4, 128 + 4)
    gather = torch.arange(8)[None, :] + 4  # token 7's window: positions 0..7
    weight = torch.rand(128, generator=gen) + 0.5
    table = cos_sin(8)
    kernels.compress_norm_rope_store_indexer_cpu(
        state, torch.cat([gather, gather]), torch.tensor([6, 7]), torch.tensor([2, 5]), weight,
        1e-6, table, cache, 4, 4,
    )  # fmt: skip
    # Only token 7 closes a window; it writes slot 5 (block 1, row 1); slot 2 stays empty.
    assert not cache[0].any()
    biased = score + ape[positions % 4]
    values = torch.cat([kv[:4, :128], kv[4:, 128:]])
    scores = torch.cat([biased[:4, :128], biased[4:, 128:]])
    pooled = (scores.softmax(0) * values).sum(0)
    pooled = pooled / pooled.square().mean().add(1e-6).sqrt() * weight
    rotated = kernels._rope(pooled[None], torch.tensor([4]), table)[0]  # the window's start
    step = cache[1, 4 * 128 + 4 : 4 * 128 + 8].contiguous().view(torch.float32)
    stored = cache[1, 128:256].contiguous().view(torch.float8_e4m3fn).float() * step
    amax = rotated.to(torch.bfloat16).abs().max().item()  # the kernel rounds to bf16 first
    assert step.item() == 2.0 ** math.ceil(math.log2(amax / 448))
    assert torch.allclose(stored, rotated, rtol=0.07, atol=step.item() * 2**-6)


def test_indexer_scores_and_top_512() -> None:
    # Two pages of 4 keys (fp8 + fp32 scale each); one query row of 2 heads.
    cache = pooled_cache(2, 4, 128 + 4)
    keys = torch.tensor([[1.0, -2.0], [0.5, 0.5], [-1.0, 4.0], [2.0, 0.0], [3.0, 1.0]])
    key_rows = torch.zeros(5, 128)
    key_rows[:, :2] = keys
    for j, slot in enumerate([4, 5, 6, 7, 0]):  # keys 0-3 in page 1, key 4 in page 0
        block, row = divmod(slot, 4)
        cache[block, row * 128 : row * 128 + 128] = (
            key_rows[j].to(torch.float8_e4m3fn).view(torch.uint8)
        )
        cache[block, 512 + row * 4 : 512 + row * 4 + 4] = torch.tensor([0.5]).view(torch.uint8)
    q = torch.zeros(1, 2, 128)
    q[0, 0, :2] = torch.tensor([1.0, 1.0])
    q[0, 1, :2] = torch.tensor([2.0, -1.0])
    weight = torch.tensor([[1.0, 0.5]])
    logits = kernels.fp8_paged_mqa_logits_cpu(
        q.to(torch.float8_e4m3fn), cache, weight, torch.tensor([5]), torch.tensor([[1, 0]]), 4, 6
    )
    expected = [0.5 * (max(k0 + k1, 0) + 0.5 * max(2 * k0 - k1, 0)) for k0, k1 in keys.tolist()]
    assert logits[0, :5].tolist() == pytest.approx(expected)
    assert logits[0, 5] == -math.inf  # past the row's length
    # Top-k: a short row keeps every key in order; a long one its 512 best, ties to the lower
    # index, each also as a cache slot through the page table.
    pages = torch.full((2, 520), 7, dtype=torch.int32)
    raw = pages.clone()
    scores = torch.zeros(2, 600)
    scores[1, 100:600] = 1.0  # 500 best, then 12 ties among 0..99 go to 0..11
    kernels.topk_transform_512_cpu(
        scores, torch.tensor([3, 600]), torch.tensor([[5] * 150, [2] * 150]), pages, 4, raw
    )
    assert raw[0, :4].tolist() == [0, 1, 2, -1] and pages[0, :3].tolist() == [20, 21, 22]
    assert sorted(raw[1, :512].tolist()) == list(range(12)) + list(range(100, 600))
    assert pages[1, 0].item() == 2 * 4 + raw[1, 0].item() % 4
    assert raw[:, 512:].eq(7).all()  # only the first 512 columns are written


def test_routing_and_hyper_connection_head() -> None:
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, 3.0]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    weights, ids = kernels.biased_topk_cpu(logits, logits, bias, 2, True, "sigmoid", 0, 2.0, True)
    assert ids.tolist() == [[0, 5]]  # the bias steers selection ...
    score = torch.sigmoid(logits[0, [0, 5]])
    assert torch.allclose(weights[0], score / score.sum() * 2.0)  # ... not the weights
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    weights, ids = kernels.hash_topk_cpu(logits, table, 2, "sqrtsoftplus", 0, 6, 1.5)
    soft = torch.nn.functional.softplus(logits[0, [4, 1]]).sqrt()
    assert ids.tolist() == [[4, 1]] and torch.allclose(weights[0], soft / soft.sum() * 1.5)
    x = torch.randn(3, 4, 8).to(torch.bfloat16)
    fn, base, scale = torch.randn(4, 32), torch.randn(4), torch.tensor([0.7])
    flat = x.float().reshape(3, 32)
    rms = flat.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    gate = torch.sigmoid(flat @ fn.T / rms * 0.7 + base)
    expected = ((gate + 1e-3)[..., None] * x.float()).sum(1)
    got = kernels.hc_head_fused_cpu(x, fn, scale, base, 1e-3, 1e-6)
    assert torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_only_missing_ops_are_registered_and_they_are_callable() -> None:
    import vllm._custom_ops  # noqa: F401 - loads vLLM's C++ library (the `_C` namespace)

    kernels.register_missing()
    assert all(hasattr(torch.ops._C, name) for name in kernels.OPS)
    assert kernels.register_missing() == []
    # The packed-weight ops, whichever library answers: vLLM's own (AVX512 builds) packs for
    # its tiled GEMM and takes only weights whose out and in features are multiples of 32;
    # the stand-in keeps the plain layout. Small integers make every product and sum exact in
    # bf16, so both must equal torch's own batched product.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (2, 32, 64), generator=gen).to(torch.bfloat16)
    mat1 = torch.randint(-2, 3, (2, 3, 64), generator=gen).to(torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(weight)
    out = torch.empty(2, 3, 32, dtype=torch.bfloat16)
    torch.ops._C.bmm_cpu(out, mat1, packed, True, None)
    assert torch.equal(out, torch.bmm(mat1.float(), weight.float().transpose(1, 2)).bfloat16())
