"""The logic of one pool actor, as a plain asyncio class (the Ray actor is a thin shell).

A pool holds one :class:`~tessera_ray.core.BlockPool` per layer group of the layout
(:class:`LayerGroups`); a token block is one page per layer of every group, and its payload is
those pages' bytes in group then layer order (``block_bytes`` in all). Everything is batched:
lists in, aligned lists out. The service is a facade; each job is a collaborator:

- **Store, two-phase** (:class:`BlockWriter`): ``reserve`` takes free slots under a lease,
  ``commit`` writes, seals (byte-verified dedup) and registers the blocks with the directory,
  ``abort`` returns them. A lease that expires returns its slots, so a client dying mid-store
  leaves nothing behind.
- **Read** (here): ``pin`` takes references on the blocks under a lease and exports their
  slots and page content hashes (what a transport reads and the reader verifies).
- **Blocks from other pools** (:class:`Intake`): verified installs and one-sided reads.
- **Eviction and disk** (:class:`Spiller`): blocks with a durable copy elsewhere leave memory
  first; the last copy of a block goes to the disk tier instead of vanishing; on restart the
  disk tier is reopened and announced again.

What a caller in another process reaches are the verbs of
:class:`~tessera_ray.actors.pool_api.PoolApi`, under the same parameter names; those that never
wait are plain methods here, for in-process callers that must not yield (see that module).
Every wall-clock deadline uses ``clock`` (injectable for tests). Methods check their input
before changing anything.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from tessera_ray.actors._announcer import Announcer
from tessera_ray.actors._attend import attend_held
from tessera_ray.actors._groups import Handles, Key, LayerGroups, check_keys
from tessera_ray.actors._intake import Intake
from tessera_ray.actors._leases import Lease, LeaseTable
from tessera_ray.actors._spill import Spiller
from tessera_ray.actors._writer import BlockWriter
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Registration, Registrations, Replica, Tier
from tessera_ray.actors.disk_blocks import DiskBlocks
from tessera_ray.actors.links import DirectoryLink
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockFailure,
    BlockReads,
    EvictionReport,
    InstallResult,
    PinnedBlock,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core import ContentHashFn, xxh3_128
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LeaseError, PageShapeError, PoolExhaustedError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo, Transport

__all__ = ["PoolService"]


class PoolService:
    """One pool: its blocks in memory and on disk, leases, and what the directory is told."""

    def __init__(
        self,
        name: str,
        layout: ModelLayout,
        config: PoolServiceConfig,
        *,
        directory: DirectoryLink | None = None,
        node: str = "local",
        clock: Callable[[], float] = time.time,
        content_hash: ContentHashFn = xxh3_128,
        gate: TenantGate | None = None,
    ) -> None:
        self.name = name
        self.node = node
        self.layout = layout
        self.config = config
        self.clock = clock
        self.incarnation = secrets.randbits(62) + 1
        """Random per process start; travels on pin tickets (see :class:`PinTicket`)."""
        self.gate = gate or TenantGate()
        """Checks the namespace every call names (see :mod:`~tessera_ray.actors.tenancy`)."""
        shm = config.shared_memory_dir
        self.groups = LayerGroups(
            layout,
            config.num_blocks,
            config.device,
            content_hash,
            shared_memory_dir=None if shm is None else str(shm),
        )
        self.pools = self.groups.pools
        self.block_bytes = self.groups.block_bytes
        self.disk = (
            DiskBlocks(
                config.disk_root,
                fingerprint=layout.fingerprint,
                capacity_bytes=config.disk_capacity_bytes,
                block_bytes=self.block_bytes,
            )
            if config.disk_root is not None
            else None
        )
        self.leases = LeaseTable(clock)
        self.announce = Announcer(name, directory)
        self.spill = Spiller(self.groups, self.disk, self.announce, self.gate)
        self.writer = BlockWriter(name, config, self.groups, self.leases, self.spill, self.announce)
        self.intake = Intake(self.writer, self.groups, self.announce)
        self.restores = self.rotten = 0

    @property
    def _on_disk(self) -> Mapping[Key, BlockHash]:
        return self.spill.on_disk

    @property
    def transport(self) -> Transport | None:
        """The transport one-sided reads go through (``None``: bytes through the object store)."""
        return self.intake.transport

    def reap(self) -> int:
        """Release every expired reservation and pin; returns how many were reaped."""
        return self.writer.reap()

    # ------------------------------------------------------------------ store

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation:
        """Slots for ``num_blocks`` blocks, evicting old blocks if memory is short."""
        return await self.writer.reserve(num_blocks, lease_s)

    def abort(self, reservation_id: int) -> None:
        self.writer.abort(reservation_id)

    async def commit(
        self,
        reservation_id: int,
        access: Access,
        token_keys: Sequence[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        """Write, seal and register the reserved blocks under the caller's own namespace;
        unused reserved slots are returned."""
        namespace = self.gate.resolve(access, write=True)
        return await self.writer.commit(reservation_id, namespace, token_keys, payloads)

    async def store(
        self, access: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        """Reserve and commit in one call (for callers already holding the bytes)."""
        return await self.writer.store(self.gate.resolve(access, write=True), token_keys, payloads)

    # ------------------------------------------------------------------ read

    def contains(
        self, access: Access, token_keys: Sequence[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        """Where this pool holds each block: memory, disk, or nowhere (``touch``: a memory hit
        counts as a use in the eviction order)."""
        namespace = self.gate.resolve(access, write=False)
        check_keys(namespace, token_keys)
        out: list[Tier | None] = []
        for key in token_keys:
            if self.groups.contains(namespace, key):
                out.append(Tier.MEMORY)
                if touch:
                    self.groups.touch(namespace, key)
            else:
                out.append(Tier.DISK if (namespace, key) in self._on_disk else None)
        return out

    def resident_hashes(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockHash | None]:
        """The block hash of each block this pool holds in memory, ``None`` for the others:
        the node's own answer to a lookup, without asking the directory."""
        namespace = self.gate.resolve(access, write=False)
        check_keys(namespace, token_keys)
        return [self.groups.resident_hash(namespace, key) for key in token_keys]

    def pin_resident(
        self, access: Access, token_keys: Sequence[TokenKey], lease_s: float | None = None
    ) -> PinTicket | None:
        """:meth:`pin` when it has nothing to await: every block is in memory or nowhere (none
        to restore from disk, none whose pages vanished). ``None`` otherwise, holding nothing:
        call :meth:`pin`. The pin channel answers this way inside the callback that read the
        request, with no task and no further turn of the loop."""
        self.writer.reap()
        namespace = self.gate.resolve(access, write=False)
        check_keys(namespace, token_keys)
        lease = self.writer.lease_s(lease_s)
        held: list[Handles] = []
        blocks: list[PinnedBlock | None] = []
        for key in token_keys:
            got = self.groups.reference_pinned(namespace, key)
            if got is None and (
                (namespace, key) in self._on_disk or (namespace, key) in self.groups.hashes
            ):
                self.writer.release(Lease(held, 0.0))
                return None
            if got is not None:
                held.append(got[0])
            blocks.append(None if got is None else got[1])
        return self._ticket(namespace, held, blocks, lease)

    def _take(self, namespace: str, token_keys: Sequence[TokenKey]) -> dict[int, Handles]:
        """References on every block of ``token_keys`` already in memory, by position."""
        taken: dict[int, Handles] = {}
        for i, key in enumerate(token_keys):
            handles = self.groups.reference(namespace, key)
            if handles is not None:
                taken[i] = handles
        return taken

    def _ticket(
        self,
        namespace: str,
        held: list[Handles],
        blocks: list[PinnedBlock | None],
        lease_s: float,
    ) -> PinTicket:
        """Register the references ``held`` as one pin lease; its ticket."""
        pid, lease = self.leases.pin(held, lease_s, namespace)
        return PinTicket(
            pid, self.name, namespace, tuple(blocks), lease.expires_at_s, self.incarnation
        )

    async def pin(
        self, access: Access, token_keys: Sequence[TokenKey], lease_s: float | None = None
    ) -> PinTicket:
        """Hold the blocks in memory for a reader (restoring disk-only ones first)."""
        ticket = self.pin_resident(access, token_keys, lease_s)
        if ticket is not None:
            return ticket
        namespace = self.gate.resolve(access, write=False)
        lease = self.writer.lease_s(lease_s)
        # References first, on every block already in memory: restoring the others reserves
        # slots, which may evict, and must not evict a block this very pin is about to take.
        taken = self._take(namespace, token_keys)
        try:
            await self._restore(namespace, [k for i, k in enumerate(token_keys) if i not in taken])
        except PoolExhaustedError:
            pass  # no room to restore beside what is held: those blocks are misses, not errors
        except BaseException:
            self.writer.release(Lease(list(taken.values()), 0.0))
            raise
        held: list[Handles] = []
        blocks: list[PinnedBlock | None] = []
        vanished: list[tuple[str, BlockHash]] = []
        for i, key in enumerate(token_keys):
            handles = taken.get(i) or self.groups.reference(namespace, key)
            if handles is None:
                bh = self.groups.forget(namespace, key)
                if bh is not None:  # named here, yet some layer group lacks its block
                    vanished.append((namespace, bh))
                blocks.append(None)
                continue
            held.append(handles)
            blocks.append(self.groups.pinned(namespace, key, handles))
        await self.announce.gone_from_memory(vanished)
        return self._ticket(namespace, held, blocks, lease)

    def unpin(self, pin_id: int) -> bool:
        lease = self.leases.unpin(pin_id)
        if lease is None:
            return False
        self.writer.release(lease)
        return True

    async def read(self, access: Access, token_keys: Sequence[TokenKey]) -> list[np.ndarray | None]:
        """Per key, the block's bytes, or ``None`` (:meth:`read_blocks` without the hashes)."""
        blocks = await self.read_blocks(access, token_keys)
        return [b.payload if b is not None else None for b in blocks]

    async def read_blocks(self, access: Access, token_keys: Sequence[TokenKey]) -> BlockReads:
        """Per key, the block's bytes and hash (restored from disk if need be), or nothing
        when this pool holds no block under it; for callers that consume bytes."""
        ticket = await self.pin(access, token_keys)
        try:
            payloads = self.read_pinned(ticket.id)
            hashes = [b.block_hash if b is not None else None for b in ticket.blocks]
            return BlockReads.of(hashes, payloads)
        finally:
            self.unpin(ticket.id)

    async def read_into(
        self, access: Access, token_keys: Sequence[TokenKey], out: np.ndarray
    ) -> tuple[BlockHash | None, ...]:
        """:meth:`read_blocks` with the held blocks' bytes written into ``out``'s first rows,
        in key order (a reader's shared-memory slab; ``out`` must hold every key); answers
        each key's hash, ``None`` where not held."""
        if len(out) < len(token_keys):
            raise PageShapeError(f"{len(token_keys)} blocks to read into {len(out)} rows")
        ticket = await self.pin(access, token_keys)
        try:
            lease = self.leases.pinned(ticket.id)
            assert lease is not None, "a pin just taken is held"
            self.groups.gather(lease.handles, out[: len(lease.handles)])
            return tuple(b.block_hash if b is not None else None for b in ticket.blocks)
        finally:
            self.unpin(ticket.id)

    async def check_blocks(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockCheck]:
        """Re-hash the blocks a consumer could not verify and drop those whose bytes here no
        longer match their seal (see :class:`BlockCheck`). Any reader may ask: the pool only
        acts on what it proves itself, so a false report costs one hash pass, nothing more."""
        self.writer.reap()
        namespace = self.gate.resolve(access, write=False)
        check_keys(namespace, token_keys)
        out: list[BlockCheck] = []
        dropped: list[tuple[str, BlockHash]] = []
        for key in token_keys:
            per_group = self.groups.reference(namespace, key)
            if per_group is None:
                out.append(BlockCheck.ABSENT)
                continue
            try:
                intact = self.groups.intact(per_group)
            finally:
                self.groups.release(per_group)
            if intact:
                out.append(BlockCheck.INTACT)
            # Dropped without a copy: rotten bytes must not reach the disk tier either. A
            # rotten page another block shares stays for that block, until it is checked too.
            elif (gone := self.groups.drop(namespace, key)) is None:
                out.append(BlockCheck.IN_USE)
            else:
                self.rotten += len(gone)
                dropped.extend((namespace, g.block_hash) for g in gone)
                out.append(BlockCheck.DROPPED)
        await self.announce.gone_from_memory(list(dict.fromkeys(dropped)))
        return out

    def read_pinned(self, pin_id: int) -> np.ndarray:
        """The pinned blocks' payloads, ``[blocks held, block_bytes]`` (the object-store path)."""
        lease = self.leases.pinned(pin_id)
        if lease is None:
            raise LeaseError(f"pin {pin_id} is unknown or expired; pin again")
        return self.groups.gather(lease.handles)

    # ------------------------------------------------------------------ blocks from other pools

    async def install(
        self, namespace: str, blocks: Sequence[PinnedBlock], payloads: np.ndarray | torch.Tensor
    ) -> InstallResult:
        """Install blocks that arrived as bytes, verified (see :meth:`Intake.install`)."""
        return await self.intake.install(namespace, blocks, payloads)

    def attach_transport(self, transport: Transport) -> PeerInfo:
        """Register this pool's memory with ``transport`` (once); returns what peers need."""
        return self.intake.attach(transport)

    async def fetch_pinned(
        self,
        ticket: PinTicket,
        owner_peer: str,
        timeout_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> list[BlockFailure | None]:
        """One-sided reads of another pool's pinned blocks (see :meth:`Intake.fetch_pinned`)."""
        return await self.intake.fetch_pinned(ticket, owner_peer, timeout_s, reservation)

    def attend(
        self,
        access: Access,
        token_keys: Sequence[TokenKey],
        positions: Sequence[int],
        layer: int,
        q: torch.Tensor,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Partial MLA attention over the blocks this pool holds (see :func:`attend_held`)."""
        namespace = self.gate.resolve(access, write=False)
        check_keys(namespace, token_keys)
        return attend_held(
            self.groups, namespace, token_keys, positions, layer, q, seqlen, softmax_scale, causal
        )

    # ------------------------------------------------------------------ eviction and disk

    async def evict(self, num_blocks: int) -> EvictionReport:
        """Evict until ``num_blocks`` blocks' room is free (see :meth:`Spiller.evict`)."""
        return await self.spill.evict(num_blocks)

    async def _restore(self, namespace: str, token_keys: Sequence[TokenKey]) -> None:
        keys, rows = await self.spill.read_back(namespace, token_keys)
        if rows is None:
            return
        res = await self.writer.reserve(len(keys))
        await self.writer.commit(res.id, namespace, keys, rows)
        self.restores += len(keys)

    async def reopen_disk(self) -> int:
        """After a restart: learn the disk tier's blocks again and announce them."""
        return await self.spill.reopen()

    # ------------------------------------------------------------------ inventory and status

    def inventory(self) -> Registrations:
        """Every block this pool can serve, as directory registrations (for a rebuild)."""
        out = Registrations(
            Registration(ns, TokenKey(key), bh, Replica(self.name, Tier.MEMORY, 0, 0))
            for (ns, key), bh in self.groups.hashes.items()
            if self.groups.contains(ns, TokenKey(key))
        )
        out += (
            Registration(ns, TokenKey(key), bh, Replica(self.name, Tier.DISK, 0, 0))
            for (ns, key), bh in self._on_disk.items()
        )
        return out

    def status(self) -> PoolStatus:
        stats = self.groups.stats()
        _, disk_bytes = self.disk.stats() if self.disk is not None else (0, 0)
        pages_used = {Tier.MEMORY: stats.pages_used}
        pages_free = {Tier.MEMORY: stats.pages_free}
        if self.disk is not None:
            # The disk tier stores whole blocks, so its pages are counted in blocks' pages.
            per_block = sum(p.layers_per_block for p in self.pools)
            room = max(0, self.config.disk_capacity_bytes - disk_bytes) // self.block_bytes
            pages_used[Tier.DISK] = len(self._on_disk) * per_block
            pages_free[Tier.DISK] = room * per_block
        return PoolStatus(
            name=self.name,
            node=self.node,
            layout=f"{self.layout.model}/{self.layout.format_name}",
            fingerprint=self.layout.fingerprint,
            block_bytes=self.block_bytes,
            blocks_capacity=self.config.num_blocks,
            blocks_free=self.groups.free_blocks(),
            blocks_in_memory=len(self.groups.hashes),
            blocks_on_disk=len(self._on_disk),
            disk_bytes=disk_bytes,
            reservations=len(self.leases.reservations),
            pins=len(self.leases.pins),
            dedup_hits=stats.dedup_hits,
            bytes_saved_by_dedup=stats.bytes_saved_by_dedup,
            collisions=stats.collisions,
            evictions=stats.evictions,
            spills=self.spill.spills,
            restores=self.restores,
            lost_blocks=self.spill.lost,
            rotten_blocks=self.rotten,
            transfers_in=self.intake.transfers_in,
            bytes_in=self.intake.bytes_in,
            mapped_bytes_in=self.transport.mapped_bytes if self.transport is not None else 0,
            transport=self.intake.transport.kind
            if self.intake.transport is not None
            else "object-store",
            quarantines=self.disk.quarantined() if self.disk is not None else 0,
            pages_used=pages_used,
            pages_free=pages_free,
        )

    async def close(self) -> None:
        for lease in self.leases.drain():
            self.writer.release(lease)
        if self.disk is not None:
            await self.disk.close()
        if self.transport is not None:
            self.transport.close()
