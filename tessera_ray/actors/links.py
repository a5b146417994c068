"""How a pool talks to the directory, as a protocol: the Ray shell passes an implementation
that calls the shard actors; tests and single-process use pass :class:`LocalDirectory`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tessera_ray.actors.directory import DirectoryShard, LookupResult, Registration, Tier, shard_of
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = ["DirectoryLink", "LocalDirectory", "group_by_shard"]


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
        out: list[LookupResult | None] = [None] * len(token_keys)
        for shard, idx in group_by_shard(token_keys, len(self.shards)).items():
            for i, r in zip(
                idx, self.shards[shard].lookup(namespace, [token_keys[i] for i in idx]), strict=True
            ):
                out[i] = r
        return out
