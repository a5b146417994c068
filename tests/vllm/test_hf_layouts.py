"""``tessera-ray size --hf-config`` against vLLM's own reading of the same ``config.json``: for
every architecture the layout package reads, the tier's bytes per token and layer, times a
block, equal the page size of the cache spec vLLM builds for that model (``FullAttentionSpec``
or ``MLAAttentionSpec``, from vLLM's ``ModelConfig``: its KV heads, head size, layers, dtype).

DeepSeek-V4 keeps several caches per layer, so there vLLM builds the model itself (on the meta
device: no weights, no memory) and its cache modules give their specs as its model runner asks
for them; every engine cache ``size`` reports must have vLLM's layers, block and page size, and
the totals vLLM's (its pool's block included)."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tessera_ray.cli import main
from tessera_ray.layout import HF_ARCHITECTURES
from tessera_ray.models.hf_tiny import TINY_V4_CONFIG
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
    assert set(CONFIGS) | {V4_ARCHITECTURE} == set(HF_ARCHITECTURES)


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


V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
# The smallest DeepSeek-V4 vLLM's CPU build runs (the engine tests' model): a window-only, a
# CSA and an HCA layer.
_V4_TINY: dict[str, Any] = dict(TINY_V4_CONFIG)
V4_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-v4": _V4_TINY,
    # V4-Flash's attention (43 layers, its compress ratios with the MTP layer's 44th entry), on
    # the tiny model's small hidden size and experts: the caches depend on attention alone.
    "v4-flash-like": _V4_TINY
    | {
        "num_hidden_layers": 43,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "num_attention_heads": 64,
        "num_nextn_predict_layers": 1,
    },
}

# vLLM's name for each V4 cache module, by the suffix after ``model.layers.N.``, and the scheme
# of ours it holds (the compressed cache and the compressor's state hold CSA or HCA by the
# layer's ratio).
_V4_MODULES = {
    "attn": {4: "csa", 128: "hca"},
    "attn.indexer.k_cache": {4: "indexer"},
    "attn.swa_cache": {0: "swa", 4: "swa", 128: "swa"},
    "attn.compressor.state_cache": {4: "csa-state", 128: "hca-state"},
    "attn.indexer.compressor.state_cache": {4: "indexer-state"},
}


def _our_kind(label: str) -> str:
    scheme, entry = label.split(" ")[0].split(":")
    if scheme == "compressor-state":
        return entry.removeprefix("v4-")
    return scheme


@pytest.fixture(scope="module")
def vllm_distributed() -> Iterator[None]:
    """vLLM's model parallel groups for one CPU process, as its CPU worker sets them up."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        # vLLM's CUDA build on a machine without a GPU (make test-vllm) builds no model; the
        # CPU build (make test-engine runs tests/vllm too) does.
        pytest.skip("this vLLM build has no device to build DeepSeek-V4's layers on")

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp}/rendezvous",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


class _NoEvent:
    """What vLLM's CPU worker puts in place of ``torch.cuda.Event`` (v1/worker/cpu/shm.py), which
    V4's attention constructs; the model is never run here."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


def _vllm_v4_specs(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    """vLLM's config and the cache spec of every cache layer of the V4 model in ``model_dir``,
    collected as vLLM's model runner collects them (``get_kv_cache_spec``)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="auto")
    config = VllmConfig(model_config=model, cache_config=CacheConfig())
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    with set_current_vllm_config(config), torch.device("meta"):
        model_class, _ = get_model_architecture(model)
        model_class(vllm_config=config, prefix="")
        runner = SimpleNamespace(vllm_config=config, shared_kv_cache_layers={})
        specs = GPUModelRunner.get_kv_cache_spec(runner)
    return config, specs


def _vllm_pool_block_bytes(config: Any, specs: dict[str, Any]) -> int:
    """The block of vLLM's shared KV pool: its KV cache groups, in the layout its backends pick."""
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core import kv_cache_utils

    layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    backends = {layers[name].get_attn_backend() for name in specs}
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    with set_current_vllm_config(config):
        layout = resolve_kv_cache_layout(config, [supported], list(specs.values()))
        groups = kv_cache_utils.get_kv_cache_groups(config, dict(specs))
        return int(kv_cache_utils._get_kv_cache_bytes_per_block(groups, layout))


@pytest.mark.parametrize("name", sorted(V4_CONFIGS))
def test_v4_engine_caches_equal_vllms_specs(
    name: str,
    vllm_distributed: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    data = V4_CONFIGS[name]
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(data))
    assert main(["size", "--hf-config", str(model_dir), "--context", "1", "--json"]) == 0
    (ours,) = json.loads(capsys.readouterr().out)["models"]
    engine = ours["engine"]

    config, specs = _vllm_v4_specs(model_dir, monkeypatch)
    # vLLM reads DeepSeek's format with its own config class (no remote code), forces the V4
    # block and, building the model, the fp8_ds_mla layout our v4-model1 describes.
    assert type(config.model_config.hf_config).__name__ == "DeepseekV4Config"
    assert (config.cache_config.block_size, config.cache_config.cache_dtype) == (256, "fp8_ds_mla")
    assert ours["num_layers"] == config.model_config.hf_config.num_hidden_layers

    ratios = data["compress_ratios"]
    theirs: dict[str, dict[int, Any]] = {}
    for layer_name, spec in specs.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", layer_name)
        assert match, layer_name
        layer, module = int(match.group(1)), match.group(2)
        kind = _V4_MODULES[module][ratios[layer]]
        theirs.setdefault(kind, {})[layer] = spec
    assert sorted(theirs) == sorted(_our_kind(c["spec"]) for c in engine["caches"])
    for cache in engine["caches"]:
        vllm_layers = theirs[_our_kind(cache["spec"])]
        assert sorted(vllm_layers) == cache["layers"], cache["spec"]
        spec_type = SlidingWindowMLASpec if cache["window_tokens"] is not None else MLAAttentionSpec
        want = [cache[k] for k in ("block_tokens", "entries_per_page", "page_bytes")]
        for spec in vllm_layers.values():
            assert isinstance(spec, spec_type), (cache, spec)
            got = [spec.block_size, spec.num_states, spec.page_size_bytes]
            assert got == want, (cache, spec)
            assert getattr(spec, "sliding_window", None) == cache["window_tokens"]

    every = list(specs.values())
    assert engine["page_bytes"] == sum(s.page_size_bytes for s in every)
    paged = [s for s in every if not isinstance(s, SlidingWindowMLASpec)]
    windowed = [s for s in every if isinstance(s, SlidingWindowMLASpec)]
    for key, group in (("paged_bytes_per_token", paged), ("window_bytes_per_token", windowed)):
        total = sum((Fraction(s.page_size_bytes, s.block_size) for s in group), Fraction(0))
        assert Fraction(engine[key]) == total, key
    assert engine["paged_block_bytes"] == _vllm_pool_block_bytes(config, specs)
