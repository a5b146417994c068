"""``tessera-ray size --hf-config`` against vLLM's own reading of the same ``config.json``: for
every architecture the layout package reads, the tier's bytes per token and layer, times a
block, equal the page size of the cache spec vLLM builds for that model (``FullAttentionSpec``
or ``MLAAttentionSpec``, from vLLM's ``ModelConfig``: its KV heads, head size, layers, dtype)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.cli import main
from tessera_ray.layout import HF_ARCHITECTURES
from tests.vllm._engine import TINY_MLA_CONFIG

_COMMON = {"vocab_size": 1000, "max_position_embeddings": 4096, "intermediate_size": 512}
_FULL = {"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 256} | _COMMON
_MLA = {k: v for k, v in TINY_MLA_CONFIG.items() if k not in ("architectures", "model_type")}
CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _FULL | {"model_type": "llama", "num_key_value_heads": 2},
    "MistralForCausalLM": _FULL | {"model_type": "mistral", "sliding_window": None},
    "Qwen2ForCausalLM": _FULL
    | {"model_type": "qwen2", "num_key_value_heads": 2, "use_sliding_window": False},
    "Qwen3ForCausalLM": _FULL
    | {"model_type": "qwen3", "num_key_value_heads": 4, "head_dim": 64, "torch_dtype": "float16"},
    "DeepseekV2ForCausalLM": _MLA | {"model_type": "deepseek_v2"},
    "DeepseekV3ForCausalLM": _MLA
    | {"model_type": "deepseek_v3", "num_attention_heads": 8, "num_key_value_heads": 8},
}


def test_every_supported_architecture_has_a_config_here() -> None:
    assert set(CONFIGS) == set(HF_ARCHITECTURES)


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
@pytest.mark.parametrize("block", [16, 64])
def test_tier_page_equals_vllms_page(
    architecture: str, block: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model = tmp_path / architecture.lower()
    model.mkdir()
    data = {"architectures": [architecture], "torch_dtype": "bfloat16", **CONFIGS[architecture]}
    (model / "config.json").write_text(json.dumps(data))
    args = ["size", "--hf-config", str(model), "--block-tokens", str(block), "--context", "1"]
    assert main([*args, "--json"]) == 0
    (ours,) = json.loads(capsys.readouterr().out)["models"]

    vllm_model = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="auto")
    parallel = ParallelConfig()
    spec_type = MLAAttentionSpec if vllm_model.use_mla else FullAttentionSpec
    spec = spec_type(
        block_size=block,
        num_kv_heads=vllm_model.get_num_kv_heads(parallel),
        head_size=vllm_model.get_head_size(),
        dtype=vllm_model.dtype,
    )
    layers = vllm_model.get_num_layers(parallel)
    assert ours["num_layers"] == layers
    assert ours["block_tokens"] == block
    assert ours["block_bytes"] == layers * spec.page_size_bytes, (ours, spec)
    assert vllm_model.dtype == {"float16": torch.float16}.get(data["torch_dtype"], torch.bfloat16)
