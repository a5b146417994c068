"""The KV format as data: regions, entry formats, per-layer cache specs, page specs, layouts.

Vocabulary, from small to large:

- :class:`Region`: a run of values of one dtype inside an entry (``c_kv`` as 512 fp8, four fp32
  scales, the 64 bf16 RoPE values). Precision differs per region, so a page is described by a
  list of regions, never by a single dtype.
- :class:`EntryFormat`: the regions of one stored entry, in byte order.
- :class:`CacheSpec`: what one layer keeps for one attention scheme: an entry format, how many
  tokens one entry covers (``stride_tokens``: 1 for MLA, 4 for CSA, 128 for HCA) and, for a
  sliding window, how many tokens are kept.
- :class:`PageSpec`: a cache spec cut into pages of ``block_tokens`` tokens, the unit the pool
  allocates. Entries lie contiguously inside a page (token-major), as FlashMLA's
  ``[num_blocks, 64, 1, 576]`` pages do.
- :class:`ModelLayout`: the per-layer scheme map of a model, with its derived block size;
  layers whose specs are identical form a :class:`LayerGroup` that later shares one pool.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from tessera_ray.errors import LayoutError
from tessera_ray.layout.dtypes import DType

__all__ = [
    "Region",
    "EntryFormat",
    "Scheme",
    "CacheSpec",
    "PageSpec",
    "LayerGroup",
    "ModelLayout",
]


def _positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Region:
    """``num_values`` values of ``dtype`` named ``name``; always a whole number of bytes."""

    name: str
    num_values: int
    dtype: DType

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("a region needs a non-empty name")
        _positive(f"region {self.name!r} num_values", self.num_values)
        if (self.num_values * self.dtype.bits) % 8:
            raise LayoutError(
                f"region {self.name!r}: {self.num_values} x {self.dtype.value} is not a whole "
                f"number of bytes; pad it to an even count"
            )

    @property
    def nbytes(self) -> int:
        return self.num_values * self.dtype.bits // 8


@dataclass(frozen=True, kw_only=True)
class EntryFormat:
    """A named entry format: its regions in the order they are laid out in memory."""

    name: str
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not self.regions:
            raise LayoutError(f"entry format {self.name!r} has no regions")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise LayoutError(f"entry format {self.name!r} repeats a region name: {names}")

    @property
    def entry_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def region_offsets(self) -> dict[str, tuple[int, int]]:
        """``{region name: (byte offset in the entry, byte length)}``."""
        out: dict[str, tuple[int, int]] = {}
        offset = 0
        for r in self.regions:
            out[r.name] = (offset, r.nbytes)
            offset += r.nbytes
        return out

    def describe(self) -> str:
        return " + ".join(f"{r.num_values} {r.dtype.value} {r.name}" for r in self.regions)


class Scheme(enum.Enum):
    """The attention scheme a cache spec stores."""

    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"
    CSA = "csa"
    HCA = "hca"
    SWA = "swa"
    INDEXER = "indexer"
    COMPRESSOR_STATE = "compressor-state"
    """A V4 compressor's fp32 running state for the tokens of its open groups (windowed)."""


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """What one layer stores for one scheme: one ``entry`` per ``stride_tokens`` tokens.

    ``window_tokens`` is set for sliding windows: only the last ``window_tokens`` tokens are
    kept by the engine; the tier stores them only where a stored prefix ends (a resume
    record, docs/v4-connector.md), not in every page.
    """

    scheme: Scheme
    entry: EntryFormat
    stride_tokens: int = 1
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        _positive(f"{self.scheme.value} stride_tokens", self.stride_tokens)
        if self.window_tokens is not None:
            _positive(f"{self.scheme.value} window_tokens", self.window_tokens)
            if self.window_tokens % self.stride_tokens:
                raise LayoutError(
                    f"{self.scheme.value} window of {self.window_tokens} tokens splits its "
                    f"{self.stride_tokens}-token entries"
                )

    @property
    def windowed(self) -> bool:
        return self.window_tokens is not None

    @property
    def bytes_per_group(self) -> int:
        """Bytes of one entry, which covers ``stride_tokens`` tokens (a compression group)."""
        return self.entry.entry_bytes

    @property
    def bytes_per_token(self) -> Fraction:
        """Exact, possibly fractional, bytes per token (HCA: 576 / 128 = 9/2)."""
        return Fraction(self.entry.entry_bytes, self.stride_tokens)

    def label(self) -> str:
        stride = f"/{self.stride_tokens}" if self.stride_tokens > 1 else ""
        window = f" window {self.window_tokens}" if self.windowed else ""
        return f"{self.scheme.value}:{self.entry.name}{stride}{window}"


@dataclass(frozen=True, kw_only=True)
class PageSpec:
    """A cache spec cut into pages of ``block_tokens`` tokens (entries contiguous, token-major)."""

    cache: CacheSpec
    block_tokens: int

    def __post_init__(self) -> None:
        _positive("block_tokens", self.block_tokens)
        if self.block_tokens % self.cache.stride_tokens:
            raise LayoutError(
                f"a page of {self.block_tokens} tokens would split the {self.cache.scheme.value} "
                f"compression group of {self.cache.stride_tokens} tokens; use a multiple of "
                f"{self.cache.stride_tokens}"
            )

    @property
    def entries_per_page(self) -> int:
        return self.block_tokens // self.cache.stride_tokens

    @property
    def entry_bytes(self) -> int:
        return self.cache.entry.entry_bytes

    @property
    def page_bytes(self) -> int:
        return self.entries_per_page * self.entry_bytes

    @property
    def bytes_per_token(self) -> Fraction:
        return self.cache.bytes_per_token

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.cache.entry.regions


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Layers with one identical cache spec; one pool serves the whole group."""

    page: PageSpec
    layers: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one token block across all layers of the group (a block = one page a layer)."""
        return self.page.page_bytes * len(self.layers)


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """A model's per-layer scheme map in one storage format, with its derived block size.

    ``layers[i]`` lists the cache specs layer ``i`` keeps (a V4 CSA layer keeps a compressed
    entry, an indexer key and a sliding window). ``block_tokens`` must be a multiple of every
    stride: a page never splits a compression group.
    """

    model: str
    format_name: str
    layers: tuple[tuple[CacheSpec, ...], ...]
    block_tokens: int
    mha_bytes_per_token: int
    """Bytes per token a plain MHA cache of the same model would need (the comparison baseline)."""
    notes: tuple[str, ...] = ()
    assumed: bool = False
    """True when part of the geometry is assumed rather than published (the notes say which)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayoutError(f"layout {self.model!r} has no layers")
        _positive("block_tokens", self.block_tokens)
        _positive("mha_bytes_per_token", self.mha_bytes_per_token)
        for index, specs in enumerate(self.layers):
            if not specs:
                raise LayoutError(f"layer {index} of {self.model!r} stores nothing")
            for spec in specs:
                if not spec.windowed and self.block_tokens % spec.stride_tokens:
                    raise LayoutError(
                        f"a page of {self.block_tokens} tokens would split the "
                        f"{spec.scheme.value} compression group of {spec.stride_tokens} tokens "
                        f"at layer {index}; use a multiple of {spec.stride_tokens}"
                    )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def groups(self) -> tuple[LayerGroup, ...]:
        """Paged layer groups in first-appearance order (sliding windows are not paged)."""
        members: dict[CacheSpec, list[int]] = {}
        for index, specs in enumerate(self.layers):
            for spec in specs:
                if not spec.windowed:
                    members.setdefault(spec, []).append(index)
        return tuple(
            LayerGroup(page=PageSpec(cache=spec, block_tokens=self.block_tokens), layers=tuple(ls))
            for spec, ls in members.items()
        )

    @cached_property
    def windows(self) -> tuple[tuple[CacheSpec, tuple[int, ...]], ...]:
        """Sliding-window specs with the layers that keep them (stored as resume records)."""
        members: dict[CacheSpec, list[int]] = {}
        for index, specs in enumerate(self.layers):
            for spec in specs:
                if spec.windowed:
                    members.setdefault(spec, []).append(index)
        return tuple((spec, tuple(ls)) for spec, ls in members.items())

    @property
    def paged_bytes_per_token(self) -> Fraction:
        """Exact bytes per token over every paged spec of every layer."""
        return sum((g.page.bytes_per_token * len(g.layers) for g in self.groups), Fraction(0))

    @property
    def window_bytes_per_token(self) -> Fraction:
        """Bytes per token of the sliding windows, paid only for the last window of tokens."""
        return sum((s.bytes_per_token * len(ls) for s, ls in self.windows), Fraction(0))

    @property
    def block_bytes(self) -> int:
        """Bytes of one full token block over every paged layer."""
        return sum(g.block_bytes for g in self.groups)

    @property
    def resume_bytes(self) -> int:
        """Bytes of one resume record: what every sliding window keeps where a prefix ends,
        ``window - 1`` positions (vLLM keeps the positions from ``n - window + 1`` after ``n``
        tokens), for every layer that keeps it."""
        return sum(
            (spec.window_tokens - 1) // spec.stride_tokens * spec.entry.entry_bytes * len(layers)
            for spec, layers in self.windows
            if spec.window_tokens is not None
        )

    def canonical(self) -> dict[str, object]:
        """A JSON-able description of what determines the stored bytes, model included."""
        return {
            "model": self.model,
            "block_tokens": self.block_tokens,
            "layers": [
                [
                    {
                        "scheme": s.scheme.value,
                        "entry": s.entry.name,
                        "regions": [[r.name, r.num_values, r.dtype.value] for r in s.entry.regions],
                        "stride_tokens": s.stride_tokens,
                        "window_tokens": s.window_tokens,
                    }
                    for s in specs
                ]
                for specs in self.layers
            ],
        }

    @cached_property
    def fingerprint(self) -> str:
        """Stable digest of the model and its storage layout; it goes into every key, so pages of
        different layouts or models never mix.

        The model name is part of it: Kimi-K2 has DeepSeek-V3's exact page geometry, but its KV
        for the same tokens is different bytes, and token keys (which carry the fingerprint)
        must never let one model's pages answer another model's prompt. A fine-tune therefore
        needs its own model name. Notes are excluded. sha256 of canonical JSON, not ``hash()``,
        so it is the same in every process and Python version.
        """
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"tessera-layout/1\0" + blob).hexdigest()[:32]
