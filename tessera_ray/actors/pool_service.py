"""The logic of one pool actor, as a plain asyncio class (the Ray actor is a thin shell).

A pool holds one :class:`~tessera_ray.core.BlockPool` per layer group of the layout; a token
block is one page per layer of every group, and its payload is those pages' bytes in group then
layer order (``block_bytes`` in all). Everything is batched: lists in, aligned lists out.

Lifecycles:

- **Store, two-phase**: ``reserve`` takes free slots under a lease, ``commit`` writes, seals
  (byte-verified dedup) and registers the blocks with the directory, ``abort`` returns them.
  A lease that expires returns its slots, so a client dying mid-store leaves nothing behind.
- **Read**: ``pin`` takes references on the blocks under a lease and exports their slots and
  page content hashes (what a transport reads and the reader verifies); ``unpin`` releases.
- **Eviction** under pressure: blocks whose other replicas the directory knows go first and are
  simply dropped; the last copy of a block goes to the disk tier instead of vanishing.
- **Restart**: the disk tier is reopened and its blocks are announced again.

Every wall-clock deadline uses ``clock`` (injectable for tests). Methods check their input
before changing anything.
"""

from __future__ import annotations

import itertools
import secrets
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tessera_ray.actors._eviction import eviction_plan
from tessera_ray.actors._leases import Lease as _Lease
from tessera_ray.actors._leases import LeaseTable
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Registration, Registrations, Replica, Tier
from tessera_ray.actors.disk_blocks import DiskBlocks
from tessera_ray.actors.links import DirectoryLink
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockReads,
    BlockRef,
    EvictionReport,
    PinnedBlock,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.pool_transfer import TransferMixin
from tessera_ray.actors.tenancy import Access, TenantGate, check_batch
from tessera_ray.core import (
    BlockPool,
    ContentHashFn,
    PageHandle,
    PoolConfig,
    block_hash,
    content_seed,
    xxh3_128,
)
from tessera_ray.core.results import BlockHash, ContentHash, TokenKey
from tessera_ray.errors import LeaseError, PageShapeError, PoolExhaustedError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import Transport

__all__ = ["PoolService"]

_KEY_BYTES = 32
_RESERVE_ROUNDS = 3
_Key = tuple[str, bytes]


class PoolService(TransferMixin):
    """One pool: layer-group block pools, leases, the disk tier and directory updates.

    Moving blocks between pools (verified install, one-sided fetch) and attention over the
    pool's pages live in :class:`~tessera_ray.actors.pool_transfer.TransferMixin`.
    """

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
        if not layout.groups:
            raise PageShapeError(f"layout {layout.model!r} has no paged layer group to pool")
        self.name = name
        self.node = node
        self.layout = layout
        self.config = config
        self.directory = directory
        self.clock = clock
        self.incarnation = secrets.randbits(62) + 1
        """Random per process start; travels on pin tickets (see :class:`PinTicket`)."""
        self.gate = gate or TenantGate()
        """Checks the namespace every call names (see :mod:`~tessera_ray.actors.tenancy`)."""
        self.pools = [
            BlockPool.for_group(
                layout,
                i,
                PoolConfig(num_pages=config.num_blocks * len(g.layers), device=config.device),
                content_hash=content_hash,
            )
            for i, g in enumerate(layout.groups)
        ]
        self.group_bytes = [g.block_bytes for g in layout.groups]
        self.block_bytes = sum(self.group_bytes)
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
        self._resident: OrderedDict[_Key, BlockHash] = OrderedDict()  # least recently used first
        self._on_disk: dict[_Key, BlockHash] = {}
        self.leases = LeaseTable(clock)
        self._seeds: dict[str, int] = {}
        self.spills = self.restores = self.lost = self.transfers_in = self.bytes_in = 0
        self.rotten = 0
        self.transport: Transport | None = None

    # ------------------------------------------------------------------ helpers

    def _seed(self, namespace: str) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = content_seed(namespace, self.layout.fingerprint)
        return seed

    def _lease_s(self, lease_s: float | None) -> float:
        lease = self.config.lease_s if lease_s is None else lease_s
        if not 0 < lease <= self.config.max_lease_s:
            raise LeaseError(f"lease_s must be in (0, {self.config.max_lease_s}], got {lease}")
        return lease

    @staticmethod
    def _check_keys(namespace: str, token_keys: Sequence[bytes]) -> None:
        check_batch(len(token_keys))
        if not isinstance(namespace, str) or not namespace:
            raise PageShapeError(f"namespace must be a non-empty str, got {namespace!r}")
        for key in token_keys:
            if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
                raise PageShapeError(f"a token key is {_KEY_BYTES} bytes, got {key!r:.40}")

    def _free_blocks(self) -> int:
        return min(p.stats().pages_free // p.layers_per_block for p in self.pools)

    def reap(self) -> int:
        """Release every expired reservation and pin; returns how many were reaped."""
        expired = self.leases.expired()
        for lease in expired:
            self._release(lease)
        return len(expired)

    def _release(self, lease: _Lease) -> None:
        for per_group in lease.handles:
            for pool, handles in zip(self.pools, per_group, strict=True):
                pool.release_many(handles)

    # ------------------------------------------------------------------ store

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation:
        """Slots for ``num_blocks`` blocks, evicting old blocks if memory is short."""
        self.reap()
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise PageShapeError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if num_blocks > self.config.num_blocks:
            raise PoolExhaustedError(
                f"{num_blocks} blocks asked of a pool of {self.config.num_blocks}; "
                "split the request"
            )
        lease = self._lease_s(lease_s)
        # Evicting awaits the directory, so a concurrent request may take what was freed:
        # try a few rounds before giving up. Pages no key can reach go first, for free.
        for _ in range(_RESERVE_ROUNDS):
            short = num_blocks - self._free_blocks()
            if short <= 0:
                break
            for pool in self.pools:
                pool.evict_unnamed(short * pool.layers_per_block)
            if num_blocks > self._free_blocks():
                # Evict ahead, a sixteenth of the pool at a time: each eviction that spills
                # writes one disk segment with one fsync, so freeing one block per store under
                # steady pressure would pay an fsync per store.
                ahead = max(num_blocks - self._free_blocks(), self.config.num_blocks // 16)
                await self.evict(ahead)
        if self._free_blocks() < num_blocks:
            raise PoolExhaustedError(
                f"pool {self.name!r}: {num_blocks} blocks wanted, {self._free_blocks()} free "
                f"after eviction (the rest is referenced or reserved); retry later"
            )
        handles = [
            [pool.allocate_many(pool.layers_per_block) for pool in self.pools]
            for _ in range(num_blocks)
        ]
        rid, taken = self.leases.reserve(handles, lease)
        return Reservation(rid, self.name, num_blocks, taken.expires_at_s)

    def abort(self, reservation_id: int) -> None:
        lease = self.leases.reservations.pop(reservation_id, None)
        if lease is not None:
            self._release(lease)

    def _payload_rows(self, payloads: object, count: int) -> torch.Tensor:
        rows: torch.Tensor | None = None
        if isinstance(payloads, torch.Tensor):
            rows = payloads
        elif isinstance(payloads, np.ndarray):
            with warnings.catch_warnings():
                # Arrays arriving through Ray are read-only views of the object store; torch
                # warns about that, but these rows are only ever read (copied into pages).
                warnings.simplefilter("ignore", UserWarning)
                rows = torch.as_tensor(payloads)
        if rows is None or rows.dtype != torch.uint8:
            got = getattr(payloads, "dtype", type(payloads).__name__)
            raise PageShapeError(
                f"payloads must be a uint8 array [blocks, {self.block_bytes}], got {got}"
            )
        if rows.dim() != 2 or rows.shape[0] != count or rows.shape[1] != self.block_bytes:
            raise PageShapeError(
                f"payloads must be [{count}, {self.block_bytes}] (one block per token key), "
                f"got {list(rows.shape)}"
            )
        return rows.contiguous()

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
        return await self._commit(reservation_id, namespace, token_keys, payloads)

    async def _commit(
        self,
        reservation_id: int,
        namespace: str,
        token_keys: Sequence[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        self.reap()
        lease = self.leases.reservations.get(reservation_id)
        if lease is None:
            raise LeaseError(
                f"reservation {reservation_id} is unknown or expired (its slots were returned); "
                f"reserve again"
            )
        self._check_keys(namespace, token_keys)
        if len(token_keys) > len(lease.handles):
            raise PageShapeError(
                f"{len(token_keys)} blocks for a reservation of {len(lease.handles)}"
            )
        rows = self._payload_rows(payloads, len(token_keys))
        del self.leases.reservations[reservation_id]
        stored = [
            self._seal(namespace, key, lease.handles[i], rows[i])
            for i, key in enumerate(token_keys)
        ]
        for per_group in lease.handles[len(token_keys) :]:
            for pool, handles in zip(self.pools, per_group, strict=True):
                pool.release_many(handles)
        await self._announce(namespace, stored, Tier.MEMORY)
        if self.config.write_through and self.disk is not None:
            await self._write_through(namespace, stored, rows)
        return stored

    async def _write_through(
        self, namespace: str, stored: Sequence[StoredBlock], rows: torch.Tensor
    ) -> None:
        """Put every newly named block on disk before the store is acknowledged: a pool that
        dies then loses no stored block (its restart reopens the disk tier)."""
        assert self.disk is not None
        items = [
            (s.token_key, s.block_hash, rows[i].numpy().tobytes())
            for i, s in enumerate(stored)
            if s.registered and (namespace, s.token_key) not in self._on_disk
        ]
        if not items:
            return
        await self.disk.put(namespace, items)
        for key, bh, _ in items:
            self._on_disk[(namespace, key)] = bh
        if self.directory is not None:
            await self.directory.register(
                [
                    Registration(namespace, key, bh, Replica(self.name, Tier.DISK, 0, 0))
                    for key, bh, _ in items
                ]
            )

    def _seal(
        self, namespace: str, key: TokenKey, per_group: list[list[PageHandle]], row: torch.Tensor
    ) -> StoredBlock:
        offset, hashes, dedup, registered = 0, [], True, True
        first: PageHandle | None = None
        for pool, handles, nbytes in zip(self.pools, per_group, self.group_bytes, strict=True):
            data = row[offset : offset + nbytes].view(pool.layers_per_block, pool.page_bytes)
            offset += nbytes
            written = pool.write_many(handles, data)
            result = pool.seal_block(written, namespace, key)
            pool.release_many(list(result.handles))  # stored blocks wait in the LRU, findable
            hashes.append(result.block_hash)
            dedup &= all(p.deduplicated for p in result.pages)
            registered &= result.token_key_registered
            first = first or result.handles[0]
        bh = (
            hashes[0]
            if len(hashes) == 1
            else block_hash([ContentHash(h) for h in hashes], self._seed(namespace))
        )
        assert first is not None
        if registered:
            self._resident[(namespace, key)] = BlockHash(bh)
            self._resident.move_to_end((namespace, key))
        return StoredBlock(
            key, BlockHash(bh), first.offset // first.length, first.generation, dedup, registered
        )

    async def _announce(self, namespace: str, blocks: Sequence[StoredBlock], tier: Tier) -> None:
        if self.directory is None:
            return
        entries = [
            Registration(
                namespace, b.token_key, b.block_hash, Replica(self.name, tier, b.slot, b.generation)
            )
            for b in blocks
            if b.registered
        ]
        if entries:
            await self.directory.register(entries)

    async def store(
        self, access: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        """Reserve and commit in one call (for callers already holding the bytes)."""
        namespace = self.gate.resolve(access, write=True)
        self._check_keys(namespace, token_keys)
        self._payload_rows(payloads, len(token_keys))
        res = await self.reserve(len(token_keys))
        return await self._commit(res.id, namespace, token_keys, payloads)

    # ------------------------------------------------------------------ read

    def contains(
        self, access: Access, token_keys: Sequence[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        """Where this pool holds each block: memory, disk, or nowhere."""
        namespace = self.gate.resolve(access, write=False)
        self._check_keys(namespace, token_keys)
        out: list[Tier | None] = []
        for key in token_keys:
            if self.pools[0].contains(namespace, key):
                out.append(Tier.MEMORY)
                if touch and (namespace, key) in self._resident:
                    # A hit is a use: the block moves to the young end of the eviction order.
                    self._resident.move_to_end((namespace, key))
            elif (namespace, key) in self._on_disk:
                out.append(Tier.DISK)
            else:
                out.append(None)
        return out

    def resident_hashes(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockHash | None]:
        """The block hash of each block this pool holds in memory, ``None`` for the others:
        the node's own answer to a lookup, without asking the directory."""
        namespace = self.gate.resolve(access, write=False)
        self._check_keys(namespace, token_keys)
        return [
            self._resident.get((namespace, key)) if self.pools[0].contains(namespace, key) else None
            for key in token_keys
        ]

    def pin_resident(
        self, access: Access, token_keys: Sequence[TokenKey], lease_s: float | None = None
    ) -> PinTicket | None:
        """:meth:`pin` when it has nothing to await: every block is in memory or nowhere (none
        to restore from disk, none whose pages vanished). ``None`` otherwise, holding nothing:
        call :meth:`pin`. The pin channel answers this way inside the callback that read the
        request, with no task and no further turn of the loop."""
        self.reap()
        namespace = self.gate.resolve(access, write=False)
        self._check_keys(namespace, token_keys)
        lease = self._lease_s(lease_s)
        taken = self._take(namespace, token_keys)
        for i, key in enumerate(token_keys):
            if i not in taken and (
                (namespace, key) in self._on_disk or (namespace, key) in self._resident
            ):
                for refs in taken.values():
                    self._release(_Lease([refs], 0.0))
                return None
        blocks = [
            self._pinned(namespace, key, taken[i]) if i in taken else None
            for i, key in enumerate(token_keys)
        ]
        return self._ticket(namespace, list(taken.values()), blocks, lease)

    def _take(
        self, namespace: str, token_keys: Sequence[TokenKey]
    ) -> dict[int, list[list[PageHandle]]]:
        """References on every block of ``token_keys`` already in memory, by position."""
        taken: dict[int, list[list[PageHandle]]] = {}
        for i, key in enumerate(token_keys):
            handles = self._reference(namespace, key)
            if handles is not None:
                taken[i] = handles
                if (namespace, key) in self._resident:
                    # A pin is a use. Eviction also looks for victims among the oldest
                    # blocks only: held blocks left there would crowd out evictable ones.
                    self._resident.move_to_end((namespace, key))
        return taken

    def _pinned(
        self, namespace: str, key: TokenKey, handles: list[list[PageHandle]]
    ) -> PinnedBlock:
        """What a reader needs of one held block: its pages' slots and content hashes."""
        return PinnedBlock(
            key,
            self._resident[(namespace, key)],
            tuple(tuple(h.offset // h.length for h in hs) for hs in handles),
            tuple(
                tuple(pool.content_hash_of(h) for h in hs)
                for pool, hs in zip(self.pools, handles, strict=True)
            ),
        )

    def _ticket(
        self,
        namespace: str,
        held: list[list[list[PageHandle]]],
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
        lease = self._lease_s(lease_s)
        # References first, on every block already in memory: restoring the others reserves
        # slots, which may evict, and must not evict a block this very pin is about to take.
        taken = self._take(namespace, token_keys)
        try:
            await self._restore(namespace, [k for i, k in enumerate(token_keys) if i not in taken])
        except PoolExhaustedError:
            pass  # no room to restore beside what is held: those blocks are misses, not errors
        except BaseException:
            for refs in taken.values():
                self._release(_Lease([refs], 0.0))
            raise
        held: list[list[list[PageHandle]]] = []
        blocks: list[PinnedBlock | None] = []
        vanished: list[tuple[str, BlockHash]] = []
        for i, key in enumerate(token_keys):
            handles = taken.get(i) or self._reference(namespace, key)
            if handles is None:
                bh = self._resident.pop((namespace, key), None)
                if bh is not None:  # dropped with a deduplicated page of another block
                    vanished.append((namespace, bh))
                blocks.append(None)
                continue
            held.append(handles)
            self._resident.move_to_end((namespace, key))
            blocks.append(self._pinned(namespace, key, handles))
        if vanished and self.directory is not None:
            await self.directory.drop(self.name, vanished, Tier.MEMORY)
        return self._ticket(namespace, held, blocks, lease)

    def _reference(self, namespace: str, key: TokenKey) -> list[list[PageHandle]] | None:
        """References on every page of the block (all layer groups), or ``None`` and no
        reference when any group lacks it."""
        per_group = [pool.lookup(namespace, key) for pool in self.pools]
        if any(h is None for h in per_group):
            for pool, h in zip(self.pools, per_group, strict=True):
                if h is not None:
                    pool.release_many(list(h))
            return None
        return [list(h) for h in per_group if h is not None]

    def unpin(self, pin_id: int) -> bool:
        lease = self.leases.pins.pop(pin_id, None)
        if lease is None:
            return False
        self._release(lease)
        return True

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

    async def check_blocks(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockCheck]:
        """Re-hash the blocks a consumer could not verify and drop those whose bytes here no
        longer match their seal (see :class:`BlockCheck`). Any reader may ask: the pool only
        acts on what it proves itself, so a false report costs one hash pass, nothing more."""
        self.reap()
        namespace = self.gate.resolve(access, write=False)
        self._check_keys(namespace, token_keys)
        out: list[BlockCheck] = []
        dropped: list[tuple[str, BlockHash]] = []
        for key in token_keys:
            per_group = self._reference(namespace, key)
            if per_group is None:
                out.append(BlockCheck.ABSENT)
                continue
            try:
                intact = all(
                    pool.verify(h)
                    for pool, handles in zip(self.pools, per_group, strict=True)
                    for h in handles
                )
            finally:
                for pool, handles in zip(self.pools, per_group, strict=True):
                    pool.release_many(handles)
            if intact:
                out.append(BlockCheck.INTACT)
                continue
            # Evicted without a copy: the rotten bytes must not reach the disk tier either. As
            # in _evict_block, the first layer group decides (references span every group). A
            # rotten page another block shares stays for that block, until it is checked too.
            first, *rest = self.pools
            if first.evict_block(namespace, key, copy_data=False) is None:
                out.append(BlockCheck.IN_USE)
                continue
            for pool in rest:
                pool.evict_block(namespace, key, copy_data=False)
            self.rotten += 1
            bh = self._resident.pop((namespace, key), None)
            if bh is not None:
                dropped.append((namespace, bh))
            out.append(BlockCheck.DROPPED)
        if dropped and self.directory is not None:
            await self.directory.drop(self.name, dropped, Tier.MEMORY)
        return out

    def read_pinned(self, pin_id: int) -> np.ndarray:
        """The pinned blocks' payloads, ``[blocks held, block_bytes]`` (the object-store path)."""
        lease = self.leases.pins.get(pin_id)
        if lease is None:
            raise LeaseError(f"pin {pin_id} is unknown or expired; pin again")
        n = len(lease.handles)
        # One gather per layer group over every pinned block (its pages in layer order), not
        # one per block: a read of many blocks is one copy.
        parts = []
        for g, (pool, nbytes) in enumerate(zip(self.pools, self.group_bytes, strict=True)):
            idx = [h.offset // h.length for per_group in lease.handles for h in per_group[g]]
            pages = pool.data.index_select(0, torch.tensor(idx, dtype=torch.long))
            parts.append(pages.reshape(n, nbytes))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return np.ascontiguousarray(out.cpu().numpy())

    # ------------------------------------------------------------------ eviction and disk

    async def evict(self, num_blocks: int) -> EvictionReport:
        """Evict up to ``num_blocks`` unreferenced blocks, least recently used first, preferring
        blocks another pool also holds. A block leaves memory without a disk write only when a
        durable copy exists (on this pool's disk tier, or a disk replica elsewhere); otherwise
        it is spilled to this pool's disk tier.

        Why a copy in another pool's *memory* is not enough: that pool may be evicting its copy
        at the same moment, trusting this one (the directory cannot say who goes first), and
        the block would vanish from both. The load test found exactly that. Without a disk tier
        such blocks are dropped (and the loss is the cache's, as for any last copy).
        """
        # Only the least recently used few are considered (and asked about in one directory
        # call per namespace), not the whole pool: eviction cost stays bounded by the request.
        candidates = list(itertools.islice(self._resident, max(4 * num_blocks, 64)))
        order, durable = eviction_plan(
            candidates,
            self._on_disk,
            await self._replicas_elsewhere(candidates),
            has_disk=self.disk is not None,
        )
        dropped: list[BlockRef] = []
        spill: dict[str, list[tuple[TokenKey, BlockHash, bytes]]] = {}
        for ns, key in order:
            if len(dropped) + sum(len(v) for v in spill.values()) >= num_blocks:
                break
            payload = self._evict_block(ns, TokenKey(key))
            if payload is None:
                continue
            bh = self._resident.pop((ns, key))
            if (ns, key) in durable:
                dropped.append(BlockRef(ns, TokenKey(key), bh))
            else:
                spill.setdefault(ns, []).append((TokenKey(key), bh, payload))
        spilled: list[BlockRef] = []
        lost: list[BlockRef] = []
        for ns, items in spill.items():
            refs = [BlockRef(ns, k, bh) for k, bh, _ in items]
            if self.disk is None:
                lost.extend(refs)
                continue
            await self.disk.put(ns, items)
            spilled.extend(refs)
            for ref in refs:
                self._on_disk[(ns, ref.token_key)] = ref.block_hash
        self.spills += len(spilled)
        self.lost += len(lost)
        if self.directory is not None:
            # The disk replicas are announced before the memory ones are withdrawn, so a
            # lookup in between finds the block somewhere (a key with no replica is forgotten).
            for ns in {r.namespace for r in spilled}:
                await self.directory.register(
                    [
                        Registration(
                            ns, r.token_key, r.block_hash, Replica(self.name, Tier.DISK, 0, 0)
                        )
                        for r in spilled
                        if r.namespace == ns
                    ]
                )
            gone = [(r.namespace, r.block_hash) for r in (*dropped, *spilled, *lost)]
            if gone:
                await self.directory.drop(self.name, gone, Tier.MEMORY)
        return EvictionReport(tuple(dropped), tuple(spilled), tuple(lost))

    async def _replicas_elsewhere(self, keys: Sequence[_Key]) -> dict[_Key, list[Replica]]:
        """Per block, the replicas the directory knows on other pools (one lookup per
        namespace)."""
        out: dict[_Key, list[Replica]] = {}
        if self.directory is None or not keys:
            return out
        by_ns: dict[str, list[_Key]] = {}
        for k in keys:
            by_ns.setdefault(k[0], []).append(k)
        for ns, in_ns in by_ns.items():
            results = await self.directory.lookup(
                self.gate.for_pool(ns), [TokenKey(k[1]) for k in in_ns]
            )
            for k, r in zip(in_ns, results, strict=True):
                out[k] = [rep for rep in (r.replicas if r else ()) if rep.pool != self.name]
        return out

    def _evict_block(self, namespace: str, key: TokenKey) -> bytes | None:
        """The block's payload (every layer's page, in order) and its eviction from memory;
        ``None`` when it is referenced (pinned or being read) or already gone."""
        per_group = [pool.lookup(namespace, key) for pool in self.pools]
        try:
            if any(h is None for h in per_group):
                return None
            # Read before evicting: pages the block shares with other blocks stay in the pool,
            # so the payload cannot be rebuilt from what leaves.
            payload = b"".join(
                pool.read_bytes(h)
                for pool, hs in zip(self.pools, per_group, strict=True)
                for h in hs or ()
            )
        finally:
            for pool, hs in zip(self.pools, per_group, strict=True):
                if hs is not None:
                    pool.release_many(list(hs))
        # Pins and lookups reference every group's pages together, so either every group
        # evicts or none does; the first group decides.
        for g, pool in enumerate(self.pools):
            if pool.evict_block(namespace, key, copy_data=False) is None:
                assert g == 0, "block referenced in one layer group but not in another"
                return None
        return payload

    async def _restore(self, namespace: str, token_keys: Sequence[TokenKey]) -> None:
        wanted = [k for k in token_keys if (namespace, k) in self._on_disk]
        if not wanted or self.disk is None:
            return
        found = await self.disk.get(namespace, wanted)
        keys = [k for k, f in zip(wanted, found, strict=True) if f is not None]
        for k, f in zip(wanted, found, strict=True):
            if f is None:
                self._on_disk.pop((namespace, k), None)
        if not keys:
            return
        rows = np.stack([np.frombuffer(f[1], dtype=np.uint8) for f in found if f is not None])
        res = await self.reserve(len(keys))
        await self._commit(res.id, namespace, keys, rows)
        self.restores += len(keys)

    async def reopen_disk(self) -> int:
        """After a restart: learn the disk tier's blocks again and announce them."""
        if self.disk is None:
            return 0
        blocks = await self.disk.reopen()
        for b in blocks:
            self._on_disk[(b.namespace, b.token_key)] = b.block_hash
        if self.directory is not None and blocks:
            await self.directory.register(
                [
                    Registration(
                        b.namespace, b.token_key, b.block_hash, Replica(self.name, Tier.DISK, 0, 0)
                    )
                    for b in blocks
                ]
            )
        return len(blocks)

    # ------------------------------------------------------------------ inventory and status

    def inventory(self) -> Registrations:
        """Every block this pool can serve, as directory registrations (for a rebuild)."""
        out = Registrations(
            Registration(ns, TokenKey(key), bh, Replica(self.name, Tier.MEMORY, 0, 0))
            for (ns, key), bh in self._resident.items()
            if self.pools[0].contains(ns, TokenKey(key))
        )
        out += (
            Registration(ns, TokenKey(key), bh, Replica(self.name, Tier.DISK, 0, 0))
            for (ns, key), bh in self._on_disk.items()
        )
        return out

    def status(self) -> PoolStatus:
        stats = [p.stats() for p in self.pools]
        _, disk_bytes = self.disk.stats() if self.disk is not None else (0, 0)
        pages_used = {Tier.MEMORY: sum(s.pages_used for s in stats)}
        pages_free = {Tier.MEMORY: sum(s.pages_free for s in stats)}
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
            blocks_free=self._free_blocks(),
            blocks_in_memory=len(self._resident),
            blocks_on_disk=len(self._on_disk),
            disk_bytes=disk_bytes,
            reservations=len(self.leases.reservations),
            pins=len(self.leases.pins),
            dedup_hits=sum(s.dedup_hits for s in stats),
            bytes_saved_by_dedup=sum(s.bytes_saved_by_dedup for s in stats),
            collisions=sum(s.collisions for s in stats),
            evictions=sum(s.evictions for s in stats),
            spills=self.spills,
            restores=self.restores,
            lost_blocks=self.lost,
            rotten_blocks=self.rotten,
            transfers_in=self.transfers_in,
            bytes_in=self.bytes_in,
            transport=self.transport.kind if self.transport is not None else "object-store",
            quarantines=self.disk.quarantined() if self.disk is not None else 0,
            pages_used=pages_used,
            pages_free=pages_free,
        )

    async def close(self) -> None:
        for lease in self.leases.drain():
            self._release(lease)
        if self.disk is not None:
            await self.disk.close()
        if self.transport is not None:
            self.transport.close()
