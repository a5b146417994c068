"""fp8_ds_mla pages: byte layout, round-trip bound, and decode over them against bf16 pages."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.errors import KernelError
from tessera_ray.kernels import (
    dequantize_fp8_ds_mla,
    fp8_ds_mla_error_bound,
    fp8_ds_mla_layout,
    mla_decode_fp8_reference,
    mla_decode_reference,
    quantize_fp8_ds_mla,
)
from tessera_ray.layout import preset_layout
from tessera_ray.models import TinyMLA

# Measured on the tiny model's real KV (seed 0, 4 heads, 100 tokens, 2 query rows): decode over
# fp8 pages differs from decode over the same KV in bf16 pages by 3.3% (layer 0) and 3.6%
# (layer 1) of the output's largest magnitude, lse by at most 0.017. Per latent value the
# round trip's relative RMS error is 2.6%. The test bounds keep headroom over those figures.
FP8_DECODE_REL_BOUND = 0.06


def test_layout_comes_from_the_layout_package() -> None:
    layout = fp8_ds_mla_layout()
    assert (layout.c_kv_offset, layout.scale_offset, layout.rope_offset) == (0, 512, 528)
    assert layout.entry_bytes == 656 and layout.num_tiles == 4 and layout.head_dim == 576
    spec = preset_layout("deepseek-v3", format="fp8_ds_mla").groups[0].page
    assert spec.entry_bytes == layout.entry_bytes


def _wide_range_pages(seed: int = 0) -> torch.Tensor:
    """Values spanning many orders of magnitude inside one tile, an all-zero tile, and exact
    powers of two, so the subnormal and the relative branch of the bound are both exercised."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 8, 1, 576, generator=gen) * torch.exp(
        4 * torch.randn(3, 8, 1, 576, generator=gen)
    )
    x[0, 0, 0, :128] = 0.0
    x[0, 1, 0, :4] = torch.tensor([448.0, -(2.0**-20), 1e-30, 0.0])
    return x.bfloat16()


@pytest.mark.parametrize("pow2", [False, True])
def test_round_trip_within_the_format_bound(pow2: bool) -> None:
    x = _wide_range_pages()
    pages = quantize_fp8_ds_mla(x, pow2_scales=pow2)
    assert pages.dtype == torch.uint8 and pages.shape == (3, 8, 656)
    back = dequantize_fp8_ds_mla(pages)
    assert back.shape == (3, 8, 1, 576) and back.dtype == torch.float32
    err = (back - x.float()).squeeze(2).abs()
    bound = fp8_ds_mla_error_bound(x, pow2_scales=pow2)
    assert bool((err <= bound).all()), (err / bound.clamp_min(1e-38)).max()
    assert torch.equal(back[..., 512:], x[..., 512:].float())  # bf16 RoPE stored as is
    assert (back[0, 0, 0, :128] == 0).all()
    # Normal-range values: relative error at most 2^-4 (e4m3, 3 mantissa bits).
    big = x.float().squeeze(2)[..., :512].abs() > 1e-2 * x.float().abs().amax()
    rel = (err[..., :512][big] / x.float().squeeze(2)[..., :512].abs()[big]).max().item()
    assert 0 < rel <= 2.0**-4


def test_bound_is_tight_enough_to_catch_a_wrong_scale() -> None:
    """An off-by-2 scale (e.g. dividing by 224 instead of 448) would break the bound."""
    x = _wide_range_pages(seed=1)
    pages = quantize_fp8_ds_mla(x)
    scales = pages[..., 512:528].contiguous().view(torch.float32)
    pages[..., 512:528] = (scales * 1.5).contiguous().view(torch.uint8)
    err = (dequantize_fp8_ds_mla(pages) - x.float()).squeeze(2).abs()
    assert not bool((err <= fp8_ds_mla_error_bound(x)).all())


def test_decode_over_fp8_pages_is_close_to_bf16_decode() -> None:
    model = TinyMLA()
    pre = model.prefill(torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(7)))
    pages = model.new_pages(3, 64, dtype=torch.bfloat16)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    model.write_prefill(pre.kv, pages, table[0])
    k_bf16 = pages[1]  # layer 1: c_kv there depends on the context, as in a real model
    fp8 = quantize_fp8_ds_mla(k_bf16)
    q = torch.randn(1, 2, 4, 576, generator=torch.Generator().manual_seed(8))
    lens = torch.tensor([100], dtype=torch.int32)
    want_out, want_lse = mla_decode_reference(q, k_bf16, table, lens, 0.05, True)
    got_out, got_lse = mla_decode_fp8_reference(q, fp8, table, lens, 0.05, True)
    rel = ((got_out - want_out).abs().max() / want_out.abs().max()).item()
    assert 0 < rel < FP8_DECODE_REL_BOUND
    assert (got_lse - want_lse).abs().max() < 0.04
    # Pages the table does not use are never read: garbage there changes nothing.
    fp8[1] = 255  # 0xff bytes: NaN fp8 values and NaN scales
    again = mla_decode_fp8_reference(q, fp8, table, lens, 0.05, True)
    assert torch.equal(again[0], got_out)


def test_fp8_decode_handles_empty_and_rejects_bad_pages() -> None:
    pages = quantize_fp8_ds_mla(torch.randn(2, 4, 1, 576))
    q = torch.randn(1, 1, 2, 576)
    out, lse = mla_decode_fp8_reference(
        q,
        pages,
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        0.1,
        False,
    )
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(KernelError, match="uint8"):
        mla_decode_fp8_reference(
            q,
            pages.float(),
            torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            0.1,
            False,
        )
    with pytest.raises(KernelError, match="num_pages"):
        mla_decode_fp8_reference(
            q,
            pages,
            torch.tensor([[5]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            0.1,
            False,
        )
    with pytest.raises(KernelError, match="576"):
        quantize_fp8_ds_mla(torch.randn(2, 4, 1, 512))
