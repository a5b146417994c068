"""A model's geometry read from its own Hugging Face ``config.json`` (the parsed mapping; reading
the file is the caller's), for the architectures vLLM serves with full attention, MLA or
DeepSeek-V4's hybrid attention (DeepSeek's own config format: ``compress_ratios`` per layer).

Each architecture names its reader in one table. A reader takes exactly the fields the model's
attention cache depends on, with Hugging Face's defaults where the format defines one
(``num_key_value_heads`` defaults to the query heads, ``head_dim`` to hidden size over heads),
and refuses a missing, mistyped or contradictory field with one line naming it: a wrong number
here would size every page of the tier wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tessera_ray.errors import LayoutError, UnknownNameError
from tessera_ray.layout.formats import Family
from tessera_ray.layout.models import (
    DEFAULT_FORMATS,
    FullAttentionConfig,
    HybridV4Config,
    MLAConfig,
    ModelConfig,
)

__all__ = ["HF_ARCHITECTURES", "config_from_hf"]

# The stored dtype of the model's weights picks the cache format when no format is named
# (vLLM's kv_cache_dtype "auto" caches in the model's dtype).
_FORMAT_BY_DTYPE: dict[tuple[Family, str], str] = {
    (Family.FULL_KV, "bfloat16"): "kv-bf16",
    (Family.FULL_KV, "float16"): "kv-fp16",
    (Family.MLA, "bfloat16"): "mla-bf16",
    # V4's cache is fp8_ds_mla whatever the weights' dtype (vLLM 0.32.0,
    # models/deepseek_v4/attention.py, _resolve_dsv4_kv_cache_dtype).
    (Family.V4, "bfloat16"): "v4-model1",
    (Family.V4, "float16"): "v4-model1",
}


class _Fields:
    """The ``config.json`` mapping, read one checked field at a time."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, name: str, problem: str) -> LayoutError:
        return LayoutError(f"{self.source}: field {name!r} {problem}")

    def positive(self, name: str, default: int | None = None) -> int:
        value = self.data.get(name)
        if value is None:
            if default is None:
                raise self.error(name, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(name, f"must be a positive integer, got {value!r}")
        return value

    def format(self, family: Family, wanted: str | None) -> str:
        if wanted is not None:
            return wanted
        dtype = self.data.get("torch_dtype", self.data.get("dtype"))
        if dtype is None:
            return DEFAULT_FORMATS[family]
        fmt = _FORMAT_BY_DTYPE.get((family, str(dtype)))
        if fmt is None:
            raise self.error(
                "torch_dtype" if "torch_dtype" in self.data else "dtype",
                f"is {dtype!r}: no {family.value} cache format for it; name one with --format",
            )
        return fmt


def _full_attention(f: _Fields, name: str, fmt: str | None) -> ModelConfig:
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise f.error(
            "num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})"
        )
    head_dim = f.data.get("head_dim")
    if head_dim is None:
        hidden = f.positive("hidden_size")
        if hidden % heads:
            raise f.error("hidden_size", f"({hidden}) is not a multiple of {heads} heads")
        head_dim = hidden // heads
    else:
        head_dim = f.positive("head_dim")
    # A sliding window changes which blocks a prefix needs; the tier does not page it yet.
    window = f.data.get("sliding_window")
    windowed = f.data.get("use_sliding_window", window is not None)
    layer_types = f.data.get("layer_types") or ()
    if (window is not None and windowed) or "sliding_attention" in layer_types:
        field = "layer_types" if "sliding_attention" in layer_types else "sliding_window"
        raise f.error(field, "turns on sliding-window attention, which the tier does not page")
    return FullAttentionConfig(
        name=name,
        num_layers=f.positive("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        format=f.format(Family.FULL_KV, fmt),
    )


def _mla(f: _Fields, name: str, fmt: str | None) -> ModelConfig:
    # MTP layers (num_nextn_predict_layers) get a cache only under speculative decoding,
    # which the connector does not serve: not counted.
    return MLAConfig(
        name=name,
        num_layers=f.positive("num_hidden_layers"),
        num_heads=f.positive("num_attention_heads"),
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_rope_head_dim=f.positive("qk_rope_head_dim"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        v_head_dim=f.positive("v_head_dim"),
        format=f.format(Family.MLA, fmt),
    )


# DeepSeek-V4's compress ratios: window only, CSA, HCA (the ratios vLLM builds compressors for).
_V4_RATIOS = (0, 4, 128)


def _v4_ratios(f: _Fields, num_layers: int) -> tuple[int, ...]:
    ratios = f.data.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios:
        raise f.error("compress_ratios", f"must be a non-empty list, got {ratios!r}")
    if len(ratios) < num_layers:
        raise f.error(
            "compress_ratios",
            f"has {len(ratios)} entries, fewer than num_hidden_layers ({num_layers})",
        )
    for index, ratio in enumerate(ratios):
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio not in _V4_RATIOS:
            allowed = ", ".join(map(str, _V4_RATIOS))
            raise f.error(
                "compress_ratios", f"entry {index} is {ratio!r}; each must be one of {allowed}"
            )
    return tuple(ratios[:num_layers])


def _deepseek_v4(f: _Fields, name: str, fmt: str | None) -> ModelConfig:
    num_layers = f.positive("num_hidden_layers")
    ratios = _v4_ratios(f, num_layers)
    head_dim = f.positive("head_dim")
    rope_dim = f.positive("qk_rope_head_dim")
    if rope_dim >= head_dim:
        raise f.error("qk_rope_head_dim", f"({rope_dim}) must be less than head_dim ({head_dim})")
    kv_heads = f.positive("num_key_value_heads", default=1)
    if kv_heads != 1:
        raise f.error("num_key_value_heads", f"is {kv_heads}; DeepSeek-V4 keeps one KV head")
    # Entries past num_hidden_layers are the multi-token-prediction layers: they get a cache
    # only under speculative decoding, which the connector does not serve.
    listed = len(f.data["compress_ratios"])
    notes = (
        (
            f"compress_ratios lists {listed} layers for {num_layers} hidden layers: the last "
            f"{listed - num_layers} (MTP) are not counted",
        )
        if listed > num_layers
        else ()
    )
    return HybridV4Config(
        name=name,
        num_heads=f.positive("num_attention_heads"),
        compress_ratios=ratios,
        head_dim=head_dim,
        rope_dim=rope_dim,
        window_tokens=f.positive("sliding_window"),
        index_head_dim=f.positive("index_head_dim"),
        format=f.format(Family.V4, fmt),
        notes=notes,
    )


HF_ARCHITECTURES: dict[str, Callable[[_Fields, str, str | None], ModelConfig]] = {
    "LlamaForCausalLM": _full_attention,
    "MistralForCausalLM": _full_attention,
    "Qwen2ForCausalLM": _full_attention,
    "Qwen3ForCausalLM": _full_attention,
    "DeepseekV2ForCausalLM": _mla,
    "DeepseekV3ForCausalLM": _mla,  # Kimi-K2 ships this architecture too
    "DeepseekV4ForCausalLM": _deepseek_v4,
}
"""Architectures (``config.json``'s ``architectures``) whose geometry is read, and how."""


def config_from_hf(
    data: Mapping[str, Any], *, name: str, format: str | None = None, source: str = "config.json"
) -> ModelConfig:
    """The geometry of the model whose parsed ``config.json`` is ``data``, named ``name``, in
    ``format`` (default: the format of the model's dtype). ``source`` names the file in
    errors."""
    if not isinstance(data, Mapping):
        raise LayoutError(f"{source} must hold a JSON object, got {type(data).__name__}")
    fields = _Fields(data, source)
    architectures = data.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise fields.error("architectures", "is missing or empty")
    known = [a for a in architectures if a in HF_ARCHITECTURES]
    if not known:
        raise UnknownNameError(
            f"{source}: architectures {architectures} are not supported; supported: "
            f"{', '.join(HF_ARCHITECTURES)}"
        )
    return HF_ARCHITECTURES[known[0]](fields, name, format)
