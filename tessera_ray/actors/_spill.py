"""What a pool does with the disk tier and the directory when blocks leave memory: the
eviction (the choice is :func:`~tessera_ray.actors._eviction.eviction_plan`'s), spills,
write-through, reading blocks back, and the announcements that keep the directory true."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

from tessera_ray.actors._announcer import Announcer
from tessera_ray.actors._eviction import eviction_plan
from tessera_ray.actors._groups import Key, LayerGroups
from tessera_ray.actors.directory import Replica
from tessera_ray.actors.disk_blocks import DiskBlocks
from tessera_ray.actors.messages import BlockRef, EvictionReport, StoredBlock
from tessera_ray.actors.tenancy import TenantGate
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = ["Spiller"]

_NOTHING: Mapping[Key, BlockHash] = MappingProxyType({})


class Spiller:
    """Blocks between a pool's memory and its disk tier (``disk`` ``None``: no disk tier)."""

    def __init__(
        self,
        groups: LayerGroups,
        disk: DiskBlocks | None,
        announce: Announcer,
        gate: TenantGate,
    ) -> None:
        self.groups = groups
        self.disk = disk
        self.announce = announce
        self.gate = gate
        self.spills = self.lost = 0

    @property
    def on_disk(self) -> Mapping[Key, BlockHash]:
        """The blocks the disk tier holds (as far as this process knows)."""
        return self.disk.held if self.disk is not None else _NOTHING

    async def evict(self, num_blocks: int) -> EvictionReport:
        """Evict unreferenced blocks until ``num_blocks`` blocks' room is free (or no candidate
        is left), least recently used first, preferring blocks another pool also holds. Room,
        not keys, is counted: keys naming the same bytes leave together and free one block's
        room, and a block sharing a layer group's pages frees none of them there. A block
        leaves memory without a disk write only when a durable copy exists (on this pool's
        disk tier, or a disk replica elsewhere); otherwise it is spilled to this pool's disk
        tier.

        Why a copy in another pool's *memory* is not enough: that pool may be evicting its copy
        at the same moment, trusting this one (the directory cannot say who goes first), and
        the block would vanish from both. The load test found exactly that. Without a disk tier
        such blocks are dropped (and the loss is the cache's, as for any last copy).
        """
        # Only the least recently used few are considered (and asked about in one directory
        # call per namespace), not the whole pool: eviction cost stays bounded by the request.
        candidates = self.groups.oldest(max(4 * num_blocks, 64))
        order, durable = eviction_plan(
            candidates,
            self.on_disk,
            await self._replicas_elsewhere(candidates),
            has_disk=self.disk is not None,
        )
        dropped: list[BlockRef] = []
        spill: dict[str, list[tuple[TokenKey, BlockHash, bytes]]] = {}
        lost: list[BlockRef] = []
        room = self.groups.free_blocks() + num_blocks
        for ns, key in order:
            if self.groups.free_blocks() >= room:
                break
            for out in self.groups.take_out(ns, TokenKey(key)) or ():
                ref = BlockRef(ns, out.key, out.block_hash)
                if (ns, bytes(out.key)) in durable:
                    dropped.append(ref)
                elif out.payload is None:  # a block missing from a layer group: nothing to keep
                    lost.append(ref)
                else:
                    spill.setdefault(ns, []).append((out.key, out.block_hash, out.payload))
        spilled: list[BlockRef] = []
        for ns, items in spill.items():
            refs = [BlockRef(ns, k, bh) for k, bh, _ in items]
            if self.disk is None:
                lost.extend(refs)
                continue
            await self.disk.put(ns, items)
            spilled.extend(refs)
        self.spills += len(spilled)
        self.lost += len(lost)
        # The disk replicas are announced before the memory ones are withdrawn, so a lookup
        # in between finds the block somewhere (a key with no replica is forgotten).
        await self.announce.on_disk(spilled)
        await self.announce.gone_from_memory(
            list(dict.fromkeys((r.namespace, r.block_hash) for r in (*dropped, *spilled, *lost)))
        )
        return EvictionReport(tuple(dropped), tuple(spilled), tuple(lost))

    async def _replicas_elsewhere(self, keys: Sequence[Key]) -> dict[Key, list[Replica]]:
        """Per block, the replicas the directory knows on other pools (one lookup per
        namespace)."""
        out: dict[Key, list[Replica]] = {}
        directory = self.announce.directory
        if directory is None or not keys:
            return out
        by_ns: dict[str, list[Key]] = {}
        for k in keys:
            by_ns.setdefault(k[0], []).append(k)
        for ns, in_ns in by_ns.items():
            results = await directory.lookup(
                self.gate.for_pool(ns), [TokenKey(k[1]) for k in in_ns]
            )
            for k, r in zip(in_ns, results, strict=True):
                pool = self.announce.pool
                out[k] = [rep for rep in (r.replicas if r else ()) if rep.pool != pool]
        return out

    async def write_through(
        self, namespace: str, stored: Sequence[StoredBlock], rows: torch.Tensor
    ) -> None:
        """Put every newly named block on disk before the store is acknowledged: a pool that
        dies then loses no stored block (its restart reopens the disk tier)."""
        if self.disk is None:
            return
        items = [
            (s.token_key, s.block_hash, rows[i].numpy().tobytes())
            for i, s in enumerate(stored)
            if s.registered and (namespace, s.token_key) not in self.on_disk
        ]
        if items:
            await self.disk.put(namespace, items)
            await self.announce.on_disk([BlockRef(namespace, k, bh) for k, bh, _ in items])

    async def read_back(
        self, namespace: str, token_keys: Sequence[TokenKey]
    ) -> tuple[list[TokenKey], np.ndarray | None]:
        """The verified payloads of those of ``token_keys`` on disk, as ``(keys, rows)``."""
        wanted = [k for k in token_keys if (namespace, k) in self.on_disk]
        if not wanted or self.disk is None:
            return [], None
        found = await self.disk.get(namespace, wanted)
        keys = [k for k, f in zip(wanted, found, strict=True) if f is not None]
        if not keys:
            return [], None
        rows = np.stack([np.frombuffer(f[1], dtype=np.uint8) for f in found if f is not None])
        return keys, rows

    async def reopen(self) -> int:
        """After a restart: learn the disk tier's blocks again and announce them."""
        if self.disk is None:
            return 0
        blocks = await self.disk.reopen()
        await self.announce.on_disk(
            [BlockRef(b.namespace, b.token_key, b.block_hash) for b in blocks]
        )
        return len(blocks)
