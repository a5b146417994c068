"""Persistence of V4 sliding windows and per-request arenas: ``drop``, ``snapshot``, ``full``.

A V4 layer keeps the last 128 tokens uncompressed (SWA) in a per-request ring, outside the
shared pages. What reaches disk is a choice; :func:`window_write_bytes` computes what each
strategy writes for a layout (docs/v4-windows.md has the figures for DeepSeek-V4-Flash and when
each strategy wins):

- ``drop``: nothing is written; restore recomputes the window by re-running the last 128 tokens
  over cached compressed KV (one short prefill).
- ``snapshot``: the window as of the last checkpoint (e.g. end of a turn), paid once per
  checkpoint: for sessions that pause between turns and resume on another worker.
- ``full``: every window entry as produced: for a crash that must resume mid-turn without any
  recompute; for debugging and replay, not the default.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from tessera_ray.layout import ModelLayout
from tessera_ray.storage.keys import ContentHasher, Payload, payload_view
from tessera_ray.storage.tier import StorageTier

__all__ = ["WindowStrategy", "window_write_bytes", "WindowPersister"]


class WindowStrategy(enum.Enum):
    DROP = "drop"
    SNAPSHOT = "snapshot"
    FULL = "full"


def window_write_bytes(
    layout: ModelLayout, context_tokens: int, strategy: WindowStrategy, *, checkpoints: int = 1
) -> int:
    """Bytes one request writes to disk for its sliding windows under ``strategy``."""
    if context_tokens < 0 or checkpoints < 0:
        raise ValueError("context_tokens and checkpoints must be non-negative")
    total = 0
    for spec, layers in layout.windows:
        assert spec.window_tokens is not None
        if strategy is WindowStrategy.FULL:
            tokens = context_tokens
        elif strategy is WindowStrategy.SNAPSHOT:
            tokens = min(context_tokens, spec.window_tokens) * checkpoints
        else:
            tokens = 0
        groups = tokens // spec.stride_tokens
        total += groups * spec.bytes_per_group * len(layers)
    return total


class WindowPersister:
    """Writes one request's window bytes to a tier under a strategy; returns the keys to keep.

    Window bytes are stored like pages (content-addressed, verified on read); the caller keeps
    the returned keys with its request state. ``drop`` writes nothing and restore returns
    ``None``: the caller recomputes.
    """

    def __init__(self, tier: StorageTier, strategy: WindowStrategy, hasher: ContentHasher) -> None:
        self.tier = tier
        self.strategy = strategy
        self._hasher = hasher
        self.bytes_written = 0

    async def _store(self, data: Payload) -> bytes:
        view = payload_view(data)
        key = self._hasher(view)
        await self.tier.put(key, view)
        self.bytes_written += view.nbytes
        return key

    async def on_produced(self, entries: Payload) -> bytes | None:
        """New window entries were produced (one decode step or a prefill chunk)."""
        if self.strategy is not WindowStrategy.FULL:
            return None
        return await self._store(entries)

    async def on_checkpoint(self, window: Payload) -> bytes | None:
        """A request checkpoint (end of turn, pause): the whole current window."""
        if self.strategy is not WindowStrategy.SNAPSHOT:
            return None
        return await self._store(window)

    async def restore(self, keys: Sequence[bytes]) -> bytes | None:
        """The persisted bytes (the snapshot, or all entries in order), or ``None`` to
        recompute. A corrupt record raises ``CorruptPageError``: recompute then too."""
        if self.strategy is WindowStrategy.DROP or not keys:
            return None
        parts = [await self.tier.get(k) for k in keys]
        return b"".join(parts)
