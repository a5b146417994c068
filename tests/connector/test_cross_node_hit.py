"""A cross-node tier hit through the connector asks for what it needs once: the scheduler's
lookup names each block's holders, the plan carries them to the worker, and the worker pulls
the blocks from those holders into its node's pool and reads them there. Counted here, in the
connector's process: one directory lookup for the whole hit, and two round trips to this node's
pool for the read (the pull, then the pin over its channel, or the read itself through Ray's
object store where there is no NIXL path)."""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tessera_ray.actors._ray_handles import DIR_PREFIX, ActorCache, ShardRef
from tessera_ray.actors.channel import ChannelClient
from tessera_ray.actors.client import TesseraClient
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.ray_tier import RayTier
from tests.conftest import SimCluster
from tests.connector._two_pools import random_blocks, two_pool_tier

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla-cross-node", num_layers=2, num_heads=4))
RAY_NS = "tessera-connector-cross-node"
NS = "vllm"


@pytest.fixture(scope="module")
def tier(tessera_cluster: SimCluster) -> Iterator[TesseraClient]:
    yield from two_pool_tier(tessera_cluster, LAYOUT, RAY_NS, num_blocks=32, shards=2)


class _Calls:
    """Every call this process makes to a pool or a directory shard, by kind, and the
    directory lookups (one batched lookup asks each shard that owns a key once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        ray_call = ActorCache.call
        channel_request, channel_send = ChannelClient.request, ChannelClient.send
        counts = self.counts

        shard_hot = ShardRef._hot
        in_shard = contextvars.ContextVar("in_shard", default=False)

        async def by_ray(cache: ActorCache, name: str, what: str, method: str, *a: Any) -> Any:
            if not in_shard.get():  # a shard's call is counted once, where it starts
                counts["directory" if name.startswith(DIR_PREFIX) else "pool"] += 1
                counts[f"ray {method}"] += 1
            return await ray_call(cache, name, what, method, *a)

        async def to_shard(shard: ShardRef, method: str, *a: Any, **kw: Any) -> Any:
            counts["directory"] += 1  # over the shard's channel, or through Ray
            counts[f"shard {method}"] += 1
            token = in_shard.set(True)
            try:
                return await shard_hot(shard, method, *a, **kw)
            finally:
                in_shard.reset(token)

        def request(channel: ChannelClient, op: str, *a: Any) -> Any:  # ``call`` comes here too
            if not in_shard.get():
                counts["pool"] += 1
                counts[f"channel {op}"] += 1
            return channel_request(channel, op, *a)

        def send(channel: ChannelClient, op: str, *a: Any) -> None:
            counts[f"sent {op}"] += 1  # one way: no round trip
            channel_send(channel, op, *a)

        alookup = TesseraClient.alookup

        async def lookup(client: TesseraClient, *a: Any, **kw: Any) -> Any:
            counts["directory lookups"] += 1  # one batched lookup: one call per shard
            return await alookup(client, *a, **kw)

        monkeypatch.setattr(TesseraClient, "alookup", lookup)
        monkeypatch.setattr(ActorCache, "call", by_ray)
        monkeypatch.setattr(ShardRef, "_hot", to_shard)
        monkeypatch.setattr(ChannelClient, "request", request)
        monkeypatch.setattr(ChannelClient, "send", send)

    def take(self) -> Counter[str]:
        counts = Counter(self.counts)
        self.counts.clear()
        return counts


def _blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    return random_blocks(LAYOUT, NS, n, seed)


@pytest.mark.parametrize("staging_bytes", [1 << 20, 0], ids=["nixl", "object-store"])
def test_a_cross_node_hit_asks_the_directory_once_and_its_pool_twice(
    tier: TesseraClient, monkeypatch: pytest.MonkeyPatch, staging_bytes: int
) -> None:
    owner, here = tier.pools
    reader = RayTier(
        TesseraConnectorConfig(ray_namespace=RAY_NS, pool=here, nixl_staging_bytes=staging_bytes)
    )
    reader.prepare_reads()
    assert (reader._reader is not None) == bool(staging_bytes)
    calls = _Calls(monkeypatch)
    for seed in (staging_bytes + 1, staging_bytes + 2):  # the first hit opens the channel
        keys, rows = _blocks(3, seed)
        tier.store(NS, keys, rows, pool=owner)
        calls.take()

        hits = reader.lookup(NS, keys)  # the scheduler
        looked = calls.take()
        assert all(h is not None and {p.pool for p in h.holders} == {owner} for h in hits)
        got = reader.read(NS, keys, [h for h in hits if h is not None])  # the worker
        read = calls.take()

        assert [g is not None for g in got] == [True] * 3
        assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    # The second hit, with the channel open: the scheduler asks this node's pool over it and
    # the directory once; the worker pulls (one call) and pins or reads (one call).
    assert looked["directory lookups"] == 1 and looked["channel lookup"] == 1, looked
    assert read["directory lookups"] == 0 and read["directory"] == 0, read
    assert read["pool"] == 2 and read["ray fetch_from"] == 1, read
    second = "channel pin" if staging_bytes else "ray read_blocks"
    assert read[second] == 1, read
    reader.release_reads()


def test_a_hit_on_this_nodes_pool_is_one_pin(
    tier: TesseraClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, here = tier.pools
    reader = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS, pool=here))
    reader.prepare_reads()
    calls = _Calls(monkeypatch)
    for seed in (11, 12):
        keys, rows = _blocks(2, seed)
        reader.store(NS, keys, rows)
        calls.take()
        hits = reader.lookup(NS, keys)
        looked = calls.take()
        got = reader.read(NS, keys, [h for h in hits if h is not None])
        read = calls.take()
        assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    assert looked["directory lookups"] == 0 and looked["pool"] == 1, (
        looked
    )  # this pool held them all
    assert read["pool"] == 1 and read["channel pin"] == 1, read
    reader.release_reads()
