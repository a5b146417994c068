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
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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


class Tier(enum.IntEnum):
    """Where a replica lives inside its pool."""

    MEMORY = 0
    DISK = 1


class Replica(NamedTuple):
    """One copy of a block: on pool ``pool``, in ``tier``, at pool-local ``slot``.

    ``Replica``, ``Registration`` and ``LookupResult`` are named tuples, as the pool's
    ``SealResult``: a fetch builds one per block on the far side of a pickle, and a frozen
    dataclass costs several times more to build.

    ``generation`` is the pool's generation of that slot when the replica was registered; the
    pool rejects a pin whose generation is stale, so a reused slot never answers for old data.
    """

    pool: str
    tier: Tier
    slot: int
    generation: int


class Registration(NamedTuple):
    """``token_key`` (under ``namespace``) names block ``block_hash``, held by ``replica``."""

    namespace: str
    token_key: TokenKey
    block_hash: BlockHash
    replica: Replica


class LookupResult(NamedTuple):
    """A hit: the block a token key names and every live replica of it."""

    token_key: TokenKey
    block_hash: BlockHash
    replicas: tuple[Replica, ...]


class Holder(NamedTuple):
    """A replica as a reader pulls from it: pool ``pool`` holds the block in ``tier`` (the
    slot is the pool's own business). What a lookup's answer says per block when it travels on
    to whoever reads, so that the reader does not ask the directory again."""

    pool: str
    tier: Tier

    @staticmethod
    def of(result: LookupResult) -> tuple[Holder, ...]:
        return tuple(Holder(r.pool, r.tier) for r in result.replicas)


_TIERS = tuple(sorted(Tier))
"""``Tier`` by value (0, 1, ...), indexed: cheaper than calling ``Tier(value)`` per replica."""
assert all(t == i for i, t in enumerate(_TIERS)), "Tier values must be 0, 1, ... to index"


def _interned(names: dict[str, int], name: str) -> int:
    i = names.get(name)
    if i is None:
        i = names[name] = len(names)
    return i


class LookupAnswer(list[LookupResult | None]):
    """A shard's answer to one lookup: a list of :class:`LookupResult` or ``None``, aligned
    with the keys, that pickles as a few flat columns.

    Why: pickling frozen slotted dataclasses runs Python code per object (the dataclass
    ``__getstate__``, and Ray's pickler looks at each object), an order of magnitude more than
    the same fields as tuples of ints and bytes (docs/measured-choices.md). A lookup answer
    crosses a process boundary on every fetch. It unpickles as a plain ``list``; in-process it
    is one already.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        hits = [i for i, r in enumerate(self) if r is not None]
        found = [r for r in self if r is not None]
        reps = [rep for r in found for rep in r.replicas]
        pools: dict[str, int] = {}
        return _lookup_answer, (
            len(self),
            hits,
            [r.token_key for r in found],
            [r.block_hash for r in found],
            [len(r.replicas) for r in found],
            [_interned(pools, rep.pool) for rep in reps],
            list(pools),
            [int(rep.tier) for rep in reps],
            [rep.slot for rep in reps],
            [rep.generation for rep in reps],
        )


def _lookup_answer(
    n: int,
    hits: list[int],
    keys: list[TokenKey],
    hashes: list[BlockHash],
    counts: list[int],
    rep_pools: list[int],
    pools: list[str],
    tiers: list[int],
    slots: list[int],
    gens: list[int],
) -> list[LookupResult | None]:
    """The list a pickled :class:`LookupAnswer` stood for."""
    reps = [
        Replica(pools[p], _TIERS[t], slot, gen)
        for p, t, slot, gen in zip(rep_pools, tiers, slots, gens, strict=True)
    ]
    out: list[LookupResult | None] = [None] * n
    at = 0
    for i, key, bh, count in zip(hits, keys, hashes, counts, strict=True):
        out[i] = LookupResult(key, bh, tuple(reps[at : at + count]))
        at += count
    return out


class Registrations(list[Registration]):
    """A batch of :class:`Registration` that pickles as flat columns (why: see
    :class:`LookupAnswer`; a fetch of 512 blocks registers 512). Unpickles as a plain list."""

    __slots__ = ()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        spaces: dict[str, int] = {}
        pools: dict[str, int] = {}
        ns = [_interned(spaces, e.namespace) for e in self]
        rep_pools = [_interned(pools, e.replica.pool) for e in self]
        return _registrations, (
            list(spaces),
            ns,
            [e.token_key for e in self],
            [e.block_hash for e in self],
            list(pools),
            rep_pools,
            [int(e.replica.tier) for e in self],
            [e.replica.slot for e in self],
            [e.replica.generation for e in self],
        )


def _registrations(
    spaces: list[str],
    ns: list[int],
    keys: list[TokenKey],
    hashes: list[BlockHash],
    pools: list[str],
    rep_pools: list[int],
    tiers: list[int],
    slots: list[int],
    gens: list[int],
) -> list[Registration]:
    """The list a pickled :class:`Registrations` stood for."""
    return [
        Registration(spaces[n], key, bh, Replica(pools[p], _TIERS[t], slot, gen))
        for n, key, bh, p, t, slot, gen in zip(
            ns, keys, hashes, rep_pools, tiers, slots, gens, strict=True
        )
    ]


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


def shard_of(token_key: bytes, num_shards: int) -> int:
    """The shard owning ``token_key``: keys are sha256 output, so the first bytes are uniform."""
    return int.from_bytes(token_key[:4], "big") % num_shards


# Compact replica record inside the index: (pool id, tier, slot, generation). Pool names are
# interned to small ints so 10^6 entries cost tuples of small ints, not strings.
_Rep = tuple[int, int, int, int]


class DirectoryShard:
    """Token keys and replicas of one shard. Every method is batched (one call per request)."""

    def __init__(self, shard: int = 0, num_shards: int = 1, gate: TenantGate | None = None) -> None:
        if not 0 <= shard < num_shards:
            raise DirectoryError(f"shard {shard} out of range for {num_shards} shards")
        self.gate = gate or TenantGate()
        self.shard = shard
        self.num_shards = num_shards
        self._ns: dict[str, int] = {}
        self._pool_ids: dict[str, int] = {}
        self._pool_names: list[str] = []
        # (ns id, token key) -> block hash
        self._keys: dict[tuple[int, bytes], int] = {}
        # (ns id, block hash) -> replicas
        self._blocks: dict[tuple[int, int], list[_Rep]] = {}
        self._lookups = self._hits = self._misses = self._purged = 0
        self._started = time.time()

    # ---------------------------------------------------------------- interning

    def _ns_id(self, namespace: str, *, create: bool) -> int | None:
        ns = self._ns.get(namespace)
        if ns is None and create:
            if not isinstance(namespace, str) or not namespace:
                raise DirectoryError(f"namespace must be a non-empty str, got {namespace!r}")
            ns = self._ns[namespace] = len(self._ns)
        return ns

    def _pool_id(self, pool: str) -> int:
        pid = self._pool_ids.get(pool)
        if pid is None:
            if not isinstance(pool, str) or not pool:
                raise DirectoryError(f"pool name must be a non-empty str, got {pool!r}")
            pid = self._pool_ids[pool] = len(self._pool_names)
            self._pool_names.append(pool)
        return pid

    def _replica(self, rep: _Rep) -> Replica:
        return Replica(self._pool_names[rep[0]], _TIERS[rep[1]], rep[2], rep[3])

    def _check_key(self, token_key: bytes) -> None:
        if not isinstance(token_key, bytes) or len(token_key) != 32:
            raise DirectoryError(f"a token key is 32 bytes, got {token_key!r:.40}")
        if shard_of(token_key, self.num_shards) != self.shard:
            raise DirectoryError(
                f"token key {token_key[:4].hex()}... belongs to shard "
                f"{shard_of(token_key, self.num_shards)}, not {self.shard}"
            )

    # ---------------------------------------------------------------- writes

    def register(self, entries: Sequence[Registration]) -> int:
        """Learn token keys and replicas; returns how many new replicas were recorded.

        A token key already naming a different block keeps its first block (a live key is
        never redirected); the replica is still recorded under its own block hash.
        All entries are validated before any is applied.
        """
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
            ns = self._ns_id(e.namespace, create=True)
            assert ns is not None
            self._keys.setdefault((ns, e.token_key), e.block_hash)
            r = e.replica
            rep = (self._pool_id(r.pool), int(r.tier), r.slot, r.generation)
            reps = self._blocks.setdefault((ns, e.block_hash), [])
            # One replica per (pool, tier): a newer registration replaces an older slot.
            for i, old in enumerate(reps):
                if old[0] == rep[0] and old[1] == rep[1]:
                    if old != rep:
                        reps[i] = rep
                    break
            else:
                reps.append(rep)
                added += 1
        return added

    def drop_replicas(
        self, pool: str, blocks: Iterable[tuple[str, BlockHash]], tier: Tier | None = None
    ) -> int:
        """Forget ``pool``'s replicas (in ``tier``, or every tier) of the given blocks."""
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        dropped = 0
        for namespace, bh in blocks:
            ns = self._ns.get(namespace)
            if ns is None:
                continue
            reps = self._blocks.get((ns, bh))
            if not reps:
                continue
            keep = [r for r in reps if not (r[0] == pid and (tier is None or r[1] == tier))]
            dropped += len(reps) - len(keep)
            if keep:
                self._blocks[(ns, bh)] = keep
            else:
                del self._blocks[(ns, bh)]
        return dropped

    def purge_pool(self, pool: str) -> int:
        """A pool died: forget every replica on it. Returns how many were dropped."""
        pid = self._pool_ids.get(pool)
        if pid is None:
            return 0
        dropped = 0
        for key in list(self._blocks):
            reps = self._blocks[key]
            keep = [r for r in reps if r[0] != pid]
            if len(keep) != len(reps):
                dropped += len(reps) - len(keep)
                if keep:
                    self._blocks[key] = keep
                else:
                    del self._blocks[key]
        self._purged += 1
        return dropped

    def rebuild_from(self, inventory: Iterable[Registration]) -> int:
        """Re-learn what a pool holds (after a restart of this shard); keys of other shards in
        the inventory are skipped, so every pool can send one inventory to every shard."""
        mine = [e for e in inventory if shard_of(e.token_key, self.num_shards) == self.shard]
        return self.register(mine)

    # ---------------------------------------------------------------- reads

    def lookup(self, access: Access, token_keys: Sequence[TokenKey]) -> LookupAnswer:
        """For each key: its block and live replicas, or ``None`` (a miss). Keys whose block
        has no replica left are forgotten on the way. Every key is checked before any counts."""
        ns = self._ns.get(self.gate.resolve(access, write=False))
        check_batch(len(token_keys))
        for key in token_keys:
            self._check_key(key)
        out = LookupAnswer()
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
        bh = self._keys.get((ns, key))
        if bh is None:
            return None
        reps = self._blocks.get((ns, bh))
        if not reps:
            del self._keys[(ns, key)]
            return None
        return LookupResult(key, BlockHash(bh), tuple(self._replica(r) for r in reps))

    def pools(self) -> list[str]:
        return list(self._pool_names)

    def stats(self) -> DirectoryStats:
        return DirectoryStats(
            shard=self.shard,
            token_keys=len(self._keys),
            blocks=len(self._blocks),
            replicas=sum(len(r) for r in self._blocks.values()),
            pools=len(self._pool_names),
            lookups=self._lookups,
            hits=self._hits,
            misses=self._misses,
            purged_pools=self._purged,
            started_at_s=self._started,
        )
