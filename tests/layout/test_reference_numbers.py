"""Every number of docs/reference.md's byte accounting, pinned exactly.

Where a seed document prints a different figure, the test asserts the exact value and its
docstring says why the seed differs.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

from tessera_ray.layout import Scheme, account, preset_layout

GIB = 1 << 30
KIB = 1 << 10


def gib(nbytes: int, places: int) -> float:
    """GiB rounded half up, as the reference tables round (38.125 -> 38.13)."""
    exact = Decimal(nbytes) / Decimal(GIB)
    return float(exact.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def per_token(model: str, fmt: str | None = None) -> Fraction:
    return preset_layout(model, format=fmt).paged_bytes_per_token


def test_deepseek_v3_mla_bf16_is_70272_bytes_per_token() -> None:
    """61 layers x (512 + 64) values x 2 bytes = 70,272 B = 68.625 KiB per position."""
    assert per_token("deepseek-v3") == 70_272
    assert Fraction(70_272, KIB) == Fraction(68625, 1000)


def test_deepseek_v3_at_32k_is_2302672896_bytes() -> None:
    usage = account(preset_layout("deepseek-v3"), 32_768)
    assert usage.payload_bytes == 2_302_672_896
    assert Fraction(usage.payload_bytes, GIB) == Fraction("2.14453125")
    assert usage.padding_bytes == 0


def test_seed002_mha_gqa_mqa_per_position() -> None:
    """Seed 002: 80 layers, 64 query heads, width 128, bf16: 2,560 / 320 / 40 KiB per position."""
    assert per_token("dense-80l-mha") == 2_621_440 == 2_560 * KIB
    assert per_token("dense-80l-gqa8") == 327_680 == 320 * KIB
    assert per_token("dense-80l-mqa") == 40_960 == 40 * KIB
    assert per_token("llama-3.1-70b") == 327_680


def test_seed002_at_32k_positions() -> None:
    sizes = [
        account(preset_layout(m), 32_768).payload_bytes
        for m in ("dense-80l-mha", "dense-80l-gqa8", "dense-80l-mqa")
    ]
    assert sizes == [80 * GIB, 10 * GIB, GIB + GIB // 4]


def test_mla_against_gqa8_ratio() -> None:
    ratio = per_token("deepseek-v3") / per_token("dense-80l-gqa8")
    assert ratio == Fraction(70_272, 327_680)
    assert round(float(ratio), 4) == 0.2145


def test_deepseek_v3_mha_equivalent_is_3997696_bytes() -> None:
    """2 x 61 x 128 heads x 128 x 2 B = 3,997,696 B per token: 30.5 / 122 / 488 GiB, 3.8125 TiB."""
    layout = preset_layout("deepseek-v3")
    assert layout.mha_bytes_per_token == 3_997_696
    mha = [account(layout, n).mha_bytes for n in (8 << 10, 32 << 10, 128 << 10, 1 << 20)]
    assert [Fraction(b, GIB) for b in mha[:3]] == [Fraction("30.5"), 122, 488]
    assert Fraction(mha[3], 1 << 40) == Fraction("3.8125")


def test_mla_over_mha_ratio_is_exactly_512_over_9() -> None:
    """The exact ratio is 56.888...; the seed's 56.2x and 56.6x come from rounded table cells."""
    usage = account(preset_layout("deepseek-v3"), 131_072)
    assert usage.ratio == Fraction(512, 9)
    assert f"{float(usage.ratio):.3f}" == "56.889"


def test_deepseek_v3_mla_gib_by_context() -> None:
    """Exact MLA bf16 GiB at 8K..1M. The seed's rows (2.17, 8.68, 34.72, 69.44 GiB) are about
    1.2% high: they do not follow from 61 x 576 x 2 B at any context."""
    layout = preset_layout("deepseek-v3")
    contexts = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20]
    sizes = [account(layout, n).payload_bytes for n in contexts]
    assert [gib(b, 3) for b in sizes[:3]] == [0.536, 2.145, 8.578]
    assert [gib(b, 2) for b in sizes[3:]] == [34.31, 68.63]
    assert Fraction(sizes[-1], GIB) == Fraction("68.625")  # exact: 2^20 x 70,272 B
    assert 69.44 / 68.625 == pytest.approx(1.0119, abs=1e-3)


def test_fp8_mla_layouts_by_context() -> None:
    """The seed's FP8 rows (1.21, 4.84, 19.4, 38.7 GiB) match neither a 640 B/layer layout
    (512 fp8 + 64 bf16) nor FlashMLA's 656 B fp8_ds_mla: both are computed here exactly.

    A published table lists the 656 B layout at 128K as 4.89 GiB; the exact value is
    131,072 x 40,016 B = 5,244,977,152 B = 4.8848 GiB, which rounds to 4.88."""
    contexts = [32 << 10, 128 << 10, 512 << 10, 1 << 20]
    plain = preset_layout("deepseek-v3", format="mla-fp8")
    ds = preset_layout("deepseek-v3", format="fp8_ds_mla")
    assert plain.paged_bytes_per_token == 61 * 640
    assert ds.paged_bytes_per_token == 61 * 656
    assert [gib(account(plain, n).payload_bytes, 2) for n in contexts] == [1.19, 4.77, 19.06, 38.13]
    assert [gib(account(ds, n).payload_bytes, 2) for n in contexts] == [1.22, 4.88, 19.54, 39.08]
    assert Fraction(account(ds, 128 << 10).payload_bytes, GIB) == Fraction(5_244_977_152, GIB)
    seed = [1.21, 4.84, 19.4, 38.7]
    for got in ([gib(account(lay, n).payload_bytes, 2) for n in contexts] for lay in (plain, ds)):
        assert got != seed


def _spec(layout_name: str, fmt: str, scheme: Scheme):
    layout = preset_layout(layout_name, format=fmt)
    for specs in layout.layers:
        for spec in specs:
            if spec.scheme is scheme:
                return spec
    raise AssertionError(f"{scheme} not in {layout_name}")


def test_v4_paper_payloads() -> None:
    """CSA: 64 bf16 + 448 fp8 + 128 fp4 = 640 B per 4 tokens = 160 B/token. HCA: 576 B per 128
    tokens = 9/2 B/token (the seed prints 4: it truncates). SWA: 576 B/token."""
    csa = _spec("deepseek-v4-flash", "v4-paper", Scheme.CSA)
    hca = _spec("deepseek-v4-flash", "v4-paper", Scheme.HCA)
    swa = _spec("deepseek-v4-flash", "v4-paper", Scheme.SWA)
    assert (csa.bytes_per_group, csa.stride_tokens, csa.bytes_per_token) == (640, 4, 160)
    assert (hca.bytes_per_group, hca.stride_tokens, hca.bytes_per_token) == (
        576,
        128,
        Fraction(9, 2),
    )
    assert hca.bytes_per_token != 4
    assert (swa.bytes_per_token, swa.window_tokens) == (576, 128)


def test_engine_physical_formats() -> None:
    """FlashMLA bf16 1,152 B; fp8_ds_mla 656 B; V4 MODEL1 584 B; V4 indexer 132 B per entry."""
    assert _spec("deepseek-v3", "mla-bf16", Scheme.MLA).bytes_per_token == 1_152
    ds = _spec("deepseek-v3", "fp8_ds_mla", Scheme.MLA)
    assert ds.bytes_per_token == 656
    assert [(r.name, r.nbytes) for r in ds.entry.regions] == [
        ("c_kv", 512),
        ("scale", 16),
        ("k_rope", 128),
    ]
    model1 = _spec("deepseek-v4-flash", "v4-model1", Scheme.SWA)
    assert model1.bytes_per_token == 584
    assert [(r.name, r.nbytes) for r in model1.entry.regions] == [
        ("kv_nope", 448),
        ("k_rope", 128),
        ("scale", 7),
        ("pad", 1),
    ]
    indexer = _spec("deepseek-v4-flash", "v4-model1", Scheme.INDEXER)
    assert indexer.bytes_per_group == 132
    assert [(r.name, r.nbytes) for r in indexer.entry.regions] == [
        ("index_key", 128),
        ("index_scale", 4),
    ]


def test_block_sizes_are_derived() -> None:
    """64 tokens for MLA (FlashMLA's page); lcm(4, 128, 64) = 128 for V4."""
    assert preset_layout("deepseek-v3").block_tokens == 64
    assert preset_layout("kimi-k2").block_tokens == 64
    assert preset_layout("deepseek-v4-flash").block_tokens == 128
    assert preset_layout("deepseek-v4-flash", format="v4-paper").block_tokens == 128
    assert preset_layout("deepseek-v3").groups[0].page.page_bytes == 64 * 1_152 == 73_728


def test_v4_flash_layer_map() -> None:
    """Layers 0-1 window only, then CSA / HCA alternating: 21 CSA, 20 HCA, 43 windows. In the
    engine format a CSA layer also keeps two compressor states (its own, the indexer's), an HCA
    layer one; the paper payload keeps none."""
    layout = preset_layout("deepseek-v4-flash")
    schemes = [tuple(s.scheme for s in specs) for specs in layout.layers]
    state = Scheme.COMPRESSOR_STATE
    assert layout.num_layers == 43
    assert schemes[0] == schemes[1] == (Scheme.SWA,)
    assert schemes[2] == (Scheme.CSA, Scheme.INDEXER, Scheme.SWA, state, state)
    assert schemes[3] == (Scheme.HCA, Scheme.SWA, state)
    paper = preset_layout("deepseek-v4-flash", format="v4-paper")
    assert [tuple(s.scheme for s in specs) for specs in paper.layers][2:4] == [
        (Scheme.CSA, Scheme.SWA),
        (Scheme.HCA, Scheme.SWA),
    ]
    assert sum(Scheme.CSA in s for s in schemes) == 21
    assert sum(Scheme.HCA in s for s in schemes) == 20
    assert sum(Scheme.SWA in s for s in schemes) == 43
