"""Layout data model: validation, grouping, fingerprints, purity."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from fractions import Fraction

import pytest

from tessera_ray.errors import LayoutError, UnknownNameError
from tessera_ray.layout import (
    PRESETS,
    CacheSpec,
    DType,
    EntryFormat,
    HybridV4Config,
    MLAConfig,
    PageSpec,
    Region,
    Scheme,
    account,
    build_layout,
    config_from_dict,
    preset,
    preset_layout,
)
from tests._imports import assert_loads_without


def test_layout_imports_neither_ray_nor_torch() -> None:
    assert_loads_without(
        ("tessera_ray.layout", "tessera_ray.layout.report"), ("ray", "torch", "numpy")
    )


def test_region_sizes_and_fp4_packing() -> None:
    assert Region(name="x", num_values=128, dtype=DType.FP4_E2M1).nbytes == 64
    assert Region(name="s", num_values=4, dtype=DType.FP32).nbytes == 16
    with pytest.raises(LayoutError, match="whole number of bytes"):
        Region(name="x", num_values=3, dtype=DType.FP4_E2M1)
    with pytest.raises(LayoutError, match="num_values must be a positive integer"):
        Region(name="x", num_values=-1, dtype=DType.BF16)


def test_entry_offsets_follow_region_order() -> None:
    entry = preset_layout("deepseek-v3", format="fp8_ds_mla").groups[0].page.cache.entry
    assert entry.region_offsets == {"c_kv": (0, 512), "scale": (512, 16), "k_rope": (528, 128)}
    with pytest.raises(LayoutError, match="repeats a region name"):
        EntryFormat(name="bad", regions=(entry.regions[0], entry.regions[0]))


def test_page_spec_rejects_split_compression_group() -> None:
    hca = CacheSpec(
        scheme=Scheme.HCA,
        entry=EntryFormat(name="e", regions=(Region(name="v", num_values=8, dtype=DType.BF16),)),
        stride_tokens=128,
    )
    assert PageSpec(cache=hca, block_tokens=256).entries_per_page == 2
    with pytest.raises(LayoutError, match="split the hca compression group of 128 tokens"):
        PageSpec(cache=hca, block_tokens=64)


def test_custom_block_size_that_splits_a_group_is_rejected() -> None:
    with pytest.raises(LayoutError, match="would split the hca compression group"):
        preset_layout("deepseek-v4-flash", block_tokens=64)
    assert preset_layout("deepseek-v4-flash", block_tokens=256).block_tokens == 256
    with pytest.raises(LayoutError, match="would split the csa compression group of 4"):
        build_layout(HybridV4Config(name="x", num_heads=8, compress_ratios=(0, 4), block_tokens=6))


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", -3), ("num_heads", 0), ("kv_lora_rank", -512), ("block_tokens", -64)],
)
def test_negative_dimensions_are_rejected(field: str, value: int) -> None:
    with pytest.raises(LayoutError, match=f"{field} must be a positive integer, got {value}"):
        dataclasses.replace(preset("deepseek-v3"), **{field: value})


def test_v4_rejects_unknown_compress_ratio() -> None:
    with pytest.raises(LayoutError, match="compress ratio 8 at layer 1"):
        HybridV4Config(name="x", num_heads=8, compress_ratios=(0, 8))


def test_unknown_preset_and_format_list_valid_names() -> None:
    with pytest.raises(UnknownNameError, match="valid: deepseek-v3, "):
        preset("gpt-5")
    with pytest.raises(UnknownNameError, match="valid: mla-bf16, fp8_ds_mla, mla-fp8"):
        preset_layout("deepseek-v3", format="v4-paper")


def test_layer_groups_share_identical_specs() -> None:
    v4 = preset_layout("deepseek-v4-flash")
    groups = {g.page.cache.scheme: g.layers for g in v4.groups}
    assert groups[Scheme.CSA] == tuple(range(2, 43, 2))
    assert groups[Scheme.INDEXER] == tuple(range(2, 43, 2))
    assert groups[Scheme.HCA] == tuple(range(3, 42, 2))
    (window, layers), *states = v4.windows
    assert window.scheme is Scheme.SWA
    assert window.window_tokens == 128 and layers == tuple(range(43))
    # The compressors' state: CSA's own and the indexer's (8 tokens), HCA's (128 tokens).
    assert [(s.entry.name, s.window_tokens, ls) for s, ls in states] == [
        ("v4-csa-state", 8, tuple(range(2, 43, 2))),
        ("v4-indexer-state", 8, tuple(range(2, 43, 2))),
        ("v4-hca-state", 128, tuple(range(3, 42, 2))),
    ]
    v3 = preset_layout("deepseek-v3")
    assert len(v3.groups) == 1 and v3.groups[0].layers == tuple(range(61))
    assert v3.block_bytes == 61 * 73_728


def test_fingerprint_is_stable_and_layout_sensitive() -> None:
    """Same stored layout, same fingerprint in every process; any byte-relevant change differs."""
    v3 = preset_layout("deepseek-v3")
    code = (
        "from tessera_ray.layout import preset_layout; "
        "print(preset_layout('deepseek-v3').fingerprint)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert other.stdout.strip() == v3.fingerprint
    # Kimi-K2 has DeepSeek-V3's exact page geometry, but its KV for the same tokens differs:
    # the fingerprint (and so every token key) must tell the two models apart.
    kimi = preset_layout("kimi-k2")
    assert kimi.canonical()["layers"] == v3.canonical()["layers"]
    assert kimi.fingerprint != v3.fingerprint
    variants = {
        v3.fingerprint,
        preset_layout("deepseek-v3", format="fp8_ds_mla").fingerprint,
        preset_layout("deepseek-v3", block_tokens=128).fingerprint,
        preset_layout("deepseek-v2-lite").fingerprint,
        preset_layout("deepseek-v4-flash").fingerprint,
        preset_layout("deepseek-v4-flash", format="v4-paper").fingerprint,
    }
    assert len(variants) == 6
    # Pinned: a change here changes every key in every deployed tier, so it must be deliberate.
    assert v3.fingerprint == "6aaec2437765e83f420f5614ca62b2ae"


def test_padding_and_pending_tokens_are_reported_separately() -> None:
    v3 = account(preset_layout("deepseek-v3"), 1_000)
    assert v3.payload_bytes == 1_000 * 70_272
    assert v3.stored_bytes == 16 * 64 * 70_272  # 16 whole pages per layer
    assert v3.padding_bytes == 24 * 70_272
    v4 = account(preset_layout("deepseek-v4-flash", format="v4-paper"), 1_000)
    by_scheme = {s.label.split(":")[0]: s for s in v4.specs}
    assert by_scheme["csa"].payload_bytes == 250 * 640 * 21
    assert by_scheme["hca"].payload_bytes == 7 * 576 * 20  # 7 complete 128-token groups
    assert by_scheme["hca"].pending_tokens == 1_000 - 7 * 128
    assert by_scheme["swa"].payload_bytes == 128 * 576 * 43
    assert by_scheme["hca"].stored_bytes == 8 * 576 * 20


def test_v4_paged_bytes_per_token_is_exact() -> None:
    paper = preset_layout("deepseek-v4-flash", format="v4-paper")
    assert paper.paged_bytes_per_token == 21 * 160 + 20 * Fraction(9, 2)
    assert paper.window_bytes_per_token == 43 * 576


def test_config_from_dict_validates() -> None:
    config = config_from_dict({"family": "mla", "name": "mine", "num_layers": 4, "num_heads": 8})
    assert isinstance(config, MLAConfig) and build_layout(config).paged_bytes_per_token == 4 * 1_152
    with pytest.raises(LayoutError, match=r"unknown mla config keys \['num_layer'\]"):
        config_from_dict({"family": "mla", "num_layer": 4, "num_heads": 8})
    with pytest.raises(UnknownNameError, match="unknown model family 'rnn'"):
        config_from_dict({"family": "rnn"})
    with pytest.raises(LayoutError, match="num_layers must be a positive integer, got -2"):
        config_from_dict(
            {
                "family": "full-kv",
                "num_layers": -2,
                "num_heads": 8,
                "num_kv_heads": 8,
                "head_dim": 64,
            }
        )


def test_presets_all_build_and_account() -> None:
    for name in PRESETS:
        layout = preset_layout(name)
        usage = account(layout, 4096)
        assert usage.payload_bytes > 0 and usage.stored_bytes >= usage.payload_bytes
    assert preset_layout("deepseek-v4-pro").assumed
    assert any("ASSUMED" in n for n in preset_layout("deepseek-v4-pro").notes)


def test_v4_flash_resume_record_bytes() -> None:
    """What one resume record holds for DeepSeek-V4-Flash in the engine format: every window
    keeps ``window - 1`` positions (vLLM's SlidingWindowManager): 43 layers' 128-token windows
    of 584 B; on the 21 CSA layers 7 positions of the compressor's own fp32 state (2 x 2 x 512
    values) and the indexer compressor's (2 x 2 x 128); on the 20 HCA layers 127 positions of
    2 x 512 values (vLLM 0.32.0, CompressorStateCache)."""
    from tessera_ray.layout import preset_layout

    flash = preset_layout("deepseek-v4-flash", format="v4-model1")
    swa = 43 * 127 * 584
    csa = 21 * 7 * (2 * 2 * 512 + 2 * 2 * 128) * 4
    hca = 20 * 127 * 2 * 512 * 4
    assert flash.resume_bytes == swa + csa + hca == 15_098_344
    # The paper payload keeps only the windows (576 B entries), no compressor state.
    assert preset_layout("deepseek-v4-flash", format="v4-paper").resume_bytes == 43 * 127 * 576
    # Models without windows have no record.
    assert preset_layout("deepseek-v3").resume_bytes == 0
