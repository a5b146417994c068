"""The directory shard as it was first written, on Python dicts: the reference model the
compact shard (:class:`~tessera_ray.actors.directory.DirectoryShard`) is checked against in
``tests/actors/test_directory_model.py``. Plain and slow on purpose: each rule reads as the
semantics it defines. No tenancy gate (the state machine names namespaces as plain strings)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tessera_ray.actors.directory import (
    LookupResult,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.actors.tenancy import check_batch
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryError

__all__ = ["DictShard", "ModelStats"]

ModelStats = tuple[int, int, int, int, int, int, int, int]
"""token_keys, blocks, replicas, pools, lookups, hits, misses, purged_pools."""

# A replica as stored: (pool id, tier, slot, generation).
_Rep = tuple[int, int, int, int]


class DictShard:
    """Token keys and replicas of one shard, in dicts of tuples."""

    def __init__(self, shard: int = 0, num_shards: int = 1) -> None:
        self.shard = shard
        self.num_shards = num_shards
        self._ns: dict[str, int] = {}
        self._pool_ids: dict[str, int] = {}
        self._pool_names: list[str] = []
        # (ns id, token key) -> (block hash, the block's epoch when the key was named)
        self._keys: dict[tuple[int, bytes], tuple[int, int]] = {}
        self._blocks: dict[tuple[int, int], list[_Rep]] = {}  # (ns id, block hash) -> replicas
        # (ns id, block hash) -> times the block lost its last replica: keys named before are dead
        self._epochs: dict[tuple[int, int], int] = {}
        self._lookups = self._hits = self._misses = self._purged = 0

    def _pool_id(self, pool: str) -> int:
        if pool not in self._pool_ids:
            self._pool_ids[pool] = len(self._pool_names)
            self._pool_names.append(pool)
        return self._pool_ids[pool]

    def _check_key(self, token_key: bytes) -> None:
        if not isinstance(token_key, bytes) or len(token_key) != 32:
            raise DirectoryError(f"a token key is 32 bytes, got {token_key!r:.40}")
        if shard_of(token_key, self.num_shards) != self.shard:
            raise DirectoryError(
                f"token key {token_key[:4].hex()}... belongs to shard "
                f"{shard_of(token_key, self.num_shards)}, not {self.shard}"
            )

    def register(self, entries: Sequence[Registration], *, limit: bool = True) -> int:
        if limit:
            check_batch(len(entries), "registrations")
        for e in entries:
            self._check_key(e.token_key)
            if not isinstance(e.namespace, str) or not e.namespace:
                raise DirectoryError(f"namespace must be a non-empty str, got {e.namespace!r}")
            r = e.replica
            if (
                not isinstance(r, Replica)
                or r.slot < 0
                or not isinstance(r.pool, str)
                or not r.pool
            ):
                raise DirectoryError(f"bad replica {r!r}: needs a pool name and a slot >= 0")
        added = 0
        for e in entries:
            ns = self._ns.setdefault(e.namespace, len(self._ns))
            named = self._keys.get((ns, e.token_key))
            if named is None or named[1] != self._epochs.get((ns, named[0]), 0):
                epoch = self._epochs.get((ns, e.block_hash), 0)
                self._keys[(ns, e.token_key)] = (e.block_hash, epoch)
            r = e.replica
            rep = (self._pool_id(r.pool), int(r.tier), r.slot, r.generation)
            reps = self._blocks.setdefault((ns, e.block_hash), [])
            # One replica per (pool, tier): a newer registration replaces an older slot.
            for i, old in enumerate(reps):
                if old[:2] == rep[:2]:
                    reps[i] = rep
                    break
            else:
                reps.append(rep)
                added += 1
        return added

    def drop_replicas(
        self, pool: str, blocks: Iterable[tuple[str, BlockHash]], tier: Tier | None = None
    ) -> int:
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        dropped = 0
        for namespace, bh in blocks:
            ns = self._ns.get(namespace)
            reps = self._blocks.get((ns, bh)) if ns is not None else None
            if not reps:
                continue
            keep = [r for r in reps if not (r[0] == pid and (tier is None or r[1] == tier))]
            dropped += len(reps) - len(keep)
            if keep:
                self._blocks[(ns, bh)] = keep  # type: ignore[index]
            else:
                self._died((ns, bh))  # type: ignore[arg-type]
        return dropped

    def _died(self, block: tuple[int, int]) -> None:
        del self._blocks[block]
        self._epochs[block] = self._epochs.get(block, 0) + 1

    def purge_pool(self, pool: str) -> int:
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        dropped = 0
        for key in list(self._blocks):
            reps = self._blocks[key]
            keep = [r for r in reps if r[0] != pid]
            dropped += len(reps) - len(keep)
            if not keep:
                self._died(key)
            elif len(keep) != len(reps):
                self._blocks[key] = keep
        self._purged += 1
        return dropped

    def rebuild_from(self, inventory: Iterable[Registration]) -> int:
        """An inventory is a pool's whole content, not held to the batch limit."""
        mine = [e for e in inventory if shard_of(e.token_key, self.num_shards) == self.shard]
        return self.register(mine, limit=False)

    def lookup(self, namespace: str, token_keys: Sequence[TokenKey]) -> list[LookupResult | None]:
        ns = self._ns.get(namespace)
        check_batch(len(token_keys))
        for key in token_keys:
            self._check_key(key)
        out: list[LookupResult | None] = []
        for key in token_keys:
            self._lookups += 1
            result = None if ns is None else self._resolve(ns, key)
            if result is None:
                self._misses += 1
            else:
                self._hits += 1
            out.append(result)
        return out

    def _resolve(self, ns: int, key: TokenKey) -> LookupResult | None:
        named = self._keys.get((ns, key))
        if named is None:
            return None
        bh, epoch = named
        reps = self._blocks.get((ns, bh))
        if not reps or epoch != self._epochs.get((ns, bh), 0):
            del self._keys[(ns, key)]
            return None
        return LookupResult(
            key,
            BlockHash(bh),
            tuple(Replica(self._pool_names[p], Tier(t), s, g) for p, t, s, g in reps),
        )

    def pools(self) -> list[str]:
        return list(self._pool_names)

    def stats(self) -> ModelStats:
        return (
            len(self._keys),
            len(self._blocks),
            sum(len(r) for r in self._blocks.values()),
            len(self._pool_names),
            self._lookups,
            self._hits,
            self._misses,
            self._purged,
        )
