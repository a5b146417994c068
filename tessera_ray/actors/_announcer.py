"""The directory updates of one pool: replicas it gained (stores, spills to disk) and replicas
it lost (evictions, drops), applied in the order the pool made them.

Why a queue: an engine's store waits for nothing but its own pages. Its registrations (and the
drops of the blocks its room was taken from) are the directory's news, not the engine's: they
go out after the store has answered, each batch in one call per shard, merged with whatever
queued meanwhile (a Ray actor call or a channel frame per store, per shard, was most of the
directory's CPU under a serving load). A caller that needs the directory to know before it
goes on (the client's own store, an eviction an operator asked for) waits for its change to be
applied, as before; the engine's road (:data:`WRITE_BEHIND`) does not.

Meanwhile the directory lags this pool by a batch: another node's lookup may miss a block just
stored here (it recomputes, as it would a moment earlier), and this pool's own lookups never ask
the directory for what it holds. A drop queued behind a registration of the same block is
applied after it, never before. A merged batch the directory refuses (a full shard) is refused
whole: a caller that waits gets the error, an engine's store only the log.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera_ray.actors.directory import Registration, Replica, Tier
from tessera_ray.actors.links import DirectoryLink
from tessera_ray.actors.messages import BlockRef, StoredBlock
from tessera_ray.core.results import BlockHash

__all__ = ["Announcer", "WRITE_BEHIND"]

log = logging.getLogger(__name__)

WRITE_BEHIND: contextvars.ContextVar[bool] = contextvars.ContextVar("write_behind", default=False)
"""Set for a call whose directory changes need not be applied before it answers (an engine's
store): they are queued and sent after it."""


@dataclass(slots=True)
class _Change:
    """Registrations, or the drops of one tier's replicas (``tier`` set)."""

    registrations: list[Registration] = field(default_factory=list)
    drops: list[tuple[str, BlockHash]] = field(default_factory=list)
    tier: Tier | None = None
    waiting: list[asyncio.Future[None]] = field(default_factory=list)
    """One per caller that waits for the change (and gets its error, if any)."""

    def takes(self, other: _Change) -> bool:
        """Whether ``other``, queued right after this one, can be sent with it."""
        if self.drops or other.drops:
            return bool(self.drops and other.drops and self.tier == other.tier)
        return True


class Announcer:
    """The directory updates of one pool (none without a directory): see the module."""

    def __init__(self, pool: str, directory: DirectoryLink | None) -> None:
        self.pool = pool
        self.directory = directory
        self._queue: list[_Change] = []
        self._sender: asyncio.Task[None] | None = None
        self.batches = 0
        """Directory writes sent (each one call per shard concerned)."""

    async def register(self, entries: Sequence[Registration]) -> None:
        if self.directory is not None and entries:
            await self._send(_Change(registrations=list(entries)))

    async def stored(self, namespace: str, blocks: Sequence[StoredBlock], tier: Tier) -> None:
        """The blocks just named here (those whose key was not already taken)."""
        await self.register(
            [
                Registration(
                    namespace,
                    b.token_key,
                    b.block_hash,
                    Replica(self.pool, tier, b.slot, b.generation),
                )
                for b in blocks
                if b.registered
            ]
        )

    async def on_disk(self, refs: Sequence[BlockRef]) -> None:
        replica = Replica(self.pool, Tier.DISK, 0, 0)
        await self.register(
            [Registration(r.namespace, r.token_key, r.block_hash, replica) for r in refs]
        )

    async def gone_from_memory(self, blocks: Sequence[tuple[str, BlockHash]]) -> None:
        if self.directory is not None and blocks:
            await self._send(_Change(drops=list(blocks), tier=Tier.MEMORY))

    async def settled(self) -> None:
        """Wait until every change queued so far has been applied."""
        while self._sender is not None and not self._sender.done():
            await asyncio.shield(self._sender)

    async def _send(self, change: _Change) -> None:
        """Queue ``change``; wait until it is applied unless the call is write-behind."""
        loop = asyncio.get_running_loop()
        done = None if WRITE_BEHIND.get() else loop.create_future()
        if done is not None:
            change.waiting.append(done)
        last = self._queue[-1] if self._queue else None
        if last is not None and last.takes(change):
            last.registrations += change.registrations
            last.drops += change.drops
            last.waiting += change.waiting
        else:
            self._queue.append(change)
        if self._sender is None or self._sender.done():
            self._sender = loop.create_task(self._drain())
        if done is not None:
            await asyncio.shield(done)

    async def _drain(self) -> None:
        directory = self.directory
        assert directory is not None, "nothing is queued without a directory"
        while self._queue:
            change = self._queue.pop(0)
            error: Exception | None = None
            try:
                if change.drops:
                    await directory.drop(self.pool, change.drops, change.tier)
                else:
                    await directory.register(change.registrations)
                self.batches += 1
            except Exception as e:  # the directory refused (a full shard): say so, go on
                error = e
                log.exception("pool %s: a directory update failed", self.pool)
            for future in change.waiting:
                if future.done():
                    continue
                if error is not None:
                    future.set_exception(error)  # the caller that waits sees why
                else:
                    future.set_result(None)
