"""How pools and clients reach the directory: :class:`DirectoryLink`, what a pool needs of it,
and its two implementations. :class:`ShardedDirectory` fans every call out over the shards
(one call per shard that owns any of the keys) through any :class:`ShardLink`: the pool actor
and the client both hand it the shard actors' typed handles, so the fan-out is written once,
here, for both. :class:`LocalDirectory` keeps in-process shards (tests, single-process use)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from tessera_ray.actors.directory import DirectoryShard, LookupResult, Registration, Tier, shard_of
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryUnavailableError
from tessera_ray.transport import PeerInfo

__all__ = [
    "DirectoryLink",
    "ShardLink",
    "ShardedDirectory",
    "LocalDirectory",
    "group_by_shard",
    "sharded_lookup",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class DirectoryLink(Protocol):
    """What a pool tells and asks the directory."""

    async def register(self, entries: Sequence[Registration]) -> None: ...

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None: ...

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]: ...


class ShardLink(Protocol):
    """One directory shard as a caller in another process reaches it
    (:class:`~tessera_ray.actors._ray_handles.ShardRef`). Every way of not reaching it raises
    :class:`~tessera_ray.errors.DirectoryUnavailableError`."""

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]: ...

    async def register(self, entries: Sequence[Registration]) -> None: ...

    async def drop_replicas(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None: ...

    async def purge_pool(self, pool: str) -> None: ...

    async def publish_peer(self, info: PeerInfo) -> None: ...

    async def peer(self, name: str) -> PeerInfo | None: ...


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


class ShardedDirectory:
    """The directory over its shards, each reached through a :class:`ShardLink`: a pool's
    :class:`DirectoryLink`, and the client's lookups and purges. A shard that is down is
    skipped (logged): it rebuilds from the pools' inventories when it is back, so nothing is
    lost; a lookup then misses its keys, or raises when ``strict``."""

    def __init__(self, shards: Sequence[ShardLink]) -> None:
        self.shards = list(shards)
        self.num_shards = len(self.shards)
        # Ray runs an async actor's calls in no guaranteed order, even from one caller: a drop
        # and a later register of the same replica could land reversed, leaving the directory
        # naming a copy the pool no longer has (or forgetting one it has). Each change waits
        # for the previous one to be applied.
        self._writes = asyncio.Lock()

    async def _call(self, i: int, answer: Awaitable[_T]) -> _T | None:
        """Shard ``i``'s ``answer``, or ``None`` (logged) when the shard is down."""
        try:
            return await answer
        except DirectoryUnavailableError as exc:
            log.warning("directory shard %d unavailable: %s", i, exc)
            return None

    async def _each(self, call: Callable[[ShardLink], Awaitable[None]]) -> None:
        """``call`` on every shard at once (a change every shard must see)."""
        await asyncio.gather(*(self._call(i, call(shard)) for i, shard in enumerate(self.shards)))

    async def register(self, entries: Sequence[Registration]) -> None:
        groups = group_by_shard([e.token_key for e in entries], self.num_shards)
        async with self._writes:
            await asyncio.gather(
                *(
                    self._call(s, self.shards[s].register([entries[i] for i in idx]))
                    for s, idx in groups.items()
                )
            )

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        async with self._writes:
            await self._each(lambda shard: shard.drop_replicas(pool, blocks, tier))

    async def purge(self, pool: str) -> None:
        """Forget every replica of ``pool``: a pool process that starts holds nothing, and a
        pool a client found unavailable is re-learned from its inventory if it answers again."""
        async with self._writes:
            await self._each(lambda shard: shard.purge_pool(pool))

    async def publish_peer(self, info: PeerInfo) -> None:
        """Every shard keeps every pool's transport data, so a reader finds it at any shard."""
        await self._each(lambda shard: shard.publish_peer(info))

    async def peer(self, name: str) -> PeerInfo | None:
        for i, shard in enumerate(self.shards):
            found = await self._call(i, shard.peer(name))
            if found is not None:
                return found
        return None

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey], *, strict: bool = False
    ) -> list[LookupResult | None]:
        """One call per shard owning any of ``token_keys``, all at once. A shard that is down
        answers misses, or raises :class:`DirectoryUnavailableError` when ``strict`` (for a
        caller that must tell "not held" from "not known", such as a request router)."""

        async def ask(s: int, keys: list[TokenKey]) -> list[LookupResult | None] | None:
            answer = self.shards[s].lookup(access, keys)
            return await answer if strict else await self._call(s, answer)

        return await sharded_lookup(token_keys, self.num_shards, ask)


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
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        async def ask(shard: int, keys: list[TokenKey]) -> Sequence[LookupResult | None]:
            return self.shards[shard].lookup(access, keys)

        return await sharded_lookup(token_keys, len(self.shards), ask)
