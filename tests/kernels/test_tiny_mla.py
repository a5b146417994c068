"""The tiny MLA model: deterministic, decode from pages matches its dense forward, and moving
pages to other slots changes nothing (bit-exact)."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.errors import KernelError, LayoutError
from tessera_ray.models import TinyMLA, TinyMLAConfig

PAGE = 16


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> TinyMLA:
    return TinyMLA(TinyMLAConfig(seed=0))


def test_same_seed_same_model_other_seed_other_model(model: TinyMLA) -> None:
    toks = _tokens(12)
    again = TinyMLA(TinyMLAConfig(seed=0)).prefill(toks)
    first = model.prefill(toks)
    assert torch.equal(first.logits, again.logits)
    assert all(torch.equal(a.c_kv, b.c_kv) for a, b in zip(first.kv, again.kv, strict=True))
    other = TinyMLA(TinyMLAConfig(seed=1)).prefill(toks)
    assert not torch.allclose(first.logits, other.logits)
    assert first.kv[0].c_kv.shape == (12, 512) and first.kv[0].k_rope.shape == (12, 64)


def test_prefill_then_paged_decode_matches_dense_forward(model: TinyMLA) -> None:
    """Absorbed decode over pages (non-contiguous table) == non-absorbed dense forward."""
    toks = _tokens(45)
    dense = model.forward_dense(toks)
    pre = model.prefill(toks[:30])
    torch.testing.assert_close(pre.logits, dense[:30], atol=0, rtol=0)  # causal: prefix-stable
    pages = model.new_pages(6, PAGE)
    table = torch.tensor([[4, 1, 5]], dtype=torch.int32)
    model.write_prefill(pre.kv, pages, table[0])
    scale = dense.abs().max()
    for p in range(30, 45):
        logits = model.decode_step(toks[p : p + 1], torch.tensor([p]), pages, table)
        assert (logits[0] - dense[p]).abs().max() <= 2e-6 * scale, p


def test_ragged_batch_decode_matches_each_sequence_alone(model: TinyMLA) -> None:
    a, b = _tokens(20, seed=2), _tokens(7, seed=3)
    pages = model.new_pages(8, PAGE)
    table = torch.tensor([[6, 0], [3, 7]], dtype=torch.int32)
    model.write_prefill(model.prefill(a[:19]).kv, pages, table[0])
    model.write_prefill(model.prefill(b[:6]).kv, pages, table[1])
    logits = model.decode_step(torch.stack([a[19], b[6]]), torch.tensor([19, 6]), pages, table)
    for row, seq in ((0, a), (1, b)):
        want = model.forward_dense(seq)[-1]
        assert (logits[row] - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_from_pages_copied_to_other_slots_is_bit_exact(
    model: TinyMLA, dtype: torch.dtype
) -> None:
    toks = _tokens(40, seed=4)
    pre = model.prefill(toks[:33])
    pages_a = model.new_pages(5, PAGE, dtype=dtype)
    table_a = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    model.write_prefill(pre.kv, pages_a, table_a[0])
    # Move every page to another slot, byte for byte, and rewrite the table to follow.
    perm = torch.tensor([3, 0, 4, 1, 2])
    pages_b = model.new_pages(5, PAGE, dtype=dtype)
    for src, dst in zip(pages_a, pages_b, strict=True):
        dst.view(torch.uint8)[perm] = src.view(torch.uint8)
    table_b = perm[table_a.long()].to(torch.int32)
    for p in range(33, 40):
        step = (toks[p : p + 1], torch.tensor([p]))
        got = model.decode_step(*step, pages_b, table_b)
        want = model.decode_step(*step, pages_a, table_a)
        assert torch.equal(got, want), p
    for src, dst in zip(pages_a, pages_b, strict=True):  # the decode writes landed alike too
        assert torch.equal(dst[perm], src)


def test_bf16_pages_stay_close_to_fp32(model: TinyMLA) -> None:
    toks = _tokens(24, seed=5)
    dense = model.forward_dense(toks)
    pages = model.new_pages(2, PAGE, dtype=torch.bfloat16)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    model.write_prefill(model.prefill(toks[:23]).kv, pages, table[0])
    logits = model.decode_step(toks[23:], torch.tensor([23]), pages, table)
    rel = ((logits[0] - dense[23]).abs().max() / dense[23].abs().max()).item()
    assert 0 < rel < 2e-2  # bf16 rounding of the stored KV shows, but stays small


def test_misuse_raises_clear_errors(model: TinyMLA) -> None:
    pages = model.new_pages(2, PAGE)
    kv = model.prefill(_tokens(40)).kv
    with pytest.raises(KernelError, match="held pages"):
        model.write_prefill(kv, pages, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(KernelError, match="token ids"):
        model.prefill([0, 999])
    with pytest.raises(KernelError, match="all 2 layers"):
        model.decode_step(
            torch.tensor([1]), torch.tensor([0]), pages[:1], torch.zeros(1, 1, dtype=torch.int32)
        )
    with pytest.raises(LayoutError, match="num_heads"):
        TinyMLAConfig(num_heads=0)
