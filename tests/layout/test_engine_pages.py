"""vLLM's own pages for a layout, by hand: each expected figure is written as the arithmetic vLLM
0.32.0 does, with the source line it comes from (paths inside the ``vllm`` package).
``tests/vllm/test_hf_layouts.py`` checks the same figures against vLLM's own spec objects."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tessera_ray.errors import LayoutError
from tessera_ray.layout import (
    EngineCache,
    HybridV4Config,
    ModelLayout,
    build_layout,
    engine_pages,
    preset_layout,
)
from tessera_ray.layout.engine_pages import V4_BLOCK_TOKENS


def round_up(value: int, multiple: int) -> int:
    # v1/kv_cache_interface.py:680 (_apply_alignment_padding): the page rounded up to alignment.
    return -(-value // multiple) * multiple


# models/deepseek_v4/attention.py:873,878 and compressor.py:191, sparse_swa.py:85: fp8_ds_mla
# pages align to 576 B; a compressed / window entry is 584 B.
ALIGN = 576
ENTRY = 584
# models/deepseek_v4/attention.py:1012-1013: the indexer key, 128 fp8 + 128 // 128 * 4 scale bytes.
INDEX = 128 + 128 // 128 * 4
# models/deepseek_v4/compressor.py:283: state_dim = 2 x coff x head_dim fp32 values, coff 2 for
# ratio 4 (line 240), 1 for ratio 128.
CSA_STATE = 2 * 2 * 512 * 4
INDEXER_STATE = 2 * 2 * 128 * 4
HCA_STATE = 2 * 1 * 512 * 4

TINY = HybridV4Config(name="tiny-v4", num_heads=16, compress_ratios=(0, 4, 128))


def by_label(layout: ModelLayout) -> dict[str, EngineCache]:
    return {c.label(): c for c in engine_pages(layout).caches}


def test_tiny_v4_pages_equal_vllms_arithmetic() -> None:
    caches = by_label(build_layout(TINY))
    # The compressed caches: platforms/cpu.py:291 forces block 256 (the sparse MLA backend's only
    # kernel block, models/deepseek_v4/sparse_mla.py:61); num_states = 256 // tokens_per_state
    # (v1/kv_cache_interface.py:233), page = states x entry (line 553), then aligned.
    expected = {
        "csa:v4-model1/4": ((1,), 256, round_up(256 // 4 * ENTRY, ALIGN)),
        "indexer:v4-indexer/4": ((1,), 256, round_up(256 // 4 * INDEX, ALIGN)),
        "hca:v4-model1/128": ((2,), 256, round_up(256 // 128 * ENTRY, ALIGN)),
        # v1/attention/backends/mla/sparse_swa.py:83: the window's block is 64 tokens.
        "swa:v4-model1 window 128": ((0, 1, 2), 64, round_up(64 * ENTRY, ALIGN)),
        # models/deepseek_v4/compressor.py:160,169,171: window coff x ratio; block 4 for ratio 4,
        # 8 for ratio 128; one state per token.
        "compressor-state:v4-csa-state window 8": ((1,), 4, round_up(4 * CSA_STATE, ALIGN)),
        "compressor-state:v4-indexer-state window 8": (
            (1,),
            4,
            round_up(4 * INDEXER_STATE, ALIGN),
        ),
        "compressor-state:v4-hca-state window 128": ((2,), 8, round_up(8 * HCA_STATE, ALIGN)),
    }
    assert {k: (c.layers, c.block_tokens, c.page_bytes) for k, c in caches.items()} == expected
    pages = [c.page_bytes for c in caches.values()]
    assert pages == [37_440, 8_640, 1_728, 37_440, 32_832, 8_640, 32_832]
    assert caches["hca:v4-model1/128"].padding_bytes == 1_728 - 2 * 584 == 560
    assert caches["csa:v4-model1/4"].bytes_per_token == Fraction(37_440, 256)


def test_tiny_v4_totals() -> None:
    layout = build_layout(TINY)
    pages = engine_pages(layout)
    assert pages.engine == "vllm 0.32.0"
    assert pages.page_bytes == 37_440 + 8_640 + 1_728 + 3 * 37_440 + 32_832 + 8_640 + 32_832
    assert pages.page_bytes == 234_432
    # The whole-context caches: what vLLM packs into its pool's block (V4.md: 47,808 B).
    assert pages.paged_block_bytes == 37_440 + 8_640 + 1_728 == 47_808
    assert pages.paged_bytes_per_token == Fraction(47_808, 256)
    assert pages.window_bytes_per_token == Fraction(3 * 37_440, 64) + Fraction(
        32_832 + 8_640, 4
    ) + Fraction(32_832, 8)
    # The tier's own block is untouched: 128 tokens, unpadded entries.
    assert layout.block_tokens == 128
    assert layout.block_bytes == 128 // 4 * (584 + 132) + 584 == 23_496


def test_v4_flash_totals() -> None:
    pages = engine_pages(preset_layout("deepseek-v4-flash"))
    counts = {c.label(): len(c.layers) for c in pages.caches}
    assert list(counts.values()) == [21, 21, 20, 43, 21, 21, 20]
    assert pages.paged_block_bytes == 21 * 37_440 + 21 * 8_640 + 20 * 1_728 == 1_002_240
    assert pages.page_bytes == 1_002_240 + 43 * 37_440 + 21 * (32_832 + 8_640) + 20 * 32_832
    assert pages.paged_bytes_per_token == Fraction(1_002_240, 256) == 3_915


def test_engine_block_override_and_row_formats() -> None:
    # Only the caches whose block vLLM's block_size sets follow an override.
    caches = engine_pages(build_layout(TINY), block_tokens=512).caches
    assert [c.block_tokens for c in caches] == [512, 512, 512, 64, 4, 4, 8]
    assert caches[0].page_bytes == round_up(512 // 4 * ENTRY, ALIGN)
    # MLA and full attention: block_size rows, no padding; default block is the tier's.
    (mla,) = engine_pages(preset_layout("deepseek-v3")).caches
    assert (mla.block_tokens, mla.page_bytes, mla.padding_bytes) == (64, 64 * 1_152, 0)
    (ds,) = engine_pages(preset_layout("deepseek-v3", format="fp8_ds_mla"), block_tokens=16).caches
    assert ds.page_bytes == 16 * 656
    (gqa,) = engine_pages(preset_layout("llama-3.1-70b")).caches
    assert gqa.page_bytes == gqa.block_tokens * 2 * 8 * 128 * 2


def test_formats_vllm_does_not_store_are_refused() -> None:
    with pytest.raises(LayoutError, match="'v4-paper' is not what vLLM stores"):
        engine_pages(preset_layout("deepseek-v4-flash", format="v4-paper"))
    with pytest.raises(LayoutError, match="'mla-fp8' is not what vLLM stores"):
        engine_pages(preset_layout("deepseek-v3", format="mla-fp8"))
    with pytest.raises(LayoutError, match="splits the csa group of 4 tokens"):
        engine_pages(build_layout(TINY), block_tokens=V4_BLOCK_TOKENS + 2)
    with pytest.raises(LayoutError, match="engine block_tokens must be a positive integer"):
        engine_pages(build_layout(TINY), block_tokens=0)


def test_paper_payload_keeps_no_compressor_state() -> None:
    model1 = build_layout(TINY)
    assert [s.label() for s, _ in model1.windows] == [
        "swa:v4-model1 window 128",
        "compressor-state:v4-csa-state window 8",
        "compressor-state:v4-indexer-state window 8",
        "compressor-state:v4-hca-state window 128",
    ]
    (state, _) = model1.windows[1]
    assert [(r.name, r.num_values, r.dtype.value) for r in state.entry.regions] == [
        ("kv_state", 1024, "fp32"),
        ("score_state", 1024, "fp32"),
    ]
    paper = build_layout(
        HybridV4Config(name="p", num_heads=16, compress_ratios=(0, 4, 128), format="v4-paper")
    )
    assert [s.label() for s, _ in paper.windows] == ["swa:v4-paper window 128"]
