"""The fleet simulator's caches: each replica's own engine prefix cache, and each node's tier
pool and disk over the project's real directory shards and eviction order. Time is simulated
elsewhere (``_trace_sim.py``); here only residency changes, so what a hit finds is decided by
the same code the tier runs.

Units are trace blocks (``block_tokens`` tokens, one token key each); an engine or a pool
of finer blocks would hold each trace block as several, all or none, which changes no hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from _trace_input import TRACE_BLOCK_TOKENS

from tessera_ray.actors._eviction import eviction_plan
from tessera_ray.actors.directory import (
    DirectoryShard,
    LookupResult,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = ["NAMESPACE", "EngineCache", "SimDirectory", "NodeTier", "block_hash"]

NAMESPACE = "trace"


def block_hash(key: TokenKey) -> BlockHash:
    """The content hash a block of ``key`` would seal to: one block of content per prefix."""
    return BlockHash(int.from_bytes(key[:16], "big"))


class EngineCache:
    """One replica's own KV cache (vLLM's prefix cache), in trace blocks.

    Blocks of running requests are pinned; a block becomes a hit for later requests once its
    prefill is done (``ready``), and an unpinned block waits in LRU order to be evicted when a
    new request needs room. Tokens no later request can hit (a partial last block, the output)
    are counted as private. ``holders``, when given, is kept as key -> replicas holding the
    block ready (the KV events a cache-aware router indexes).
    """

    def __init__(
        self,
        capacity_tokens: int | None,
        replica: int = 0,
        holders: dict[TokenKey, set[int]] | None = None,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        self._cap = capacity_tokens
        self._block = block_tokens
        self._replica = replica
        self._holders = holders
        self._pins: dict[TokenKey, int] = {}
        self._ready: set[TokenKey] = set()
        self._lru: OrderedDict[TokenKey, None] = OrderedDict()  # unpinned, oldest first
        self._private = 0

    @property
    def used_tokens(self) -> int:
        return len(self._pins) * self._block + self._private

    def hit_run(self, keys: Sequence[TokenKey]) -> int:
        """Leading blocks of ``keys`` ready in this cache."""
        n = 0
        for k in keys:
            if k not in self._ready:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[TokenKey], private_tokens: int) -> bool:
        """Pin ``keys`` (allocating those not held) and reserve ``private_tokens``, evicting
        unpinned blocks as needed; ``False`` and nothing changed when it cannot fit."""
        new = [k for k in keys if k not in self._pins]
        if self._cap is not None:
            mine = sum(1 for k in keys if k in self._lru)
            room = self._cap - self.used_tokens + (len(self._lru) - mine) * self._block
            if len(new) * self._block + private_tokens > room:
                return False
        for k in keys:
            count = self._pins.get(k, 0)
            if count == 0:
                self._lru.pop(k, None)
            self._pins[k] = count + 1
        self._private += private_tokens
        if self._cap is not None:
            while self.used_tokens > self._cap:
                self._evict(next(iter(self._lru)))
        return True

    def ready(self, keys: Sequence[TokenKey]) -> None:
        for k in keys:
            if k in self._pins and k not in self._ready:
                self._ready.add(k)
                if self._holders is not None:
                    self._holders.setdefault(k, set()).add(self._replica)

    def release(self, keys: Sequence[TokenKey], private_tokens: int) -> None:
        for k in keys:
            count = self._pins[k] - 1
            self._pins[k] = count
            if count == 0:
                if k in self._ready:
                    self._lru[k] = None
                else:  # never computed here (its request's prefill was not this one's)
                    self._drop(k)
        self._private -= private_tokens

    def _evict(self, key: TokenKey) -> None:
        del self._lru[key]
        self._drop(key)

    def _drop(self, key: TokenKey) -> None:
        del self._pins[key]
        if key in self._ready:
            self._ready.discard(key)
            if self._holders is not None:
                held = self._holders[key]
                held.discard(self._replica)
                if not held:
                    del self._holders[key]


class SimDirectory:
    """The cluster directory in process: real :class:`DirectoryShard` objects, each call
    split by shard as the client's sharded lookup splits it."""

    def __init__(self, num_shards: int) -> None:
        self.shards = [DirectoryShard(i, num_shards) for i in range(num_shards)]
        self._n = num_shards

    def _split(self, keys: Sequence[TokenKey]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(shard_of(k, self._n), []).append(i)
        return groups

    def lookup(self, keys: Sequence[TokenKey]) -> list[LookupResult | None]:
        out: list[LookupResult | None] = [None] * len(keys)
        for s, idx in self._split(keys).items():
            answer = self.shards[s].lookup(NAMESPACE, [keys[i] for i in idx])
            for i, result in zip(idx, answer, strict=True):
                out[i] = result
        return out

    def register(self, pool: str, tier: Tier, slots: Sequence[tuple[TokenKey, int]]) -> None:
        regs: dict[int, list[Registration]] = {}
        for key, slot in slots:
            reg = Registration(NAMESPACE, key, block_hash(key), Replica(pool, tier, slot, 0))
            regs.setdefault(shard_of(key, self._n), []).append(reg)
        for s, batch in regs.items():
            self.shards[s].register(batch)

    def drop(self, pool: str, keys: Sequence[TokenKey], tier: Tier) -> None:
        for s, idx in self._split(keys).items():
            blocks = [(NAMESPACE, block_hash(keys[i])) for i in idx]
            self.shards[s].drop_replicas(pool, blocks, tier)


class NodeTier:
    """One node's tier pool (memory) and disk tier, in trace blocks, registered in the
    directory. Eviction takes a batch of the least recently used blocks and orders them with
    the pool's own :func:`eviction_plan`; what is not durable elsewhere spills to disk."""

    def __init__(
        self, pool: str, directory: SimDirectory, memory_blocks: int, disk_blocks: int
    ) -> None:
        self.pool = pool
        self._dir = directory
        self._mem_cap = memory_blocks
        self._disk_cap = disk_blocks
        self.memory: OrderedDict[TokenKey, int] = OrderedDict()  # key -> slot, oldest first
        self.disk: OrderedDict[TokenKey, int] = OrderedDict()
        self._next_slot = 0
        self.spilled_blocks = 0

    def _slot(self) -> int:
        self._next_slot += 1
        return self._next_slot

    def store(self, keys: Sequence[TokenKey]) -> None:
        """``keys`` land in this pool (computed here, or fetched into it); held ones are
        touched. Evicts past capacity."""
        if self._mem_cap == 0:
            return
        new: list[tuple[TokenKey, int]] = []
        for k in keys:
            if k in self.memory:
                self.memory.move_to_end(k)
            else:
                slot = self._slot()
                self.memory[k] = slot
                new.append((k, slot))
        self._dir.register(self.pool, Tier.MEMORY, new)
        if len(self.memory) > self._mem_cap:
            self._evict(len(self.memory) - self._mem_cap)

    def touch(self, keys: Sequence[TokenKey]) -> None:
        for k in keys:
            if k in self.memory:
                self.memory.move_to_end(k)

    def _evict(self, excess: int) -> None:
        # A batch past the excess, as a pool frees room ahead of need, so the plan runs once
        # per batch rather than once per block.
        batch = max(excess, self._mem_cap // 64, 1)
        candidates = list(islice(self.memory, 2 * batch))
        elsewhere = {
            k: [r for r in result.replicas if r.pool != self.pool]
            for k, result in zip(candidates, self._dir.lookup(candidates), strict=True)
            if result is not None
        }
        order, durable = eviction_plan(
            candidates, self.disk.keys(), elsewhere, has_disk=self._disk_cap > 0
        )
        gone = order[:batch]
        for k in gone:
            del self.memory[k]
        self._dir.drop(self.pool, gone, Tier.MEMORY)
        spill = [k for k in gone if k not in durable and k not in self.disk]
        if spill and self._disk_cap > 0:
            self.spilled_blocks += len(spill)
            slots = [(k, self._slot()) for k in spill]
            self.disk.update(slots)
            self._dir.register(self.pool, Tier.DISK, slots)
            if len(self.disk) > self._disk_cap:
                old = list(islice(self.disk, len(self.disk) - self._disk_cap))
                for k in old:
                    del self.disk[k]
                self._dir.drop(self.pool, old, Tier.DISK)
