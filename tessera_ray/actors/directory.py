"""One shard of the cluster hash directory, as a plain class (the actor is a thin shell).

It maps ``(namespace, token key) -> block hash`` and ``(namespace, block hash) -> replicas``
(pool, tier, slot, generation). It never holds page bytes. Shards split the token-key space by
the key's first byte, and a shard keeps the replica lists of the blocks its keys name, so a
client's lookup costs one round trip per shard; replica changes are broadcast to every shard
in one batched call each.

Scoping by namespace is the tenant boundary: a lookup names its namespace, and a key registered
under another namespace is a miss even when the caller knows the key bytes. On a tier with a
tenant secret the lookup must present a credential for that namespace
(:mod:`~tessera_ray.actors.tenancy`); registrations come from the pools.

The index is soft state: a restarted shard starts empty (lookups miss, never err) and is
rebuilt from the pools' inventories (:meth:`DirectoryShard.rebuild_from`).

The tables are numpy columns with no Python object per entry
(:mod:`~tessera_ray.actors._directory_index`; layout and figures in docs/directory.md); every
write is checked whole before any of it is applied (:mod:`~tessera_ray.actors._directory_input`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from tessera_ray.actors._directory_index import FREE_NAMESPACE, FREE_POOL, DirectoryIndex, Found
from tessera_ray.actors._directory_input import (
    Batch,
    key_words,
    only_mine,
    registration_batch,
    split_hashes,
)
from tessera_ray.actors._directory_types import (
    Holder,
    LookupAnswer,
    LookupResult,
    Registration,
    Registrations,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.actors.tenancy import Access, TenantGate, check_batch
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryError

__all__ = [
    "Tier",
    "Replica",
    "Registration",
    "LookupResult",
    "Holder",
    "LookupAnswer",
    "Registrations",
    "DirectoryStats",
    "DirectoryShard",
    "shard_of",
]

_NONE = np.empty(0, np.int64)
_NOTHING = Found(
    positions=_NONE,
    hi=_NONE.astype(np.uint64),
    lo=_NONE.astype(np.uint64),
    counts=_NONE,
    pools=_NONE.astype(np.uint16),
    tiers=_NONE.astype(np.uint8),
    slots=_NONE.astype(np.uint32),
    generations=_NONE,
)
"""The columns of an answer with no hit."""


@dataclass(frozen=True, slots=True)
class DirectoryStats:
    shard: int
    token_keys: int
    blocks: int
    replicas: int
    pools: int
    lookups: int
    hits: int
    misses: int
    purged_pools: int
    started_at_s: float


class DirectoryShard:
    """Token keys and replicas of one shard. Every method is batched (one call per request)."""

    def __init__(self, shard: int = 0, num_shards: int = 1, gate: TenantGate | None = None) -> None:
        if not 0 <= shard < num_shards:
            raise DirectoryError(f"shard {shard} out of range for {num_shards} shards")
        self.gate = gate or TenantGate()
        self.shard = shard
        self.num_shards = num_shards
        # Namespaces and pools are interned to small ints, the ids the tables store.
        self._ns: dict[str, int] = {}
        self._pool_ids: dict[str, int] = {}
        self._pool_names: tuple[str, ...] = ()
        self._index = DirectoryIndex()
        self._lookups = self._hits = self._misses = self._purged = 0
        self._started = time.time()

    def table_bytes(self) -> dict[str, int]:
        """Bytes of the arrays of each table (what memory per entry is made of)."""
        return self._index.table_bytes()

    # ---------------------------------------------------------------- writes

    def register(self, entries: Sequence[Registration]) -> int:
        """Learn token keys and replicas; returns how many new replicas were recorded.

        A token key already naming a different block keeps its first block (a live key is
        never redirected); the replica is still recorded under its own block hash. One replica
        per (pool, tier) and block: a newer registration replaces its slot and generation in
        place. All entries are validated before any is applied.
        """
        check_batch(len(entries), "registrations")
        return self._apply(registration_batch(entries, self.shard, self.num_shards))

    def _apply(self, batch: Batch) -> int:
        n = len(batch.spaces)
        if not n:
            return 0
        # Interned in the order first named, so pools() lists pools as they were first seen.
        new_spaces = [s for s in dict.fromkeys(batch.spaces) if s not in self._ns]
        new_pools = [p for p in dict.fromkeys(batch.pools) if p not in self._pool_ids]
        if len(self._ns) + len(new_spaces) >= FREE_NAMESPACE:
            raise DirectoryError(f"more than {FREE_NAMESPACE - 1} namespaces on one shard")
        if len(self._pool_ids) + len(new_pools) >= FREE_POOL:
            raise DirectoryError(
                f"more than {FREE_POOL - 1} pools on one shard; purge pools that are gone"
            )
        for space in new_spaces:
            self._ns[space] = len(self._ns)
        for pool in new_pools:
            self._pool_ids[pool] = len(self._pool_ids)
        if new_pools:
            self._pool_names = (*self._pool_names, *new_pools)
        return self._index.register(
            np.fromiter(map(self._ns.__getitem__, batch.spaces), np.uint64, n),
            batch.words,
            batch.hi,
            batch.lo,
            np.fromiter(map(self._pool_ids.__getitem__, batch.pools), np.uint16, n),
            batch.tiers,
            batch.slots,
            batch.generations,
        )

    def drop_replicas(
        self, pool: str, blocks: Iterable[tuple[str, BlockHash]], tier: Tier | None = None
    ) -> int:
        """Forget ``pool``'s replicas (in ``tier``, or every tier) of the given blocks."""
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        named = list(blocks)
        if not named or (tier is not None and tier not in (Tier.MEMORY, Tier.DISK)):
            return 0
        spaces, hashes = zip(*named, strict=True)
        ns = np.fromiter(map(self._ns.get, spaces, repeat(-1)), np.int64, len(named))
        hi, lo, valid = split_hashes(hashes)
        known = np.flatnonzero(valid & (ns >= 0))
        return self._index.drop(
            ns[known].astype(np.uint64),
            hi[known],
            lo[known],
            pid,
            None if tier is None else int(tier),
        )

    def purge_pool(self, pool: str) -> int:
        """A pool died: forget every replica on it. Returns how many were dropped."""
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        self._purged += 1
        return self._index.purge(pid)

    def rebuild_from(self, inventory: Iterable[Registration]) -> int:
        """Re-learn what a pool holds (after a restart of this shard); keys of other shards in
        the inventory are skipped, so every pool can send one inventory to every shard.

        An inventory is a pool's whole content, not a request: it is not held to the batch
        limit of :meth:`register`, and it is still checked whole before any of it is applied."""
        entries = list(inventory)
        if self.num_shards > 1:
            entries = only_mine(entries, self.shard, self.num_shards)
        return self._apply(registration_batch(entries, self.shard, self.num_shards))

    # ---------------------------------------------------------------- reads

    def lookup(self, access: Access, token_keys: Sequence[TokenKey]) -> LookupAnswer:
        """For each key: its block and live replicas, or ``None`` (a miss). Keys whose block
        has no replica left are forgotten on the way. Every key is checked before any counts."""
        ns = self._ns.get(self.gate.resolve(access, write=False))
        check_batch(len(token_keys))
        words = key_words(token_keys, self.shard, self.num_shards)
        keys = list(token_keys)
        found = _NOTHING if ns is None or not keys else self._index.lookup(ns, words)
        hits = len(found.positions)
        self._lookups += len(keys)
        self._hits += hits
        self._misses += len(keys) - hits
        return LookupAnswer(keys, found, self._pool_names)

    def pools(self) -> list[str]:
        return list(self._pool_names)

    def stats(self) -> DirectoryStats:
        return DirectoryStats(
            shard=self.shard,
            token_keys=self._index.token_keys,
            blocks=self._index.live_blocks,
            replicas=self._index.replicas,
            pools=len(self._pool_names),
            lookups=self._lookups,
            hits=self._hits,
            misses=self._misses,
            purged_pools=self._purged,
            started_at_s=self._started,
        )
