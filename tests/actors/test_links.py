"""ShardedDirectory, the one fan-out over directory shards that pools and the client share: one
call per shard that owns a key, a shard that is down skipped (its keys miss, or a strict
lookup raises), every shard told of a purge. In-process shards stand in for the actors."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

import pytest

from tessera_ray.actors.directory import (
    DirectoryShard,
    LookupResult,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.actors.links import ShardedDirectory
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryUnavailableError
from tessera_ray.transport import PeerInfo

NUM_SHARDS = 3


def key(i: int) -> TokenKey:
    return TokenKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


class Shard:
    """A :class:`ShardLink` over an in-process shard that can be taken down."""

    def __init__(self, index: int) -> None:
        self.shard = DirectoryShard(index, NUM_SHARDS)
        self.down = False
        self.calls: list[str] = []
        self.peers: dict[str, PeerInfo] = {}

    def _reach(self, what: str) -> None:
        self.calls.append(what)
        if self.down:
            raise DirectoryUnavailableError(f"directory shard {self.shard.shard} is down")

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        self._reach("lookup")
        return self.shard.lookup(access, token_keys)

    async def register(self, entries: Sequence[Registration]) -> None:
        self._reach("register")
        self.shard.register(entries)

    async def drop_replicas(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        self._reach("drop_replicas")
        self.shard.drop_replicas(pool, blocks, tier)

    async def purge_pool(self, pool: str) -> None:
        self._reach("purge_pool")
        self.shard.purge_pool(pool)

    async def publish_peer(self, info: PeerInfo) -> None:
        self._reach("publish_peer")
        self.peers[info.name] = info

    async def peer(self, name: str) -> PeerInfo | None:
        self._reach("peer")
        return self.peers.get(name)


def _tier(n: int = 24) -> tuple[ShardedDirectory, list[Shard], list[TokenKey]]:
    shards = [Shard(i) for i in range(NUM_SHARDS)]
    directory = ShardedDirectory(shards)
    keys = [key(i) for i in range(n)]
    entries = [
        Registration("ns", k, BlockHash(i + 1), Replica("p0", Tier.MEMORY, i, 0))
        for i, k in enumerate(keys)
    ]
    asyncio.run(directory.register(entries))
    return directory, shards, keys


def test_each_call_reaches_only_the_shards_owning_its_keys() -> None:
    directory, shards, keys = _tier()
    assert all(s.calls == ["register"] for s in shards)  # one batch per shard
    found = asyncio.run(directory.lookup("ns", keys))
    assert [r.block_hash if r else None for r in found] == list(range(1, len(keys) + 1))
    owner = shard_of(keys[0], NUM_SHARDS)
    for s in shards:
        s.calls.clear()
    asyncio.run(directory.lookup("ns", keys[:1]))
    assert [len(s.calls) for s in shards] == [int(i == owner) for i in range(NUM_SHARDS)]


def test_a_shard_down_answers_misses_or_raises_when_strict() -> None:
    directory, shards, keys = _tier()
    down = shard_of(keys[0], NUM_SHARDS)
    shards[down].down = True
    found = asyncio.run(directory.lookup("ns", keys))
    for k, r in zip(keys, found, strict=True):
        assert (r is None) == (shard_of(k, NUM_SHARDS) == down)
    with pytest.raises(DirectoryUnavailableError, match=f"shard {down}"):
        asyncio.run(directory.lookup("ns", keys, strict=True))


def test_a_purge_reaches_every_shard_that_is_up() -> None:
    directory, shards, keys = _tier()
    shards[1].down = True
    asyncio.run(directory.purge("p0"))  # the shard that is down is skipped, not an error
    assert all(s.calls[-1] == "purge_pool" for s in shards)
    shards[1].down = False
    found = asyncio.run(directory.lookup("ns", keys))
    assert {shard_of(k, NUM_SHARDS) for k, r in zip(keys, found, strict=True) if r} == {1}


def test_a_peer_is_found_at_any_shard_up() -> None:
    directory, shards, _ = _tier()
    info = PeerInfo(kind="nixl", name="p0", fingerprint="f", regions=())
    shards[0].down = True
    asyncio.run(directory.publish_peer(info))
    assert asyncio.run(directory.peer("p0")) == info
    assert asyncio.run(directory.peer("p9")) is None
