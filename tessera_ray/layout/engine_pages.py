"""The pages vLLM allocates for a layout, so the tier can report and check the engine's bytes.

Pure arithmetic over a :class:`~tessera_ray.layout.spec.ModelLayout` (vLLM is never imported),
following vLLM 0.32.0, whose files are cited below:

- A page holds ``block_tokens / stride`` entries of one layer, contiguously
  (``v1/kv_cache_interface.py``: ``AttentionSpec.unpadded_page_size_bytes``, ``num_states``).
- DeepSeek-V4 in its ``fp8_ds_mla`` layout (our ``v4-model1``) rounds every page up to a
  multiple of 576 B, FlashMLA's packing stride (``_apply_alignment_padding``; the
  ``alignment=576`` of ``models/deepseek_v4/attention.py``, ``models/deepseek_v4/compressor.py``
  and ``v1/attention/backends/mla/sparse_swa.py``).
- DeepSeek-V4 fixes each cache's block: 256 tokens for the compressed and indexer caches (the
  sparse MLA backend's only kernel block, ``models/deepseek_v4/sparse_mla.py``, which
  ``platforms/cpu.py`` also forces), 64 for the sliding window (``DeepseekV4SWACache``), 4 and 8
  for the compressor state of ratio 4 and 128 (``CompressorStateCache``).
- MLA and full attention: a page is ``block_size`` rows, unpadded; the block size is the
  engine's setting, so it is a parameter here (default: the tier's block).

The tier's own blocks (:attr:`ModelLayout.block_tokens`) are unchanged by any of this: these
figures describe the engine's memory, not the tier's pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from tessera_ray.errors import LayoutError
from tessera_ray.layout.spec import CacheSpec, ModelLayout, Scheme

__all__ = [
    "ENGINE",
    "ENGINE_FORMATS",
    "V4_BLOCK_TOKENS",
    "EngineCache",
    "EnginePages",
    "engine_pages",
]

ENGINE = "vllm 0.32.0"
"""The engine and version whose allocation these figures follow."""

V4_BLOCK_TOKENS = 256
"""vLLM's block for DeepSeek-V4's compressed and indexer caches: 64 CSA entries of 4 tokens."""

_V4_WINDOW_BLOCK_TOKENS = 64  # DeepseekV4SWACache's block_size
_V4_STATE_BLOCK_TOKENS = {4: 4, 128: 8}  # CompressorStateCache's block_size by compress ratio
_FP8_DS_MLA_ALIGNMENT = 576  # FlashMLA's packing stride


def _positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EngineCache:
    """One cache as the engine allocates it: a page of ``block_tokens`` tokens per layer, the
    entries rounded up to a multiple of ``alignment_bytes``."""

    cache: CacheSpec
    layers: tuple[int, ...]
    block_tokens: int
    alignment_bytes: int = 1

    def __post_init__(self) -> None:
        _positive("engine block_tokens", self.block_tokens)
        _positive("engine alignment_bytes", self.alignment_bytes)
        if not self.layers:
            raise LayoutError(f"engine cache {self.cache.label()} has no layers")
        if self.block_tokens % self.cache.stride_tokens:
            raise LayoutError(
                f"an engine block of {self.block_tokens} tokens splits the "
                f"{self.cache.scheme.value} group of {self.cache.stride_tokens} tokens"
            )

    @property
    def entries_per_page(self) -> int:
        return self.block_tokens // self.cache.stride_tokens

    @property
    def content_bytes(self) -> int:
        """The entries of one page, before alignment padding."""
        return self.entries_per_page * self.cache.entry.entry_bytes

    @property
    def page_bytes(self) -> int:
        """One layer's page as the engine allocates it (vLLM's ``page_size_bytes``)."""
        return -(-self.content_bytes // self.alignment_bytes) * self.alignment_bytes

    @property
    def padding_bytes(self) -> int:
        return self.page_bytes - self.content_bytes

    @property
    def bytes_per_token(self) -> Fraction:
        """One layer's page bytes per token of its block, padding included."""
        return Fraction(self.page_bytes, self.block_tokens)

    @property
    def block_bytes(self) -> int:
        """One page for every layer that keeps this cache."""
        return self.page_bytes * len(self.layers)

    def label(self) -> str:
        return self.cache.label()


@dataclass(frozen=True, kw_only=True)
class EnginePages:
    """Every cache the engine allocates for a layout, with totals over all layers."""

    model: str
    format_name: str
    caches: tuple[EngineCache, ...]
    engine: str = ENGINE

    @property
    def page_bytes(self) -> int:
        """One page of every cache of every layer (the sum of vLLM's per-layer page sizes)."""
        return sum(c.block_bytes for c in self.caches)

    @property
    def paged_block_bytes(self) -> int:
        """One page of every cache kept for the whole context, over its layers. For DeepSeek-V4
        vLLM 0.32.0 groups exactly these caches together, and that group is its widest, so this
        is also the block of its shared pool (``tests/vllm/test_hf_layouts.py`` checks it)."""
        return sum(c.block_bytes for c in self.caches if not c.cache.windowed)

    @property
    def paged_bytes_per_token(self) -> Fraction:
        """Bytes per token of every cache kept for the whole context, padding included."""
        return sum(
            (c.bytes_per_token * len(c.layers) for c in self.caches if not c.cache.windowed),
            Fraction(0),
        )

    @property
    def window_bytes_per_token(self) -> Fraction:
        """Bytes per token of the windowed caches (held only for their last tokens)."""
        return sum(
            (c.bytes_per_token * len(c.layers) for c in self.caches if c.cache.windowed),
            Fraction(0),
        )


def _layer_ratio(layout: ModelLayout, cache: CacheSpec, layers: tuple[int, ...]) -> int:
    """The compress ratio of the layers keeping ``cache``: their compressed entry's stride."""
    ratios = {
        max((s.stride_tokens for s in layout.layers[i] if not s.windowed), default=0)
        for i in layers
    }
    if len(ratios) != 1:
        raise LayoutError(
            f"{cache.label()} is kept by layers of compress ratios {sorted(ratios)}; vLLM sizes "
            f"a compressor's state by its layer's one ratio"
        )
    return ratios.pop()


def _v4_cache(
    layout: ModelLayout, cache: CacheSpec, layers: tuple[int, ...], block_tokens: int | None
) -> EngineCache:
    if cache.scheme is Scheme.SWA:
        block = _V4_WINDOW_BLOCK_TOKENS
    elif cache.scheme is Scheme.COMPRESSOR_STATE:
        ratio = _layer_ratio(layout, cache, layers)
        if ratio not in _V4_STATE_BLOCK_TOKENS:
            raise LayoutError(
                f"vLLM keeps compressor state for compress ratios "
                f"{sorted(_V4_STATE_BLOCK_TOKENS)} only; {cache.label()} serves ratio {ratio}"
            )
        block = _V4_STATE_BLOCK_TOKENS[ratio]
    else:
        block = V4_BLOCK_TOKENS if block_tokens is None else block_tokens
    return EngineCache(
        cache=cache, layers=layers, block_tokens=block, alignment_bytes=_FP8_DS_MLA_ALIGNMENT
    )


def _row_cache(
    layout: ModelLayout, cache: CacheSpec, layers: tuple[int, ...], block_tokens: int | None
) -> EngineCache:
    if cache.windowed:
        raise LayoutError(f"{cache.label()}: windowed caches are modelled for DeepSeek-V4 only")
    block = layout.block_tokens if block_tokens is None else block_tokens
    return EngineCache(cache=cache, layers=layers, block_tokens=block)


ENGINE_FORMATS: dict[
    str, Callable[[ModelLayout, CacheSpec, tuple[int, ...], int | None], EngineCache]
] = {
    # Formats whose bytes are exactly what vLLM stores, and how it pages each of their caches.
    # v4-paper is not an engine format; mla-fp8 neither (vLLM's fp8 MLA row is 576 fp8 values).
    "v4-model1": _v4_cache,
    "mla-bf16": _row_cache,
    "fp8_ds_mla": _row_cache,
    "kv-bf16": _row_cache,
    "kv-fp16": _row_cache,
    "kv-fp8": _row_cache,
}
"""The storage formats vLLM allocates pages for, each with the rule that pages its caches."""


def engine_pages(layout: ModelLayout, *, block_tokens: int | None = None) -> EnginePages:
    """vLLM's pages for ``layout``, one :class:`EngineCache` per (cache spec, layers), paged
    caches first. ``block_tokens`` is vLLM's ``block_size`` for the caches whose block the
    engine lets its user set (default: 256 for DeepSeek-V4, the tier's block otherwise)."""
    rule = ENGINE_FORMATS.get(layout.format_name)
    if rule is None:
        raise LayoutError(
            f"format {layout.format_name!r} is not what vLLM stores; engine pages exist for "
            f"{', '.join(ENGINE_FORMATS)}"
        )
    if block_tokens is not None:
        _positive("engine block_tokens", block_tokens)
    members = [(g.page.cache, g.layers) for g in layout.groups] + list(layout.windows)
    return EnginePages(
        model=layout.model,
        format_name=layout.format_name,
        caches=tuple(rule(layout, cache, layers, block_tokens) for cache, layers in members),
    )
