"""DeepSeek-V4 from its own ``config.json`` (DeepSeek's format: ``compress_ratios`` per layer):
the V4-Flash config gives the preset's layout; a missing, mistyped or contradictory field is
refused with one line naming it; ``tessera-ray size --hf-config`` adds vLLM's caches for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.cli import main
from tessera_ray.errors import LayoutError
from tessera_ray.layout import HybridV4Config, build_layout, config_from_hf, preset_layout

# The attention fields of DeepSeek-V4-Flash's public config.json (docs/reference.md): 43 layers,
# 44 compress ratios (the last one the MTP layer's).
V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_hidden_layers": 43,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "sliding_window": 128,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
# The smallest V4 vLLM's CPU build runs (V4.md): one window-only, one CSA, one HCA layer.
TINY = {**V4_FLASH, "num_hidden_layers": 3, "compress_ratios": [0, 4, 128], "hidden_size": 256}
TINY |= {"num_attention_heads": 16, "num_nextn_predict_layers": 0}


def test_v4_flash_config_gives_the_preset_layout() -> None:
    config = config_from_hf(V4_FLASH, name="deepseek-v4-flash")
    assert isinstance(config, HybridV4Config)
    assert config.format == "v4-model1" and config.num_layers == 43
    assert config.notes == (
        "compress_ratios lists 44 layers for 43 hidden layers: the last 1 (MTP) are not counted",
    )
    got, want = build_layout(config), preset_layout("deepseek-v4-flash")
    assert got.canonical() == want.canonical()
    assert got.fingerprint == want.fingerprint
    assert (got.block_bytes, got.mha_bytes_per_token) == (
        want.block_bytes,
        want.mha_bytes_per_token,
    )
    tiny = config_from_hf(TINY, name="tiny")
    assert tiny.notes == () and tiny.compress_ratios == (0, 4, 128)
    assert config_from_hf(TINY, name="t", format="v4-paper").format == "v4-paper"
    assert config_from_hf({**TINY, "torch_dtype": "float16"}, name="t").format == "v4-model1"
    no_dtype = {k: v for k, v in TINY.items() if k != "torch_dtype"}
    assert config_from_hf(no_dtype, name="t").format == "v4-model1"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
        ({"compress_ratios": None}, "field 'compress_ratios' must be a non-empty list"),
        ({"compress_ratios": "0,4,128"}, "field 'compress_ratios' must be a non-empty list"),
        ({"compress_ratios": [0, 4]}, "field 'compress_ratios' has 2 entries, fewer than"),
        ({"compress_ratios": [0, 8, 128]}, "field 'compress_ratios' entry 1 is 8; each must"),
        ({"compress_ratios": [0, 4, True]}, "field 'compress_ratios' entry 2 is True"),
        ({"compress_ratios": [0, 4.0, 128]}, "field 'compress_ratios' entry 1 is 4.0"),
        ({"head_dim": None}, "field 'head_dim' is missing"),
        ({"qk_rope_head_dim": 512}, "field 'qk_rope_head_dim' (512) must be less than head_dim"),
        ({"index_head_dim": None}, "field 'index_head_dim' is missing"),
        ({"sliding_window": 0}, "field 'sliding_window' must be a positive integer, got 0"),
        ({"num_attention_heads": "16"}, "field 'num_attention_heads' must be a positive"),
        ({"num_key_value_heads": 2}, "field 'num_key_value_heads' is 2; DeepSeek-V4 keeps one"),
        ({"torch_dtype": "float32"}, "field 'torch_dtype' is 'float32'"),
    ],
)
def test_bad_fields_are_named(change: dict[str, Any], needle: str) -> None:
    data = {k: v for k, v in {**TINY, **change}.items() if v is not None}
    with pytest.raises(LayoutError) as info:
        config_from_hf(data, name="bad", source="v4/config.json")
    message = str(info.value)
    assert needle in message and message.startswith("v4/config.json: "), message
    assert "\n" not in message


def _model_dir(root: Path, data: dict[str, Any]) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(data))
    return root


def test_cli_size_carries_vllms_caches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_dir(tmp_path / "tiny-v4", TINY)
    assert main(["size", "--hf-config", str(model), "--context", "1k", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["models"]
    assert (got["model"], got["format"], got["block_tokens"]) == ("tiny-v4", "v4-model1", 128)
    assert got["block_bytes"] == 23_496  # the tier's block is unchanged (test_engine_pages.py)
    engine = got["engine"]
    assert engine["engine"] == "vllm 0.32.0"
    rows = [(c["spec"], c["layers"], c["block_tokens"], c["page_bytes"]) for c in engine["caches"]]
    assert rows == [
        ("csa:v4-model1/4", [1], 256, 37_440),
        ("indexer:v4-indexer/4", [1], 256, 8_640),
        ("hca:v4-model1/128", [2], 256, 1_728),
        ("swa:v4-model1 window 128", [0, 1, 2], 64, 37_440),
        ("compressor-state:v4-csa-state window 8", [1], 4, 32_832),
        ("compressor-state:v4-indexer-state window 8", [1], 4, 8_640),
        ("compressor-state:v4-hca-state window 128", [2], 8, 32_832),
    ]
    assert [c["bytes_per_token"] for c in engine["caches"]] == [
        "585/4",
        "135/4",
        "27/4",
        "585",
        "8208",
        "2160",
        "4104",
    ]
    assert (engine["page_bytes"], engine["paged_block_bytes"]) == (234_432, 47_808)
    assert (engine["paged_bytes_per_token"], engine["window_bytes_per_token"]) == ("747/4", "16227")

    assert main(["size", "--hf-config", str(model), "--context", "1k"]) == 0
    text = capsys.readouterr().out
    assert "vllm 0.32.0 allocates" in text
    assert "hca:v4-model1/128 x 1 layers: block 256 tokens, page 1,728 B (560 B padding)" in text
    assert "total: 234,432 B for a page of every cache and layer; 47,808 B" in text


def test_other_models_and_the_paper_format_show_no_engine_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["size", "--model", "deepseek-v3", "--context", "1k", "--json"]) == 0
    assert "engine" not in json.loads(capsys.readouterr().out)["models"][0]
    args = ["size", "--model", "deepseek-v4-flash", "--format", "v4-paper", "--context", "1k"]
    assert main([*args, "--json"]) == 0
    assert "engine" not in json.loads(capsys.readouterr().out)["models"][0]
    assert main(args) == 0
    assert "allocates" not in capsys.readouterr().out


def test_cli_refuses_a_bad_v4_config_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_dir(tmp_path / "bad", {**TINY, "compress_ratios": [0, 4]})
    assert main(["size", "--hf-config", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field 'compress_ratios' has 2 entries" in err
