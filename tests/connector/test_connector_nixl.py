"""The connector worker's read path to a pool (``RayTier.read`` after ``prepare_reads``): pinned
blocks are read in place out of the pool's memory mapped into this process when the pool is on
this process's node (copied out into staging memory registered once where they do not lie at
one stride), and one-sided over NIXL from a pool on another node; every page is checked against
its seal; a rotten page reads as not held; a copied read larger than the staging memory, or a
pool without NIXL, goes through Ray's object store, same bytes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import ray

from tessera_ray.actors.client import TesseraClient
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm.connector import TesseraConnectorConfig
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.ray_tier import RayTier
from tests.actors.test_cluster import _rot
from tests.conftest import SimCluster
from tests.connector._two_pools import random_blocks, two_pool_tier

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla-nixl-reads", num_layers=2, num_heads=4))
RAY_NS = "tessera-connector-nixl"
NS = "vllm"


@pytest.fixture(scope="module")
def tier(tessera_cluster: SimCluster) -> Iterator[TesseraClient]:
    yield from two_pool_tier(tessera_cluster, LAYOUT, RAY_NS, num_blocks=16, shards=1)


def _blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    return random_blocks(LAYOUT, NS, n, seed)


def test_reads_from_this_nodes_pool_take_its_mapped_memory_and_match_the_seal(
    tier: TesseraClient,
) -> None:
    reader = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS))
    assert reader.pool == tier.node_pool(tier.node)
    reader.prepare_reads()
    assert reader._reader is not None, "no read path to the pool"
    assert reader._reader.carrier == "mapped"
    keys, rows = _blocks(4, 1)
    reader.store(NS, keys[:3], rows[:3])
    got = reader.read(NS, keys)  # the 4th was never stored
    assert [g is None for g in got] == [False, False, False, True]
    # Read in place, not hashed yet: the caller checks each layer's pages as it lands them.
    assert got.carrier == "mapped" and got.pinned and not got.verified
    assert got.check_layer is not None
    assert [got.check_layer(layer, [0, 1, 2]) for layer in range(LAYOUT.num_layers)] == [
        [] for _ in range(LAYOUT.num_layers)
    ]
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows[:3])
    assert [g.block_hash for g in got if g is not None] == [
        payload_block_hash(LAYOUT, NS, r) for r in rows[:3]
    ]
    assert reader.end_reads()

    # Page 1 (layer 1) of block 1 rots in the pool's memory: read in place, the check of
    # layer 1 names that block (the caller lands none of it from there), every other page
    # still matches.
    actor = tier.pool(reader.pool)
    ticket = ray.get(actor.pin.remote(NS, [keys[1]]))
    slot = ticket.blocks[0].slots[0][1]
    ray.get(actor.unpin.remote(ticket.id))
    _rot(ray.get(actor.peer_info.remote()), slot)
    got = reader.read(NS, keys[:3])
    assert got.check_layer is not None
    assert got.check_layer(0, [0, 1, 2]) == [] and got.check_layer(1, [0, 1, 2]) == [1]
    assert got.check_layer(1, [0, 2]) == []
    assert np.array_equal(got[2].payload, rows[2])  # type: ignore[union-attr]
    assert reader.end_reads()
    # Read in reverse, the blocks lie at no forward stride: copied out, checked where they land.
    got = reader.read(NS, keys[2::-1])
    assert [g is None for g in got] == [False, True, False]
    assert np.array_equal(got[0].payload, rows[2])  # type: ignore[union-attr]
    assert reader._reader.in_place_reads == 2 and reader._reader.transport.mapped_reads == 1
    reader.release_reads()


def test_reads_from_a_pool_on_another_node_go_over_nixl(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    other = tier.node_pool(tessera_cluster.node_ids[1])
    assert other is not None and other != tier.node_pool(tier.node)
    reader = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS, pool=other))
    reader.prepare_reads()
    assert reader._reader is not None and reader._reader.carrier == "nixl"
    keys, rows = _blocks(3, 3)
    reader.store(NS, keys, rows)
    got = reader.read(NS, keys)
    assert got.carrier == "nixl" and got.verified
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    assert reader._reader.transport.mapped_reads == 0
    reader.release_reads()


def test_a_read_beyond_the_staging_memory_goes_through_the_object_store(
    tier: TesseraClient,
) -> None:
    one_block = TesseraConnectorConfig(ray_namespace=RAY_NS, nixl_staging_bytes=LAYOUT.block_bytes)
    reader = RayTier(one_block)
    reader.prepare_reads()
    assert reader._reader is not None and reader._reader.capacity_blocks == 1
    keys, rows = _blocks(3, 2)
    reader.store(NS, keys, rows)
    assert np.array_equal(reader.read(NS, keys[:1])[0].payload, rows[0])  # type: ignore[union-attr]
    got = reader.read(NS, keys[::-1])  # at no forward stride: copied, and beyond the staging
    assert not got.pinned and got.carrier == ""
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows[::-1])
    reader.release_reads()  # the worker shuts down: its NIXL agent goes, reads still work
    assert reader._reader is None
    assert np.array_equal(reader.read(NS, keys[:1])[0].payload, rows[0])  # type: ignore[union-attr]
    off = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS, nixl_staging_bytes=0))
    off.prepare_reads()
    assert off._reader is None
    got = off.read(NS, keys)
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
