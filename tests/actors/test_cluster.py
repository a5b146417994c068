"""The tier on a 3-node simulated Ray cluster: cross-node fetch, dedup across agents, a dead
pool, a restarting directory shard, and a client that dies between reserve and commit."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

from tessera_ray.actors._ray_handles import ActorCache
from tessera_ray.actors.client import TesseraClient, this_node
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.messages import FetchFailure, PoolStatus
from tessera_ray.core import token_key
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.transport import PeerInfo
from tests.conftest import SimCluster, kill_and_wait

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla", num_layers=2, num_heads=4))


def prefix(ns: str, n: int, salt: int = 0) -> list[bytes]:
    keys, parent = [], None
    for i in range(n):
        parent = token_key(ns, LAYOUT.fingerprint, parent, [salt * 1000 + i] * 64)
        keys.append(parent)
    return keys


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)


@pytest.fixture(scope="module")
def tier(
    tessera_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TesseraClient]:
    disk: Path = tmp_path_factory.mktemp("disk")
    config = TierConfig(
        model="tiny-mla",
        pool=PoolServiceConfig(num_blocks=24, disk_root=disk, lease_s=2.0),
        num_shards=2,
        ray_namespace="tessera-test-cluster",
        health_interval_s=0.5,
    )
    client = TesseraClient.start(config, layout=LAYOUT, pools_on=tessera_cluster.node_ids)
    yield client
    client.stop()


def test_store_on_node1_fetch_on_node3_byte_exact(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    n1, _, n3 = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    keys, data = prefix("agents", 3, salt=1), blocks(3, 1)
    stored = tier.store("agents", keys, data, pool=n1)
    assert all(s.registered for s in stored)
    found = tier.lookup("agents", keys)
    assert all(r is not None and r.replicas[0].pool == n1 for r in found)
    result = tier.fetch("agents", keys, into=n3)
    assert set(result.fetched) == set(keys) and not result.failed
    status = _status(tier, n3)
    assert status.transport == "nixl" and status.transfers_in == 3  # one-sided reads over UCX
    # Not through mapped memory, although the simulated nodes share /dev/shm: another node.
    assert status.mapped_bytes_in == 0
    assert status.bytes_in == 3 * LAYOUT.block_bytes
    assert _status(tier, n1).channel_pins >= 1  # the pin went over the direct channel
    got = tier.read("agents", keys, pool=n3)
    assert all(g is not None for g in got)
    assert np.array_equal(np.stack(got), data)
    # The directory now lists both copies; another tenant sees nothing.
    assert {rep.pool for rep in tier.lookup("agents", keys)[0].replicas} == {n1, n3}
    assert tier.lookup("someone-else", keys) == [None] * 3


def test_sixteen_agents_keep_one_copy_per_node_then_one_cluster_wide(
    tier: TesseraClient,
    tessera_cluster: SimCluster,
) -> None:
    pools = [tier.pool_on(n) for n in tessera_cluster.node_ids]
    keys, data = prefix("fleet", 4, salt=2), blocks(4, 2)
    before = {p: _status(tier, p) for p in pools}
    for agent in range(16):
        pool = pools[agent % 3]
        got = tier.fetch("fleet", keys, into=pool)
        missing = [k for k in keys if k not in got.available]
        if missing:  # first agent: nothing anywhere yet, it computes and stores
            idx = [keys.index(k) for k in missing]
            tier.store("fleet", missing, data[idx], pool=pool)
    for p in pools:
        held = ray.get(tier.pool(p).contains.remote("fleet", keys))
        assert held == [Tier.MEMORY] * 4, p  # one copy per node, not one per agent
        assert _status(tier, p).blocks_in_memory - before[p].blocks_in_memory == 4
    # Evict the extra replicas. A copy in another pool's memory is not durable (that pool may
    # evict it at the same moment), so the first evicting pool spills to its disk; once a disk
    # copy exists, the next pool drops its copy without writing.
    first = tier.evict(pools[1], 24)
    assert {r.token_key for r in first.spilled} >= set(keys)
    second = tier.evict(pools[2], 24)
    assert {r.token_key for r in second.dropped} >= set(keys)
    copies = [ray.get(tier.pool(p).contains.remote("fleet", keys)) for p in pools]
    assert copies[0] == [Tier.MEMORY] * 4
    assert copies[1] == [Tier.DISK] * 4 and copies[2] == [None] * 4
    found = tier.lookup("fleet", keys)
    assert all(
        r is not None
        and {(rep.pool, rep.tier) for rep in r.replicas}
        == {(pools[0], Tier.MEMORY), (pools[1], Tier.DISK)}
        for r in found
    )
    got = tier.read("fleet", keys, pool=pools[0])
    assert np.array_equal(np.stack(got), data)


def test_async_forms_inside_an_event_loop(tier: TesseraClient, tessera_cluster: SimCluster) -> None:
    n1, n2, _ = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    keys, data = prefix("async", 2, salt=6), blocks(2, 6)

    async def agent() -> None:
        stored, _ = await asyncio.gather(
            tier.astore("async", keys, data, pool=n1), asyncio.sleep(0)
        )
        assert all(s.registered for s in stored)
        found = await tier.alookup("async", keys)
        assert [r.block_hash for r in found if r] == [s.block_hash for s in stored]
        got = await tier.afetch("async", keys, into=n2)
        assert set(got.fetched) == set(keys)
        rows = await tier.aread("async", keys, pool=n2)
        assert np.array_equal(np.stack(rows), data)
        with pytest.raises(RuntimeError, match="await the a-prefixed form"):
            tier.lookup("async", keys)

    asyncio.run(agent())


def _status(tier: TesseraClient, pool: str) -> PoolStatus:
    return ray.get(tier.pool(pool).status.remote())


def test_slots_reserved_beside_the_pin_for_blocks_the_owner_lacks_are_freed(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    """The reader reserves a slot per asked key while the owner pins; the blocks the owner did
    not hold give theirs back at once, nothing stays reserved."""
    n1, _, n3 = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    keys, data = prefix("partial", 4, salt=7), blocks(2, 7)
    tier.store("partial", keys[:2], data, pool=n1)
    before = _status(tier, n3)
    reasons = ray.get(tier.pool(n3).fetch_from.remote(n1, "partial", keys))
    assert reasons[:2] == [None, None]
    assert all(r is not None and r.reason is FetchFailure.NOT_HELD for r in reasons[2:])
    after = _status(tier, n3)
    assert after.reservations == 0 and after.pins == 0
    assert after.blocks_in_memory == before.blocks_in_memory + 2
    total = after.blocks_free + after.blocks_in_memory
    assert total == before.blocks_free + before.blocks_in_memory  # no slot left reserved
    got = tier.read("partial", keys[:2], pool=n3)
    assert np.array_equal(np.stack(got), data)


def test_client_dying_between_reserve_and_commit_leaves_nothing(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    pool = tier.pool_on(tessera_cluster.node_ids[1])
    free = _status(tier, pool).blocks_free

    @ray.remote(num_cpus=0, max_retries=0)
    def reserve_and_die(name: str, namespace: str) -> None:
        import os

        actor = ray.get_actor(name, namespace=namespace)
        ray.get(actor.reserve.remote(5, 1.0))
        os._exit(1)

    with pytest.raises(ray.exceptions.WorkerCrashedError):
        ray.get(reserve_and_die.remote(pool, tier.config.ray_namespace))
    status = _status(tier, pool)
    assert status.reservations == 1 and status.blocks_free == free - 5
    deadline = time.monotonic() + 10
    while _status(tier, pool).reservations and time.monotonic() < deadline:
        time.sleep(0.25)  # the lease (1 s) expires; the pool's reaper returns the slots
    status = _status(tier, pool)
    assert status.reservations == 0 and status.blocks_free == free


def test_directory_shard_restart_misses_then_rebuilds(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    pool = tier.pool_on(tessera_cluster.node_ids[0])
    keys, data = prefix("restart", 8, salt=3), blocks(8, 3)
    stored = tier.store("restart", keys, data, pool=pool)
    expected = {s.token_key: s.block_hash for s in stored}
    ray.kill(tier.shard(0), no_restart=False)  # the shard restarts (max_restarts=-1)
    during = tier.lookup("restart", keys)  # never raises; a shard that is down answers misses
    assert all(r is None or r.block_hash == expected[k] for k, r in zip(keys, during, strict=True))
    assert tier.wait_rebuilt(30)
    after = tier.lookup("restart", keys)
    assert [r.block_hash if r else None for r in after] == [expected[k] for k in keys]
    assert all(r.replicas[0].pool == pool for r in after if r)


def _shards_served(tier: TesseraClient) -> Counter[str]:
    """What the directory shards' channels answered so far, by op, over every shard."""
    served: Counter[str] = Counter()
    for i in range(tier.config.num_shards):
        served += ray.get(
            tier.shard(i).__ray_call__.remote(
                lambda self: Counter(self._channel_server.served) if self._channel_server else {}
            )
        )
    return served


def test_lookups_and_registrations_go_over_the_shards_channels_and_through_ray_if_one_breaks(
    tier: TesseraClient, tessera_cluster: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = tier.pool_on(tessera_cluster.node_ids[0])
    keys, data = prefix("shard-channel", 6, salt=9), blocks(6, 9)
    before = _shards_served(tier)
    stored = tier.store("shard-channel", keys, data, pool=pool)
    expected = [s.block_hash for s in stored]
    # The pool registered what it stored over the shards' channels.
    assert (_shards_served(tier) - before)["register"] >= 1
    by_ray: Counter[str] = Counter()
    ray_call = ActorCache.call

    async def counted(cache: ActorCache, name: str, what: str, method: str, *a: object) -> object:
        by_ray[method] += 1
        return await ray_call(cache, name, what, method, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(ActorCache, "call", counted)

    async def lookups() -> None:
        first = await tier.alookup("shard-channel", keys)  # learns the channels (Ray calls)
        asked = by_ray["lookup"]
        seen = _shards_served(tier)["lookup"]
        again = await tier.alookup("shard-channel", keys)
        assert by_ray["lookup"] == asked, "a lookup went through Ray with the channels open"
        assert _shards_served(tier)["lookup"] > seen
        # Broken channels: the lookup is answered through Ray, the same.
        for i in range(tier.config.num_shards):
            ray.get(
                tier.shard(i).__ray_call__.remote(
                    lambda self: [c.close() for c in list(self._channel_server._connections)]
                )
            )
        broken = await tier.alookup("shard-channel", keys)
        assert by_ray["lookup"] > asked
        for answer in (first, again, broken):
            assert [r.block_hash if r else None for r in answer] == expected

    asyncio.run(lookups())
    # Blocking calls open no channel for one request: Ray answers them.
    asked = by_ray["lookup"]
    assert [r.block_hash if r else None for r in tier.lookup("shard-channel", keys)] == expected
    assert by_ray["lookup"] > asked


def test_a_purged_pool_that_answers_is_learned_again(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    """A purge decided on a pool that only looked dead (a restart that already re-announced
    its disk, a busy pool, a client that found it unavailable) wipes replicas the pool still
    holds; the shards re-learn them from its inventory once it answers."""
    pool = tier.pool_on(tessera_cluster.node_ids[1])
    keys, data = prefix("purged", 5, salt=6), blocks(5, 6)
    stored = tier.store("purged", keys, data, pool=pool)
    tier.purge_pool(pool)  # as a client that saw it unavailable does; it is alive
    assert tier.lookup("purged", keys) == [None] * 5  # misses for now: slower, never wrong
    assert tier.wait_rebuilt(20)  # the shards re-learned it (the wait covers that too)
    found = tier.lookup("purged", keys)
    assert [r.block_hash if r else None for r in found] == [s.block_hash for s in stored]
    assert all(r.replicas[0].pool == pool for r in found if r)
    assert np.array_equal(np.stack(tier.read("purged", keys, pool=pool)), data)


def _rot(info: PeerInfo, slot: int) -> None:
    """Overwrite 64 bytes of page ``slot`` (group 0) in a pool actor's registered memory with a
    one-sided NIXL WRITE from this process, as a stray DMA or bad RAM would."""
    import torch

    from tessera_ray.transport.nixl import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    agent = nixl_agent(f"rot-{time.monotonic_ns()}", nixl_agent_config(backends=["UCX"]))
    junk = torch.full((64,), 0x5A, dtype=torch.uint8)
    reg = agent.register_memory(junk)
    peer = agent.add_remote_agent(info.metadata)
    region = info.regions[0]
    target = np.array([[region.base_addr + slot * region.page_bytes + 128, 64, 0]], np.uint64)
    xfer = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(junk), agent.get_xfer_descs(target, "DRAM"), peer
    )
    state, deadline = agent.transfer(xfer), time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(xfer)
    assert state == "DONE", state
    agent.release_xfer_handle(xfer)
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)


def test_a_block_that_rotted_in_its_owner_is_dropped_there_after_a_failed_fetch(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    """A reader whose fetch finds bytes hashing otherwise than sealed tells the owner, which
    re-hashes its copy, drops it (it rotted), so the next store of the key replaces it."""
    owner, _, reader = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    keys, data = prefix("rot", 3, salt=7), blocks(3, 7)
    tier.store("rot", keys, data, pool=owner)
    actor = tier.pool(owner)
    ticket = ray.get(actor.pin.remote("rot", [keys[1]]))
    ray.get(actor.unpin.remote(ticket.id))
    info = ray.get(actor.peer_info.remote())
    if info is None:
        pytest.skip("the pools move blocks through the object store here (no NIXL)")
    _rot(info, ticket.blocks[0].slots[0][0])
    result = tier.fetch("rot", keys, into=reader)
    assert set(result.fetched) == {keys[0], keys[2]} and keys[1] not in result.available
    deadline = time.monotonic() + 20  # the report is sent without waiting for it
    while ray.get(actor.status.remote()).rotten_blocks == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(actor.status.remote()).rotten_blocks == 1
    assert ray.get(actor.contains.remote("rot", keys)) == [Tier.MEMORY, None, Tier.MEMORY]
    tier.store("rot", keys[1:2], data[1:2], pool=owner)
    assert set(tier.fetch("rot", keys[1:2], into=reader).fetched) == {keys[1]}
    assert np.array_equal(np.stack(tier.read("rot", keys, pool=reader)), data)


def test_dead_pool_is_purged_and_requests_fall_back(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    head, victim, other = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    keys, data = prefix("chaos", 6, salt=4), blocks(6, 4)
    tier.store("chaos", keys, data, pool=victim)
    assert set(tier.fetch("chaos", keys[:3], into=other).fetched) == set(keys[:3])
    assert _status(tier, victim).channel_pins >= 1  # other now holds a channel to victim
    handle = tier.pool(victim)
    kill_and_wait(handle)
    # The open channel breaks with the process: the reader learns at once, not after its
    # 30 s timeout, and fetches nothing.
    began = time.monotonic()
    late = tier.fetch("chaos", keys[3:], into=other)
    assert time.monotonic() - began < 10.0
    assert not late.fetched and set(late.failed) | set(late.missed) == set(keys[3:])
    result = tier.fetch("chaos", keys, into=head)
    # Blocks with a live replica come from it, byte-exact; the rest are misses, never wrong.
    assert set(result.fetched) == set(keys[:3])
    assert set(result.failed) | set(result.missed) == set(keys[3:])
    got = tier.read("chaos", keys[:3], pool=head)
    assert np.array_equal(np.stack(got), data[:3])
    for r in tier.lookup("chaos", keys):
        assert r is None or all(rep.pool != victim for rep in r.replicas)
    # The shards' health checks purge it too (for keys no client touched yet).
    untouched = prefix("chaos-untouched", 2, salt=5)
    tier.store("chaos-untouched", untouched, blocks(2, 5), pool=other)
    assert all(r is not None for r in tier.lookup("chaos-untouched", untouched))
    pools, _ = tier.status()
    assert any(isinstance(p, str) and victim in p and "down" in p for p in pools)


def test_a_connection_without_the_secret_is_refused_and_counted(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    from dataclasses import replace

    from tessera_ray.actors.channel import ChannelClient, ChannelError

    n1, _, n3 = (tier.pool_on(n) for n in tessera_cluster.node_ids)  # n2 died above
    address = ray.get(tier.pool(n1).channel.remote())
    assert address is not None and address.host == "127.0.0.1"
    before = _status(tier, n1).channel_refused
    keys, data = prefix("guarded", 2, salt=6), blocks(2, 6)
    tier.store("guarded", keys, data, pool=n1)

    async def intrude() -> None:
        client = await ChannelClient.connect(replace(address, secret=b"\0" * 32), 5.0)
        with pytest.raises(ChannelError):
            await client.call("pin", "guarded", keys, timeout_s=5.0)

    asyncio.run(intrude())
    status = _status(tier, n1)
    assert status.channel_refused == before + 1 and status.pins == 0
    # Pools that know the secret keep fetching.
    assert set(tier.fetch("guarded", keys, into=n3).fetched) == set(keys)


def test_cli_start_and_stop_on_a_running_cluster(tessera_cluster: SimCluster) -> None:
    from tessera_ray.cli import main

    names = ["--ray-namespace", "tessera-cli-test"]
    assert main(["start", "--model", "deepseek-v2-lite", "--num-blocks", "2", *names]) == 0
    client = TesseraClient.connect("tessera-cli-test")
    assert len(client.pools) == len(tessera_cluster.node_ids)
    assert client.layout.model == "deepseek-v2-lite" and client.config.num_shards == 2
    keys = [token_key("t", client.layout.fingerprint, None, [7] * 64)]
    data = np.full((1, client.layout.block_bytes), 7, dtype=np.uint8)
    client.store("t", keys, data, pool=client.pools[0])
    assert client.lookup("t", keys)[0] is not None
    assert main(["stop", *names]) == 0
    alive = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "tessera-cli-test"
    ]
    assert alive == []


def test_a_process_under_a_worker_takes_its_workers_node_as_local(
    tier: TesseraClient, tessera_cluster: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This driver is attached to the head; a process that a worker on node 3 started (vLLM's
    engine core under a Serve replica) inherits node 3's raylet in ``RAY_RAYLET_PID`` and reads
    and stores through node 3's pool, not the head's."""
    head, node3 = tessera_cluster.node_ids[0], tessera_cluster.node_ids[2]
    monkeypatch.delenv("RAY_NODE_ID", raising=False)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    assert this_node() == head and tier.local_pool() == tier.pool_on(head)
    (raylet,) = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and _cmdline(p).count(f"--node_id={node3}".encode()) == 1
        and b"raylet" in _cmdline(p).split(b"\0")[0]
    ]
    monkeypatch.setenv("RAY_RAYLET_PID", raylet)
    assert this_node() == node3 and tier.local_pool() == tier.pool_on(node3)
    monkeypatch.setenv("RAY_NODE_ID", head)  # where Ray names the node itself, that wins
    assert this_node() == head


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_the_serve_router_routes_to_the_node_whose_pool_holds_the_prompt(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    """On the running tier: a prompt whose blocks an engine stored on node 3's pool is routed
    to node 3's replica, from the directory's answer alone (node 2's pool died above)."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from tessera_ray.metrics import Metrics, PrometheusBackend
    from tessera_ray.serve.router import TesseraRequestRouter
    from tessera_ray.serve.routing import RouteReason
    from tessera_ray.vllm.keys import prompt_keys

    tokens = list(range(5, 5 + 3 * LAYOUT.block_tokens + 9))
    keys = prompt_keys(LAYOUT.fingerprint, "served", tokens, LAYOUT.block_tokens, None, "route-ns")
    tier.store("route-ns", keys, blocks(3, 9), pool=tier.pool_on(tessera_cluster.node_ids[2]))
    router = TesseraRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state(
        model_name="served", namespace="route-ns", client=tier, lookup_timeout_s=5.0
    )
    backend = PrometheusBackend()
    router._metrics = Metrics(backend)  # read back what the choice recorded
    replicas = [
        SimpleNamespace(replica_id=f"r{i}", node_id=n, max_ongoing_requests=8)
        for i, n in enumerate(tessera_cluster.node_ids)
    ]
    pending = SimpleNamespace(args=[{"prompt": tokens}], kwargs={})
    ranked = asyncio.run(router.choose_replicas(replicas, pending))
    assert ranked[0][0].replica_id == "r2"
    assert router.last_choice is not None
    assert (router.last_choice.reason, router.last_choice.local_blocks) == (RouteReason.TIER, 3)
    # A tier choice reports the blocks that made it, where it is made.
    tags = {"ray_namespace": "tessera", "deployment": "llm", "reason": "tier"}
    sample = backend.registry.get_sample_value
    assert sample("tessera_route_requests_total", tags) == 1
    assert sample("tessera_route_held_blocks_total", tags) == 3
