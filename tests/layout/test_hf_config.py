"""Layouts from a model's own ``config.json``: the fields each architecture's cache depends on,
read with Hugging Face's defaults, give exactly the bytes of the matching preset; a missing,
mistyped or contradictory field is refused with one line naming it (exit code 2 from the CLI).

The configs below carry the public models' published config.json numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.cli import main
from tessera_ray.errors import LayoutError, UnknownNameError
from tessera_ray.layout import build_layout, config_from_hf, preset_layout

LLAMA_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}


def test_llama_and_deepseek_configs_give_their_presets_bytes() -> None:
    for data, name in ((LLAMA_70B, "llama-3.1-70b"), (DEEPSEEK_V3, "deepseek-v3")):
        got = build_layout(config_from_hf(data, name=name))
        want = preset_layout(name)
        assert (got.num_layers, got.block_tokens, got.block_bytes) == (
            want.num_layers,
            want.block_tokens,
            want.block_bytes,
        ), name
        assert got.format_name == want.format_name


def test_kimi_k2_ships_the_deepseek_v3_architecture() -> None:
    kimi = {**DEEPSEEK_V3, "num_attention_heads": 64, "model_type": "kimi_k2"}
    got = build_layout(config_from_hf(kimi, name="kimi-k2"))
    assert got.block_bytes == preset_layout("kimi-k2").block_bytes


def test_defaults_explicit_head_dim_and_dtype_formats() -> None:
    # num_key_value_heads defaults to the query heads (MHA), head_dim to hidden / heads.
    mha = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    mha |= {"num_attention_heads": 8, "hidden_size": 512, "torch_dtype": "float16"}
    config = config_from_hf(mha, name="m")
    assert (config.num_kv_heads, config.head_dim, config.format) == (8, 64, "kv-fp16")
    # Qwen3 publishes head_dim apart from hidden_size / heads.
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 1024}
    qwen3 |= {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
    qwen3 |= {"dtype": "bfloat16", "layer_types": ["full_attention"] * 2}
    config = config_from_hf(qwen3, name="q")
    assert (config.num_kv_heads, config.head_dim, config.format) == (8, 128, "kv-bf16")
    layout = build_layout(config)
    assert layout.block_bytes == 2 * 2 * 8 * 128 * 2 * layout.block_tokens
    # Qwen2 lists a window that is off.
    qwen2 = {**qwen3, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    qwen2 |= {"use_sliding_window": False}
    del qwen2["layer_types"]
    assert config_from_hf(qwen2, name="q2").num_kv_heads == 8
    # A named format wins over the dtype's.
    assert config_from_hf(mha, name="m", format="kv-fp8").format == "kv-fp8"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
        ({"num_key_value_heads": 3}, "field 'num_key_value_heads' (3) must divide"),
        ({"num_attention_heads": "64"}, "field 'num_attention_heads' must be a positive integer"),
        ({"num_key_value_heads": True}, "field 'num_key_value_heads' must be a positive"),
        ({"hidden_size": 8100}, "field 'hidden_size' (8100) is not a multiple of 64 heads"),
        ({"torch_dtype": "float32"}, "field 'torch_dtype' is 'float32'"),
        ({"architectures": []}, "field 'architectures' is missing or empty"),
        ({"sliding_window": 4096}, "field 'sliding_window' turns on sliding-window"),
    ],
)
def test_bad_fields_are_named(change: dict[str, Any], needle: str) -> None:
    data = {k: v for k, v in {**LLAMA_70B, **change}.items() if v is not None}
    with pytest.raises(LayoutError) as info:
        config_from_hf(data, name="bad", source="x/config.json")
    message = str(info.value)
    assert needle in message and message.startswith("x/config.json: ")
    assert "\n" not in message


def test_mla_fields_are_required_and_unknown_architectures_named() -> None:
    data = {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(LayoutError, match="field 'kv_lora_rank' is missing"):
        config_from_hf(data, name="v3")
    with pytest.raises(UnknownNameError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"]}, name="g")


def test_cli_size_reads_a_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_70B))
    assert main(["size", "--hf-config", str(model), "--context", "32k", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["models"]
    assert got["model"] == "my-llama"
    # GQA-8 over 80 layers, width 128, bf16: 2 x 80 x 8 x 128 x 2 = 327,680 B per position.
    assert got["contexts"][0]["payload_bytes"] == 327_680 * 32 * 1024

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**LLAMA_70B, "num_key_value_heads": 3}))
    assert main(["size", "--hf-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_key_value_heads" in err
    both = ["size", "--hf-config", str(model), "--config", str(bad)]
    assert main(both) == 2
    assert "at most one of --config and --hf-config" in capsys.readouterr().err
