"""Exact byte accounting of a layout at a given context length.

Three figures per context, all exact integers:

- **payload**: the bytes the format holds for the tokens so far. A compressed spec holds one
  entry per *complete* group of ``stride_tokens``; the tokens of an unfinished group are not
  payload yet (engines keep them uncompressed, as compressor state, until the group closes),
  and are reported as ``pending_tokens``. A sliding window holds at most ``window_tokens``.
- **stored**: what memory really holds: whole pages for paged specs (the last page is partly
  empty), the full ring for sliding windows.
- **padding**: stored minus payload, reported separately so neither figure hides the other.

The MHA-equivalent baseline is ``context x mha_bytes_per_token``; ``ratio`` is MHA over payload,
an exact :class:`~fractions.Fraction` (DeepSeek-V3 in bf16: 512/9 = 56.888...).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from tessera_ray.errors import InvalidContextError
from tessera_ray.layout.spec import ModelLayout

__all__ = ["SpecUsage", "ContextUsage", "account"]


@dataclass(frozen=True, kw_only=True)
class SpecUsage:
    """One cache spec's share of a context, over all the layers that keep it."""

    label: str
    num_layers: int
    paged: bool
    bytes_per_token: Fraction
    payload_bytes: int
    stored_bytes: int
    pages: int
    pending_tokens: int

    @property
    def padding_bytes(self) -> int:
        return self.stored_bytes - self.payload_bytes


@dataclass(frozen=True, kw_only=True)
class ContextUsage:
    """A whole model's KV at one context length."""

    model: str
    format_name: str
    context_tokens: int
    block_tokens: int
    blocks: int
    mha_bytes: int
    specs: tuple[SpecUsage, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.specs)

    @property
    def stored_bytes(self) -> int:
        return sum(s.stored_bytes for s in self.specs)

    @property
    def padding_bytes(self) -> int:
        return self.stored_bytes - self.payload_bytes

    @property
    def pages(self) -> int:
        return sum(s.pages for s in self.specs)

    @property
    def ratio(self) -> Fraction:
        """MHA-equivalent bytes over payload bytes."""
        return Fraction(self.mha_bytes, self.payload_bytes)


def account(layout: ModelLayout, context_tokens: int) -> ContextUsage:
    """Exact bytes of ``layout`` holding ``context_tokens`` tokens."""
    if (
        isinstance(context_tokens, bool)
        or not isinstance(context_tokens, int)
        or context_tokens <= 0
    ):
        raise InvalidContextError(
            f"context must be a positive number of tokens, got {context_tokens!r}"
        )
    blocks = -(-context_tokens // layout.block_tokens)
    usages: list[SpecUsage] = []
    for group in layout.groups:
        page, n = group.page, len(group.layers)
        stride = page.cache.stride_tokens
        usages.append(
            SpecUsage(
                label=page.cache.label(),
                num_layers=n,
                paged=True,
                bytes_per_token=page.bytes_per_token,
                payload_bytes=(context_tokens // stride) * page.entry_bytes * n,
                stored_bytes=blocks * page.page_bytes * n,
                pages=blocks * n,
                pending_tokens=context_tokens % stride,
            )
        )
    for spec, layers in layout.windows:
        window = spec.window_tokens
        assert window is not None  # windows() yields windowed specs only
        held = min(context_tokens, window)
        n = len(layers)
        usages.append(
            SpecUsage(
                label=spec.label(),
                num_layers=n,
                paged=False,
                bytes_per_token=spec.bytes_per_token,
                payload_bytes=(held // spec.stride_tokens) * spec.entry.entry_bytes * n,
                stored_bytes=(window // spec.stride_tokens) * spec.entry.entry_bytes * n,
                pages=0,
                pending_tokens=held % spec.stride_tokens,
            )
        )
    return ContextUsage(
        model=layout.model,
        format_name=layout.format_name,
        context_tokens=context_tokens,
        block_tokens=layout.block_tokens,
        blocks=blocks,
        mha_bytes=context_tokens * layout.mha_bytes_per_token,
        specs=tuple(usages),
    )
