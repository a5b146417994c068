"""How a pool talks to the directory, as a protocol: the Ray shell passes an implementation
that calls the shard actors; tests and single-process use pass :class:`LocalDirectory`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from tessera_ray.actors.directory import DirectoryShard, LookupResult, Registration, Tier, shard_of
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = ["DirectoryLink", "LocalDirectory", "group_by_shard", "sharded_lookup"]


class DirectoryLink(Protocol):
    async def register(self, entries: Sequence[Registration]) -> None: ...

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None: ...

    async def lookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]: ...


def group_by_shard(token_keys: Sequence[bytes], num_shards: int) -> dict[int, list[int]]:
    """Positions of ``token_keys`` per owning shard, so a request costs one call per shard."""
    out: dict[int, list[int]] = {}
    for i, key in enumerate(token_keys):
        out.setdefault(shard_of(key, num_shards), []).append(i)
    return out


async def sharded_lookup(
    token_keys: Sequence[TokenKey],
    num_shards: int,
    ask: Callable[[int, list[TokenKey]], Awaitable[Sequence[LookupResult | None] | None]],
) -> list[LookupResult | None]:
    """Answers aligned with ``token_keys``: ``ask(shard, its keys)`` once per shard that owns any,
    all at once; a shard answering ``None`` (unavailable) leaves its keys as misses."""
    out: list[LookupResult | None] = [None] * len(token_keys)
    groups = group_by_shard(token_keys, num_shards)
    answers = await asyncio.gather(
        *(ask(s, [token_keys[i] for i in idx]) for s, idx in groups.items())
    )
    for idx, answer in zip(groups.values(), answers, strict=True):
        if answer is not None:
            for i, r in zip(idx, answer, strict=True):
                out[i] = r
    return out


class LocalDirectory:
    """In-process shards behind the :class:`DirectoryLink` protocol."""

    def __init__(self, num_shards: int = 1, gate: TenantGate | None = None) -> None:
        self.shards = [DirectoryShard(i, num_shards, gate) for i in range(num_shards)]

    async def register(self, entries: Sequence[Registration]) -> None:
        for shard, idx in group_by_shard([e.token_key for e in entries], len(self.shards)).items():
            self.shards[shard].register([entries[i] for i in idx])

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        for shard in self.shards:
            shard.drop_replicas(pool, blocks, tier)

    async def lookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        async def ask(shard: int, keys: list[TokenKey]) -> list[LookupResult | None]:
            return self.shards[shard].lookup(namespace, keys)

        return await sharded_lookup(token_keys, len(self.shards), ask)
