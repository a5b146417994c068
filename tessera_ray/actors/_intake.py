"""Blocks arriving from other pools: bytes through the object store, checked page by page
against the owner's content hashes before anything is sealed, or one-sided reads of the
owner's pinned pages straight into reserved slots, verified and sealed in one hash pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tessera_ray.actors._announcer import Announcer
from tessera_ray.actors._groups import LayerGroups, check_keys
from tessera_ray.actors._writer import BlockWriter
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.messages import (
    NOT_HELD,
    BlockFailure,
    InstallResult,
    PinnedBlock,
    PinTicket,
    Reservation,
    StoredBlock,
)
from tessera_ray.errors import PageShapeError
from tessera_ray.transport import PeerInfo, Transport
from tessera_ray.transport.fetch import PageExport, fetch_verified_many

__all__ = ["Intake"]


class Intake:
    """The receiving side of moving blocks between pools, and its counts."""

    def __init__(self, writer: BlockWriter, groups: LayerGroups, announce: Announcer) -> None:
        self.writer = writer
        self.groups = groups
        self.announce = announce
        self.transport: Transport | None = None
        self.transfers_in = self.bytes_in = 0

    def attach(self, transport: Transport) -> PeerInfo:
        """Register the pool's memory with ``transport`` (once); returns what peers need."""
        self.transport = transport
        return transport.register(self.groups.pools)

    def _count(self, blocks: int) -> None:
        self.transfers_in += blocks
        self.bytes_in += blocks * self.groups.block_bytes

    async def install(
        self, namespace: str, blocks: Sequence[PinnedBlock], payloads: np.ndarray | torch.Tensor
    ) -> InstallResult:
        """Install blocks that arrived as bytes: a block with any page that does not match the
        owner's content hash is refused whole (never sealed); the others are stored here."""
        check_keys(namespace, [b.token_key for b in blocks])
        rows = self.writer.payload_rows(payloads, len(blocks))
        errors = [self.groups.verify_row(rows[i], b, namespace) for i, b in enumerate(blocks)]
        good = [i for i, e in enumerate(errors) if e is None]
        installed: list[StoredBlock | None] = [None] * len(blocks)
        if good:
            res = await self.writer.reserve(len(good))
            keys = [blocks[i].token_key for i in good]
            stored = await self.writer.commit(res.id, namespace, keys, rows[good])
            for i, s in zip(good, stored, strict=True):
                installed[i] = s
            self._count(len(good))
        return InstallResult(tuple(installed), tuple(errors))

    async def fetch_pinned(
        self,
        ticket: PinTicket,
        owner_peer: str,
        timeout_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> list[BlockFailure | None]:
        """Read the blocks ``ticket`` pinned on another pool straight into reserved local slots
        (one transport request per layer group), verify every page's content hash, and name
        the blocks under their token keys. Per pinned block: ``None`` or why it failed. A
        failed block's slots return to the free list or stay unnamed; nothing unverified is
        ever sealed. The owner unpins afterwards, whatever the outcome.

        ``reservation``: slots reserved while the pin was on its way (at least one block per
        pinned block; the fetch takes it over and frees what it does not use); ``None``
        reserves here."""
        if self.transport is None:
            raise PageShapeError("no transport attached; use install() with the bytes instead")
        held = [b for b in ticket.blocks if b is not None]
        if not held:
            return [None if b is not None else NOT_HELD for b in ticket.blocks]
        lease = self.writer.take(reservation, len(held))  # None: it expired meanwhile
        if lease is None:
            res = await self.writer.reserve(len(held))
            lease = self.writer.take(res, len(held))
            assert lease is not None
        fingerprint = self.groups.layout.fingerprint
        exports = [
            PageExport(
                peer=owner_peer,
                namespace=ticket.namespace,
                fingerprint=fingerprint,
                page_bytes=pool.page_bytes,
                slots=tuple(s for b in held for s in b.slots[g]),
                content_hashes=tuple(h for b in held for h in b.content_hashes[g]),
                group=g,
            )
            for g, pool in enumerate(self.groups.pools)
        ]
        local = [
            [h for per_group in lease.handles for h in per_group[g]] for g in range(len(exports))
        ]
        results = fetch_verified_many(self.transport, exports, local=local, timeout_s=timeout_s)
        outcome = self.groups.name_fetched(ticket.namespace, held, results)
        stored = [s for s in outcome if isinstance(s, StoredBlock)]
        await self.announce.stored(ticket.namespace, stored, Tier.MEMORY)
        self._count(len(stored))
        reasons = iter(None if isinstance(o, StoredBlock) else o for o in outcome)
        return [next(reasons) if b is not None else NOT_HELD for b in ticket.blocks]
