"""The two-phase store of one pool: slots reserved under a lease (evicting if memory is short),
then written, sealed (byte-verified dedup), named, announced, and written through to disk if
the pool is configured so. Restores and installs of fetched bytes take the same path."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from tessera_ray.actors._announcer import Announcer
from tessera_ray.actors._groups import LayerGroups, check_keys
from tessera_ray.actors._leases import Lease, LeaseTable
from tessera_ray.actors._spill import Spiller
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.messages import Reservation, StoredBlock
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LeaseError, PageShapeError, PoolExhaustedError

__all__ = ["BlockWriter"]

_RESERVE_ROUNDS = 3


class BlockWriter:
    """Reservations and commits of one pool (leases expire on ``leases``' clock)."""

    def __init__(
        self,
        pool: str,
        config: PoolServiceConfig,
        groups: LayerGroups,
        leases: LeaseTable,
        spill: Spiller,
        announce: Announcer,
    ) -> None:
        self.pool = pool
        self.config = config
        self.groups = groups
        self.leases = leases
        self.spill = spill
        self.announce = announce

    def lease_s(self, lease_s: float | None) -> float:
        lease = self.config.lease_s if lease_s is None else lease_s
        if not 0 < lease <= self.config.max_lease_s:
            raise LeaseError(f"lease_s must be in (0, {self.config.max_lease_s}], got {lease}")
        return lease

    def release(self, lease: Lease) -> None:
        for per_group in lease.handles:
            self.groups.release(per_group)

    def reap(self) -> int:
        """Release every expired reservation and pin; returns how many were reaped."""
        expired = self.leases.expired()
        for lease in expired:
            self.release(lease)
        return len(expired)

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
        lease = self.lease_s(lease_s)
        groups = self.groups
        # Evicting awaits the directory, so a concurrent request may take what was freed:
        # try a few rounds before giving up. Pages no key can reach go first, for free.
        for _ in range(_RESERVE_ROUNDS):
            short = num_blocks - groups.free_blocks()
            if short <= 0:
                break
            groups.evict_unnamed(short)
            if num_blocks > groups.free_blocks():
                # Evict ahead, a sixteenth of the pool at a time: each eviction that spills
                # writes one disk segment with one fsync, so freeing one block per store under
                # steady pressure would pay an fsync per store.
                ahead = max(num_blocks - groups.free_blocks(), self.config.num_blocks // 16)
                await self.spill.evict(ahead)
        if groups.free_blocks() < num_blocks:
            raise PoolExhaustedError(
                f"pool {self.pool!r}: {num_blocks} blocks wanted, {groups.free_blocks()} "
                f"free after eviction (the rest is referenced or reserved); retry later"
            )
        rid, taken = self.leases.reserve(groups.allocate(num_blocks), lease)
        return Reservation(rid, self.pool, num_blocks, taken.expires_at_s)

    def abort(self, reservation_id: int) -> None:
        lease = self.leases.take_reservation(reservation_id)
        if lease is not None:
            self.release(lease)

    def take(self, reservation: Reservation | None, num_blocks: int) -> Lease | None:
        """Take over exactly ``num_blocks`` of a reservation's slots (the rest are returned);
        ``None`` when it expired or is too small."""
        if reservation is None or reservation.num_blocks < num_blocks:
            return None
        lease = self.leases.take_reservation(reservation.id)
        if lease is not None:
            self.release(Lease(lease.handles[num_blocks:], 0.0))
            lease.handles = lease.handles[:num_blocks]
        return lease

    def payload_rows(self, payloads: object, count: int) -> torch.Tensor:
        """``payloads`` as ``[count, block_bytes]`` uint8 rows, or a clear error."""
        block_bytes = self.groups.block_bytes
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
                f"payloads must be a uint8 array [blocks, {block_bytes}], got {got}"
            )
        if rows.dim() != 2 or rows.shape[0] != count or rows.shape[1] != block_bytes:
            raise PageShapeError(
                f"payloads must be [{count}, {block_bytes}] (one block per token key), "
                f"got {list(rows.shape)}"
            )
        return rows.contiguous()

    async def commit(
        self,
        reservation_id: int,
        namespace: str,
        token_keys: Sequence[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        """Write, seal, name and announce the reserved blocks; unused slots are returned."""
        self.reap()
        lease = self.leases.reservation(reservation_id)
        if lease is None:
            raise LeaseError(
                f"reservation {reservation_id} is unknown or expired (its slots were returned); "
                f"reserve again"
            )
        check_keys(namespace, token_keys)
        if len(token_keys) > len(lease.handles):
            raise PageShapeError(
                f"{len(token_keys)} blocks for a reservation of {len(lease.handles)}"
            )
        rows = self.payload_rows(payloads, len(token_keys))
        # Taken out only once the input is known good: a refused commit leaves the
        # reservation open, to be committed again or aborted.
        self.leases.take_reservation(reservation_id)
        stored = [
            self.groups.seal(namespace, key, lease.handles[i], rows[i])
            for i, key in enumerate(token_keys)
        ]
        self.release(Lease(lease.handles[len(token_keys) :], 0.0))
        await self.announce.stored(namespace, stored, Tier.MEMORY)
        if self.config.write_through:
            await self.spill.write_through(namespace, stored, rows)
        return stored

    async def store(
        self, namespace: str, token_keys: Sequence[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        """Reserve and commit in one call, the input checked before anything is reserved."""
        check_keys(namespace, token_keys)
        self.payload_rows(payloads, len(token_keys))
        res = await self.reserve(len(token_keys))
        try:
            return await self.commit(res.id, namespace, token_keys, payloads)
        except BaseException:
            self.abort(res.id)  # a reservation already taken is unknown here: nothing happens
            raise
