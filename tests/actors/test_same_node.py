"""Pools of one node read each other through mapped memory: the fetch protocol between two
PoolServices in this process (their transports told they share a node), then two pool actors
on one simulated node of the shared cluster, a restart of the owner in each case, and the
configurations refused at start (forcing mapped reads across nodes or without shared memory,
a shared-memory directory that is missing) without losing what the disk tier holds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera_ray.actors._client_nodes import pool_specs
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.fetcher import Fetcher, LocalOwnerLink
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.errors import PoolConfigError, TierConfigError
from tessera_ray.transport import TransportConfig, make_transport
from tests.actors._pools import LAYOUT, NS, keys, payloads, run

NODE = "node-one"


# ---------------------------------------------------------------- configuration, no Ray


def test_forcing_mapped_reads_on_a_tier_spanning_nodes_is_refused_before_any_start() -> None:
    mapped = PoolServiceConfig(num_blocks=4, transport=TransportConfig(same_node="mapped"))
    config = TierConfig(model="tiny-mla", pool=mapped, pools_per_node=2)
    alive: dict[str, Any] = {"n1": {"Resources": {}}, "n2": {"Resources": {}}}
    with pytest.raises(TierConfigError, match=r"spans 2 nodes.*same_node='auto'") as err:
        pool_specs(config, ["n1", "n2"], alive, "p-")
    assert "\n" not in str(err.value)
    assert [s.node for s in pool_specs(config, ["n1"], alive, "p-")] == ["n1", "n1"]


def test_forcing_mapped_reads_needs_shared_memory_and_nixl() -> None:
    forced = TransportConfig(same_node="mapped")
    with pytest.raises(TierConfigError, match="set shared_memory_dir"):
        PoolServiceConfig(num_blocks=4, transport=forced, shared_memory_dir=None)
    PoolServiceConfig(num_blocks=4, transport=forced, shared_memory_dir=None, device="cuda")
    with pytest.raises(TierConfigError, match="kind 'auto' or 'nixl'"):
        PoolServiceConfig(num_blocks=4, transport=TransportConfig(kind="ray", same_node="mapped"))
    assert PoolServiceConfig(num_blocks=4).shared_memory_dir == Path("/dev/shm")


def test_a_missing_shared_memory_dir_fails_the_start_and_loses_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    ks, data = keys(2), payloads(2, 3, LAYOUT.block_bytes)
    first = PoolService("p", LAYOUT, PoolServiceConfig(num_blocks=2, disk_root=disk))
    run(first.store(NS, ks, data))
    run(first.evict(2))  # the last copies go to the disk tier
    run(first.close())
    bad = PoolServiceConfig(num_blocks=2, disk_root=disk, shared_memory_dir=tmp_path / "gone")
    with pytest.raises(PoolConfigError, match=r"'.*gone' is not a directory") as err:
        PoolService("p", LAYOUT, bad)
    assert "\n" not in str(err.value)
    again = PoolService("p", LAYOUT, PoolServiceConfig(num_blocks=2, disk_root=disk))
    assert run(again.reopen_disk()) == 2
    assert again.contains(NS, ks) == [Tier.DISK, Tier.DISK]
    assert np.array_equal(np.stack(run(again.read(NS, ks))), data)
    run(again.close())


# ---------------------------------------------------------------- two services, one process


class SameNode:
    """An owner and a reader PoolService whose NIXL transports say they run on one node."""

    def __init__(self, tag: str) -> None:
        self.directory = LocalDirectory(1)
        self.tag = tag
        self.owner, peer = self._owner()
        self.reader = self._service(f"reader-{tag}")
        self.link = LocalOwnerLink(self.owner, peer)
        self.fetcher = Fetcher(self.reader, lambda name: self.link)

    def _service(self, name: str) -> PoolService:
        cfg = PoolServiceConfig(num_blocks=8, lease_s=10.0)
        svc = PoolService(name, LAYOUT, cfg, directory=self.directory)
        svc.attach_transport(make_transport(TransportConfig(kind="nixl"), name=name, node=NODE))
        return svc

    def _owner(self) -> tuple[PoolService, Any]:
        svc = self._service(f"owner-{self.tag}")
        assert svc.transport is not None
        return svc, svc.transport.peer_info()

    def restart_owner(self) -> None:
        """A new process under the owner's name: new memory, new incarnation."""
        run(self.owner.close())
        self.owner, self.link.peer = self._owner()
        self.link.owner = self.owner

    def pull(self, ks: list[bytes]) -> list[Any]:
        return run(self.fetcher.pull(self.owner.name, NS, ks, 5.0))


@pytest.fixture
def same_node() -> Iterator[SameNode]:
    pair = SameNode(f"{time.monotonic_ns()}")
    yield pair
    run(pair.reader.close())
    run(pair.owner.close())


def test_two_pools_of_one_node_fetch_through_the_mapping_and_remap_a_restarted_owner(
    same_node: SameNode,
) -> None:
    pair, block = same_node, LAYOUT.block_bytes
    ks, data = keys(3), payloads(3, 1, block)
    run(pair.owner.store(NS, ks, data))
    assert pair.pull(ks) == [None] * 3
    transport = pair.reader.transport
    assert transport is not None and transport.carrier(pair.owner.name) == "mapped"
    status = pair.reader.status()
    assert status.transport == "nixl" and status.mapped_bytes_in == 3 * block
    assert np.array_equal(np.stack(run(pair.reader.read(NS, ks))), data)
    # The owner restarts: the fetcher sees a new incarnation, drops the old mapping and maps
    # the new pool's memory.
    pair.restart_owner()
    more, fresh = keys(2, start=10), payloads(2, 2, block)
    run(pair.owner.store(NS, more, fresh))
    assert pair.pull(more) == [None, None]
    assert transport.carrier(pair.owner.name) == "mapped"
    assert pair.reader.status().mapped_bytes_in == 5 * block
    assert np.array_equal(np.stack(run(pair.reader.read(NS, more))), fresh)
    assert pair.link.restarts == 2  # first contact, then the new process


# ---------------------------------------------------------------- pool actors on the cluster


@pytest.fixture(scope="module")
def one_node_tier(tessera_cluster: Any) -> Iterator[Any]:
    from tessera_ray.actors.client import TesseraClient

    config = TierConfig(
        model="tiny-mla",
        pool=PoolServiceConfig(num_blocks=16, lease_s=5.0),
        num_shards=1,
        ray_namespace="tessera-test-same-node",
        pools_per_node=2,
        health_interval_s=0.5,
    )
    client = TesseraClient.start(config, layout=LAYOUT, pools_on=tessera_cluster.node_ids[:1])
    yield client
    client.stop()


def _status(tier: Any, pool: str) -> Any:
    import ray

    return ray.get(tier.pool(pool).status.remote())


@pytest.mark.ray
def test_two_pool_actors_of_one_node_read_each_other_through_the_mapping(
    one_node_tier: Any,
) -> None:
    tier, block = one_node_tier, LAYOUT.block_bytes
    owner, reader = tier.pools
    ks, data = keys(4, "agents", start=100), payloads(4, 4, block)
    assert all(s.registered for s in tier.store("agents", ks, data, pool=owner))
    before = _status(tier, reader)
    result = tier.fetch("agents", ks, into=reader)
    assert set(result.fetched) == set(ks) and not result.failed
    after = _status(tier, reader)
    assert after.transport == "nixl" and after.transfers_in - before.transfers_in == 4
    assert after.mapped_bytes_in - before.mapped_bytes_in == 4 * block  # not one byte by NIXL
    assert np.array_equal(np.stack(tier.read("agents", ks, pool=reader)), data)


@pytest.mark.ray
def test_a_restarted_pool_actor_is_read_through_its_new_mapping(one_node_tier: Any) -> None:
    import ray

    tier, block = one_node_tier, LAYOUT.block_bytes
    owner, reader = tier.pools
    ks, data = keys(3, "agents", start=200), payloads(3, 5, block)
    tier.store("agents", ks, data, pool=owner)
    assert set(tier.fetch("agents", ks[:1], into=reader).fetched) == {ks[0]}
    old_pid = ray.get(tier.pool(owner).__ray_call__.remote(lambda self: __import__("os").getpid()))
    ray.kill(tier.pool(owner), no_restart=False)  # Ray restarts it (max_restarts=-1)
    deadline = time.monotonic() + 60
    while True:
        try:
            pid = ray.get(
                tier.pool(owner).__ray_call__.remote(lambda self: __import__("os").getpid()),
                timeout=10,
            )
            if pid != old_pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the pool actor did not come back"
        time.sleep(0.2)
    # The new process holds nothing of the old one; store again and pull it pool to pool
    # (the reader pins on the new process, sees its new incarnation, maps its new slab).
    fresh = payloads(3, 6, block)
    assert all(s.registered for s in tier.store("agents", ks, fresh, pool=owner))
    before = _status(tier, reader).mapped_bytes_in
    reasons = ray.get(tier.pool(reader).fetch_from.remote(owner, "agents", ks[1:]))
    assert reasons == [None, None]
    assert _status(tier, reader).mapped_bytes_in - before == 2 * block
    assert np.array_equal(np.stack(tier.read("agents", ks[1:], pool=reader)), fresh[1:])


@pytest.mark.ray
def test_a_pool_actor_without_its_shared_memory_dir_fails_to_start(
    tessera_cluster: Any, tmp_path: Path
) -> None:
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.deploy import stop_tier

    missing = tmp_path / "no-shm-here"
    config = TierConfig(
        model="tiny-mla",
        pool=PoolServiceConfig(num_blocks=4, shared_memory_dir=missing),
        num_shards=1,
        ray_namespace="tessera-test-no-shm",
    )
    head = tessera_cluster.node_ids[:1]
    try:
        with pytest.raises(Exception, match="no-shm-here' is not a directory") as err:
            TesseraClient.start(config, layout=LAYOUT, pools_on=head)
        assert "shared_memory_dir=None" in str(err.value)
    finally:
        pools = [s.name for s in pool_specs(config, head, {}, "tessera-pool-")]
        stop_tier(config, pools, owns_ray=False)
