"""Named storage formats: how a scheme's values are laid out in bytes.

Two kinds of format live here. Paper payloads are what a model's attention mathematically
needs (DeepSeek-V4's CSA / HCA / SWA sizes). Engine formats are what serving engines physically
store: FlashMLA's dense bf16 page, vLLM's ``fp8_ds_mla`` (V3.2), V4's "MODEL1" entry and its
indexer cache. The tier stores the engine's bytes, so the engine format is what sizes memory.

Each format belongs to one model family; a model accepts only its family's formats.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tessera_ray.errors import UnknownNameError
from tessera_ray.layout.dtypes import DType
from tessera_ray.layout.spec import EntryFormat, Region, Scheme

__all__ = [
    "Family",
    "FormatInfo",
    "FORMATS",
    "format_info",
    "full_kv_entry",
    "mla_entry",
    "v4_entries",
    "v4_state_entries",
    "V4_STATE_GROUPS",
    "FP8_SCALE_TILE",
    "UE8M0_SCALE_TILE",
]

FP8_SCALE_TILE = 128
"""fp8_ds_mla keeps one fp32 scale per 128 latent values (vLLM / FlashMLA: 512 -> 4 scales); so
does V4's indexer cache (128 key values -> one scale)."""

UE8M0_SCALE_TILE = 64
"""V4 MODEL1 keeps one UE8M0 (power-of-two) scale per 64 fp8 values (448 -> 7 scales)."""


class Family(enum.Enum):
    FULL_KV = "full-kv"
    MLA = "mla"
    V4 = "v4"


@dataclass(frozen=True, kw_only=True)
class FormatInfo:
    name: str
    family: Family
    description: str


FORMATS: dict[str, FormatInfo] = {
    info.name: info
    for info in (
        FormatInfo(name="kv-bf16", family=Family.FULL_KV, description="K and V per KV head, bf16"),
        FormatInfo(name="kv-fp16", family=Family.FULL_KV, description="K and V per KV head, fp16"),
        FormatInfo(
            name="kv-fp8", family=Family.FULL_KV, description="K and V per KV head, fp8_e4m3"
        ),
        FormatInfo(
            name="mla-bf16",
            family=Family.MLA,
            description="FlashMLA dense page: 512 bf16 c_kv + 64 bf16 k_rope (1,152 B/token)",
        ),
        FormatInfo(
            name="fp8_ds_mla",
            family=Family.MLA,
            description="vLLM/FlashMLA V3.2: 512 fp8 c_kv + 4 fp32 scales + 64 bf16 k_rope (656 B)",
        ),
        FormatInfo(
            name="mla-fp8",
            family=Family.MLA,
            description="unscaled fp8 latent: 512 fp8 c_kv + 64 bf16 k_rope (640 B)",
        ),
        FormatInfo(
            name="v4-paper",
            family=Family.V4,
            description="V4 paper payload: CSA 640 B/4 tokens, HCA 576 B/128 tokens, SWA 576 B",
        ),
        FormatInfo(
            name="v4-model1",
            family=Family.V4,
            description="V4 engine 'MODEL1': 448 fp8 + 64 bf16 RoPE + 7 ue8m0 + 1 pad (584 B) "
            "per entry, plus a 132 B indexer key per CSA entry and the compressors' fp32 state",
        ),
    )
}


def format_info(name: str, family: Family | None = None) -> FormatInfo:
    """The format called ``name``; with ``family``, also check it belongs to that family."""
    info = FORMATS.get(name)
    allowed = [f for f, i in FORMATS.items() if family is None or i.family is family]
    if info is None or (family is not None and info.family is not family):
        scope = f" for a {family.value} model" if family else ""
        raise UnknownNameError(f"unknown format {name!r}{scope}; valid: {', '.join(allowed)}")
    return info


_FULL_KV_DTYPES = {"kv-bf16": DType.BF16, "kv-fp16": DType.FP16, "kv-fp8": DType.FP8_E4M3}


def full_kv_entry(name: str, *, num_kv_heads: int, head_dim: int) -> EntryFormat:
    """One token's K and V for every KV head of one layer (MHA / GQA / MQA)."""
    format_info(name, Family.FULL_KV)
    dtype = _FULL_KV_DTYPES[name]
    width = num_kv_heads * head_dim
    return EntryFormat(
        name=name,
        regions=(
            Region(name="k", num_values=width, dtype=dtype),
            Region(name="v", num_values=width, dtype=dtype),
        ),
    )


def mla_entry(name: str, *, kv_lora_rank: int, rope_dim: int) -> EntryFormat:
    """One token's MLA latent (c_kv) and decoupled RoPE key of one layer."""
    format_info(name, Family.MLA)
    rope = Region(name="k_rope", num_values=rope_dim, dtype=DType.BF16)
    if name == "mla-bf16":
        regions: tuple[Region, ...] = (
            Region(name="c_kv", num_values=kv_lora_rank, dtype=DType.BF16),
            rope,
        )
    elif name == "mla-fp8":
        regions = (Region(name="c_kv", num_values=kv_lora_rank, dtype=DType.FP8_E4M3), rope)
    else:  # fp8_ds_mla
        _tiles(name, kv_lora_rank, FP8_SCALE_TILE)
        regions = (
            Region(name="c_kv", num_values=kv_lora_rank, dtype=DType.FP8_E4M3),
            Region(name="scale", num_values=kv_lora_rank // FP8_SCALE_TILE, dtype=DType.FP32),
            rope,
        )
    return EntryFormat(name=name, regions=regions)


def v4_entries(
    name: str, *, head_dim: int, rope_dim: int, index_head_dim: int
) -> dict[Scheme, EntryFormat]:
    """Entry formats of every V4 scheme in format ``name``.

    In the paper payload the CSA entry carries its indexer key (128 FP4) inline; the engine
    format MODEL1 keeps the indexer key in a separate 132 B cache (128 fp8 + one fp32 scale per
    128 values).
    """
    format_info(name, Family.V4)
    nope = head_dim - rope_dim
    if nope <= 0:
        from tessera_ray.errors import LayoutError

        raise LayoutError(f"head_dim {head_dim} must exceed rope_dim {rope_dim}")
    rope = Region(name="k_rope", num_values=rope_dim, dtype=DType.BF16)
    content = Region(name="kv_nope", num_values=nope, dtype=DType.FP8_E4M3)
    if name == "v4-paper":
        plain = EntryFormat(name="v4-paper", regions=(rope, content))
        csa = EntryFormat(
            name="v4-paper-csa",
            regions=(
                rope,
                content,
                Region(name="index_key", num_values=index_head_dim, dtype=DType.FP4_E2M1),
            ),
        )
        return {Scheme.CSA: csa, Scheme.HCA: plain, Scheme.SWA: plain}
    _tiles(name, nope, UE8M0_SCALE_TILE)
    model1 = EntryFormat(
        name="v4-model1",
        regions=(
            content,
            rope,
            Region(name="scale", num_values=nope // UE8M0_SCALE_TILE, dtype=DType.UE8M0),
            Region(name="pad", num_values=1, dtype=DType.INT8),
        ),
    )
    _tiles(name, index_head_dim, FP8_SCALE_TILE)
    indexer = EntryFormat(
        name="v4-indexer",
        regions=(
            Region(name="index_key", num_values=index_head_dim, dtype=DType.FP8_E4M3),
            Region(
                name="index_scale", num_values=index_head_dim // FP8_SCALE_TILE, dtype=DType.FP32
            ),
        ),
    )
    return {Scheme.CSA: model1, Scheme.HCA: model1, Scheme.SWA: model1, Scheme.INDEXER: indexer}


V4_STATE_GROUPS: dict[Scheme, int] = {
    # Compression groups a compressor's state spans, keyed by the scheme it feeds. CSA compresses
    # overlapping groups (an entry also draws on the group before it), so its compressor and the
    # indexer's, which runs at CSA's ratio, keep two groups of state; HCA's keeps one (vLLM
    # 0.32.0, models/deepseek_v4/compressor.py: coff = 2 when the ratio is 4, else 1).
    Scheme.CSA: 2,
    Scheme.INDEXER: 2,
    Scheme.HCA: 1,
}


def v4_state_entries(name: str, *, head_dim: int, index_head_dim: int) -> dict[Scheme, EntryFormat]:
    """Per token of its open groups, the fp32 state of each V4 compressor, keyed by the scheme
    it feeds: a running ``kv_state`` and ``score_state`` of ``groups x head`` values each
    (``head_dim`` for CSA and HCA, ``index_head_dim`` for the indexer's keys)."""
    format_info(name, Family.V4)
    if name == "v4-paper":
        # The paper payload is the KV attention reads; compressor state is engine working memory.
        return {}
    heads = {Scheme.CSA: head_dim, Scheme.INDEXER: index_head_dim, Scheme.HCA: head_dim}
    return {
        scheme: EntryFormat(
            name=f"v4-{scheme.value}-state",
            regions=tuple(
                Region(name=region, num_values=V4_STATE_GROUPS[scheme] * head, dtype=DType.FP32)
                for region in ("kv_state", "score_state")
            ),
        )
        for scheme, head in heads.items()
    }


def _tiles(name: str, values: int, tile: int) -> None:
    if values % tile:
        from tessera_ray.errors import LayoutError

        raise LayoutError(f"format {name!r} scales per {tile} values; {values} is not a multiple")
