"""The connector's road to the tier without Ray (``NodeTier``): an engine process on a pool's
node finds the pool's announcement, reaches the whole tier over that one channel (lookups,
pulls of blocks held elsewhere, pins and a read out of the pool's mapped memory, one-call
stores), never imports Ray, and reaches a restarted pool through its new announcement."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from tessera_ray.actors._ray_handles import PoolRef
from tessera_ray.actors.announce import PoolAnnouncement, announce, process_started, run_dir
from tessera_ray.actors.channel import ChannelAddress, ChannelClient
from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.directory import Holder, Tier
from tessera_ray.actors.messages import BlockReads
from tessera_ray.actors.pool_link import PoolLink
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm import node_tier, pool_tier
from tessera_ray.vllm.backend import TierUnavailableError
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.node_tier import NodeTier, announced_pool
from tessera_ray.vllm.tiers import open_tier
from tests.conftest import ROOT, SimCluster
from tests.connector._two_pools import random_blocks, two_pool_tier

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla-node-tier", num_layers=2, num_heads=4))
RAY_NS = "tessera-connector-node-tier"
NS = "vllm"


@pytest.fixture(scope="module")
def tier(tessera_cluster: SimCluster) -> Iterator[TesseraClient]:
    yield from two_pool_tier(tessera_cluster, LAYOUT, RAY_NS, num_blocks=32, shards=2)


def _blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    return random_blocks(LAYOUT, NS, n, seed)


def _served(client: TesseraClient, pool: str) -> dict[str, int]:
    """What pool ``pool``'s channel served so far, by op."""
    actor = client.pool(pool)
    return dict(ray.get(actor.__ray_call__.remote(lambda self: self._channel_server.served)))


def _every_page_matches(got: BlockReads) -> bool:
    """A read in place, each layer's pages of every row matching its seal."""
    rows = range(len(got.payloads))
    return got.check_layer is not None and not any(
        got.check_layer(layer, rows) for layer in range(LAYOUT.num_layers)
    )


def _node_tier(pool: str, **extra: Any) -> NodeTier:
    config = TesseraConnectorConfig(ray_namespace=RAY_NS, pool=pool, **extra)
    entry = announced_pool(config)
    assert entry is not None, f"pool {pool} announced no channel on this machine"
    return NodeTier(config, entry)


def test_an_engine_process_reaches_the_tier_without_ever_importing_ray(
    tier: TesseraClient,
) -> None:
    pool = tier.pools[0]
    script = f"""
import json, sys
import numpy as np
from tessera_ray.core import token_key
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.tiers import open_tier
config = TesseraConnectorConfig(ray_namespace={RAY_NS!r}, pool={pool!r})
t = open_tier(config, None)
keys = [token_key("vllm", t.layout.fingerprint, None, [7, i] * 32) for i in range(3)]
rows = np.random.default_rng(7).integers(0, 256, (3, t.layout.block_bytes), dtype=np.uint8)
t.store("vllm", keys, rows)
hits = t.lookup("vllm", keys)
t.prepare_reads()
got = t.read("vllm", keys, hits)
print(json.dumps({{
    "road": type(t).__name__,
    "hits": [h is not None for h in hits],
    "equal": bool(np.array_equal(np.stack([g.payload for g in got]), rows)),
    "carrier": got.carrier,
    "checked": [got.check_layer(i, [0, 1, 2]) for i in range(t.layout.num_layers)],
    "ray": sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")),
}}))
t.release_reads()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_MODULES": "^ib"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["road"] == "NodeTier"
    assert seen["hits"] == [True, True, True]
    assert seen["equal"] and seen["checked"] == [[], []]  # read in place, every page matches
    assert seen["carrier"] == "mapped"
    assert seen["ray"] == [], "the engine's process imported Ray"


def test_a_store_is_one_call_to_the_pool(tier: TesseraClient) -> None:
    pool = tier.pools[0]
    road = _node_tier(pool)
    keys, rows = _blocks(5, 11)
    before = _served(tier, pool)
    road.store(NS, keys, rows)
    after = _served(tier, pool)
    # The bytes went through this engine's slab, which the pool mapped: one call, no bytes in it.
    assert after.get("store_mapped", 0) - before.get("store_mapped", 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1, (before, after)
    assert road._store_slab.get() is not None
    # Stored under the bytes' own hashes, and read back equal.
    got = tier.read(NS, keys, pool=pool)
    assert all(np.array_equal(g, r) for g, r in zip(got, rows, strict=True))
    found = road.lookup(NS, keys)
    assert [f.block_hash for f in found if f] == [payload_block_hash(LAYOUT, NS, r) for r in rows]


def test_an_engines_store_answers_before_the_directory_hears_of_it(tier: TesseraClient) -> None:
    pool = tier.pools[0]
    road = _node_tier(pool)
    keys, rows = _blocks(3, 40)

    def slow_directory(self: Any) -> None:
        # Every registration of this pool takes a second (a busy shard).
        directory = self.svc.announce.directory
        register = directory.register

        async def late(entries: Any) -> None:
            await asyncio.sleep(1.0)
            await register(entries)

        directory.register = late
        self._slow_register = register

    def restore(self: Any) -> None:
        self.svc.announce.directory.register = self._slow_register

    actor = tier.pool(pool)
    ray.get(actor.__ray_call__.remote(slow_directory))
    try:
        began = time.monotonic()
        road.store(NS, keys, rows)
        assert time.monotonic() - began < 0.8, "the engine's store waited for the directory"
        # The directory learns of them once the registration lands.
        deadline = time.monotonic() + 10
        while not all(h is not None for h in tier.lookup(NS, keys)):
            assert time.monotonic() < deadline, "the directory never learned of the store"
            time.sleep(0.1)
    finally:
        ray.get(actor.__ray_call__.remote(restore))
    # The client's own store still answers only once the directory knows.
    keys, rows = _blocks(2, 41)
    tier.store(NS, keys, rows, pool=pool)
    assert all(h is not None for h in tier.lookup(NS, keys))


def test_the_connector_holds_one_handle_to_its_pool(tier: TesseraClient) -> None:
    road = _node_tier(tier.pools[0])
    road.prepare_reads()
    keys, rows = _blocks(2, 17)
    road.store(NS, keys, rows)
    road.read(NS, keys, road.lookup(NS, keys))
    handles = [
        v
        for v in vars(road).values()
        if isinstance(v, ChannelClient | PoolLink | PoolRef | TesseraClient)
    ]
    assert [type(h) for h in handles] == [ChannelClient]
    road.release_reads()


def test_a_slab_outside_the_pools_shared_memory_is_refused_and_the_bytes_travel_instead(
    tier: TesseraClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = tier.pools[0]
    monkeypatch.setattr(node_tier, "SHM_DIR", str(tmp_path))  # not the pool's directory
    road = _node_tier(pool)
    keys, rows = _blocks(3, 16)
    before = _served(tier, pool)
    road.store(NS, keys, rows)
    after = _served(tier, pool)
    assert after.get("store_mapped", 0) - before.get("store_mapped", 0) == 1  # refused
    assert after.get("store", 0) - before.get("store", 0) == 1  # the bytes in the call
    assert road._store_slab.get() is None
    got = tier.read(NS, keys, pool=pool)
    assert all(np.array_equal(g, r) for g, r in zip(got, rows, strict=True))


def _held_there(tier: TesseraClient, n: int, seed: int) -> tuple[NodeTier, list[bytes], Any, Any]:
    """Blocks only the other node's pool holds, and this node's road with its lookup of them."""
    keys, rows = _blocks(n, seed)
    tier.store(NS, keys, rows, pool=tier.pools[1])
    road = _node_tier(tier.pools[0])
    hits = road.lookup(NS, keys)  # the scheduler's lookup
    assert all(h is not None and h.holders == (Holder(tier.pools[1], Tier.MEMORY),) for h in hits)
    return road, keys, rows, hits


def test_a_hit_held_only_on_another_pool_is_pulled_into_this_one_then_read(
    tier: TesseraClient,
) -> None:
    here, there = tier.pools[0], tier.pools[1]
    pins_there = _served(tier, there).get("pin", 0)
    road, keys, rows, hits = _held_there(tier, 3, 12)
    road.prepare_reads()
    before = _served(tier, here)
    got = road.read(NS, keys, hits)
    after = _served(tier, here)
    assert _served(tier, there).get("pin", 0) > pins_there  # pulled from there, over its channel
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    assert _every_page_matches(got)
    assert after.get("pull", 0) - before.get("pull", 0) == 1
    # Now held here: the next lookup is answered by this pool alone.
    again = road.lookup(NS, keys)
    assert all(h is not None and Holder(here, Tier.MEMORY) in h.holders for h in again)
    road.release_reads()


def test_the_pull_starts_when_the_lookup_is_answered_before_the_worker_asks(
    tier: TesseraClient,
) -> None:
    here, there = tier.pools[0], tier.pools[1]
    road, keys, rows, hits = _held_there(tier, 4, 15)  # no read follows the lookup yet
    deadline = time.monotonic() + 10
    while ray.get(tier.pool(here).contains.remote(NS, keys)) != [Tier.MEMORY] * len(keys):
        assert time.monotonic() < deadline, "the lookup started no pull into this node's pool"
        time.sleep(0.05)
    # The worker's read then moves nothing between pools: every block is here already, and
    # the other pool is not asked to pin anything again.
    road.prepare_reads()
    pins_there = _served(tier, there).get("pin", 0)
    got = road.read(NS, keys, hits)
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    assert _served(tier, there).get("pin", 0) == pins_there
    road.release_reads()


@pytest.mark.parametrize("through", ["slabs", "calls"])
def test_reads_and_stores_larger_than_a_slab_or_a_frame_go_in_runs(
    tier: TesseraClient, through: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = tier.pools[0]
    if through == "calls":  # no slab can be made: the bytes travel in the calls
        monkeypatch.setattr(node_tier, "SHM_DIR", str(tmp_path / "absent"))
    road = _node_tier(pool, nixl_staging_bytes=0)  # no mapped reader: reads are answered
    road._rows_per_call = road._store_slab.rows = road._read_slab.rows = 2  # runs of two
    keys, rows = _blocks(5, 13)
    before = _served(tier, pool)
    road.store(NS, keys[:4], rows[:4])
    got = road.read(NS, keys)  # the fifth was never stored
    after = _served(tier, pool)
    assert [g is None for g in got] == [False, False, False, False, True]
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows[:4])
    ops = ("store_mapped", "read_into") if through == "slabs" else ("store", "read_blocks")
    assert [after.get(op, 0) - before.get(op, 0) for op in ops] == [2, 3]


def _kill_and_wait(tier: TesseraClient, entry: PoolAnnouncement) -> None:
    """Kill ``entry``'s pool (Ray restarts it) and wait until its process is gone: the kill
    lands a moment after ``ray.kill`` returns, and the process answers until then."""
    ray.kill(tier.pool(entry.pool), no_restart=False)
    deadline = time.monotonic() + 30
    while process_started(entry.pid) == entry.started:
        assert time.monotonic() < deadline, "the killed pool's process stayed"
        time.sleep(0.05)


def test_a_restarted_pool_is_reached_through_its_new_announcement(tier: TesseraClient) -> None:
    pool = tier.pools[0]
    road = _node_tier(pool)
    keys, rows = _blocks(2, 14)
    road.store(NS, keys, rows)
    old = road._entry
    _kill_and_wait(tier, old)
    deadline = time.monotonic() + 60
    while True:
        try:
            road.store(NS, keys, rows)  # lands in the new process (which holds nothing yet)
            break
        except TierUnavailableError:
            assert time.monotonic() < deadline, "the restarted pool was never reached again"
            time.sleep(0.5)
    assert road._entry.pid != old.pid and road._entry.address != old.address
    assert all(h is not None for h in road.lookup(NS, keys))


def test_an_engine_starting_while_its_pool_restarts_waits_for_the_new_channel(
    tier: TesseraClient,
) -> None:
    # The engine read the announcement of a process that is now gone (CI once saw an engine
    # fail at start on exactly that: "cannot reach" the port of a pool that had gone).
    pool = tier.pools[0]
    config = TesseraConnectorConfig(ray_namespace=RAY_NS, pool=pool, timeout_s=90.0)
    old = _node_tier(pool)._entry
    _kill_and_wait(tier, old)
    road = NodeTier(config, old)
    assert road._entry.pid != old.pid and road._entry.address != old.address
    keys, rows = _blocks(2, 15)
    road.store(NS, keys, rows)
    assert all(h is not None for h in road.lookup(NS, keys))


def test_an_engine_whose_pool_never_listens_fails_at_start_naming_the_announcement(
    tier: TesseraClient,
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port = closed.getsockname()[1]
        ghost = PoolAnnouncement.of_this_process(
            RAY_NS, "ghost-pool", "no-node", ChannelAddress("127.0.0.1", port, os.urandom(32))
        )
        announce(ghost)
        config = TesseraConnectorConfig(ray_namespace=RAY_NS, pool="ghost-pool", timeout_s=1.0)
        began = time.monotonic()
        with pytest.raises(
            TierUnavailableError, match=rf"ghost-pool, announced by process {os.getpid()}, running"
        ):
            NodeTier(config, ghost)
        assert time.monotonic() - began >= 0.9, "gave up before its timeout"
    finally:
        closed.close()
        (run_dir(RAY_NS) / "ghost-pool.json").unlink(missing_ok=True)


def test_without_an_announcement_the_connector_joins_ray_instead(tier: TesseraClient) -> None:
    config = TesseraConnectorConfig(ray_namespace=RAY_NS, pool="no-such-pool-here")
    assert announced_pool(config) is None
    with pytest.raises(Exception, match="no-such-pool-here"):
        open_tier(config, LAYOUT)  # the Ray road, which knows no such pool either


def test_a_read_lands_once_and_is_lent_where_it_landed(tier: TesseraClient) -> None:
    """Without a mapped reader, a local hit's bytes are copied once, by the pool into this
    engine's read slab, and handed over where they landed (lent: the next read reuses that
    memory), not copied out again."""
    road = _node_tier(tier.pools[0], nixl_staging_bytes=0)
    road.prepare_reads()
    assert road._reader is None
    keys, rows = _blocks(3, 23)
    road.store(NS, keys, rows)
    got = road.read(NS, keys, road.lookup(NS, keys))
    assert np.array_equal(got.payloads, rows)
    landed = road._read_slab.get()
    assert landed is not None
    assert got.carrier == "slab" and got.lent and not got.pinned
    assert np.shares_memory(got.payloads, landed[1])
    # The next read writes the same memory: what a caller keeps past it, it copies first.
    other, other_rows = _blocks(3, 24)
    road.store(NS, other, other_rows)
    again = road.read(NS, other, road.lookup(NS, other))
    assert np.shares_memory(again.payloads, got.payloads)
    assert np.array_equal(got.payloads, other_rows)
    road.release_reads()


def _pins(client: TesseraClient, pool: str) -> int:
    actor = client.pool(pool)
    return int(ray.get(actor.__ray_call__.remote(lambda self: len(self.svc.leases.pins))))


def test_a_read_from_the_pools_mapped_memory_is_not_copied_and_stays_pinned_until_ended(
    tier: TesseraClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the pool's memory mapped here, a hit is not copied out at all: the read hands over
    the pool's own pinned pages (checked against their seal where they lie), the pin lasts until
    the caller says it copied them (``end_reads``), and a pin that may have lapsed by then
    fails that call, so the copies are not trusted."""
    pool = tier.pools[0]
    road = _node_tier(pool)
    road.prepare_reads()
    reader = road._reader
    assert reader is not None and reader.carrier == "mapped", "no mapped reader on this node"
    keys, rows = _blocks(3, 25)
    road.store(NS, keys, rows)
    before = _pins(tier, pool)
    got = road.read(NS, keys, road.lookup(NS, keys))
    assert got.pinned and not got.lent and _every_page_matches(got)
    assert np.array_equal(got.payloads, rows)
    mapped = reader.transport.mapped_peer(reader.peer)
    assert mapped is not None
    pages = mapped.host_pages(0)
    assert pages is not None and np.shares_memory(got.payloads, pages)
    assert reader.transport.mapped_reads == 0 and reader.in_place_reads == 1
    assert _pins(tier, pool) == before + 1  # held while the caller copies
    assert road.end_reads()
    deadline = time.monotonic() + 5.0  # the unpin is sent without waiting for its answer
    while _pins(tier, pool) != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _pins(tier, pool) == before
    # A pin whose lease ends within the margin by the time the copies are done: not trusted.
    monkeypatch.setattr(pool_tier, "PIN_MARGIN_S", 1e9)
    assert road.read(NS, keys, road.lookup(NS, keys)).pinned
    assert not road.end_reads()
    assert road.end_reads()  # nothing held any more
    road.release_reads()


def _pins_back_to(client: TesseraClient, pool: str, count: int) -> None:
    deadline = time.monotonic() + 5.0  # an unpin is sent without waiting for its answer
    while _pins(client, pool) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _pins(client, pool) == count


def test_the_lookup_pins_what_this_pool_holds_and_the_read_starts_without_asking(
    tier: TesseraClient,
) -> None:
    """The scheduler's lookup pins the run this node's pool holds; the worker's read, handed
    that ticket in the step's plan, reads the pages in place without a call to the pool (no
    pin served between lookup and read) and ends the pin when its copies are done."""
    pool = tier.pools[0]
    road = _node_tier(pool)
    road.prepare_reads()
    keys, rows = _blocks(3, 31)
    road.store(NS, keys, rows)
    before = _pins(tier, pool)
    answer = road.lookup_pinned_async(NS, keys)
    assert answer is not None
    hits, ticket = answer.result(10)
    assert [h is not None for h in hits] == [True, True, True]
    assert ticket is not None and len(ticket.blocks) == 3
    assert _pins(tier, pool) == before + 1
    served = _served(tier, pool)
    got = road.read(NS, keys, [h for h in hits if h is not None], ticket)
    assert got.pinned and _every_page_matches(got) and np.array_equal(got.payloads, rows)
    assert _served(tier, pool).get("pin", 0) == served.get("pin", 0)
    assert road.lookup_pins == 1
    assert road.end_reads()
    _pins_back_to(tier, pool, before)
    road.release_reads()


def test_a_lookup_pin_no_read_can_use_is_ended_not_left_to_its_lease(
    tier: TesseraClient,
) -> None:
    """A ticket for other blocks than the read asks for, or handed to a reader that cannot
    read in place, is ended at once and the read goes its usual way; a miss pins nothing."""
    pool = tier.pools[0]
    keys, rows = _blocks(3, 32)
    before = _pins(tier, pool)
    missed = _node_tier(pool).lookup_pinned_async(NS, _blocks(2, 33)[0])
    assert missed is not None and missed.result(10) == ([None, None], None)
    for road, ask in ((_node_tier(pool), keys[:2]), (_node_tier(pool, nixl_staging_bytes=0), keys)):
        road.prepare_reads()
        road.store(NS, keys, rows)
        answer = road.lookup_pinned_async(NS, keys)
        assert answer is not None
        hits, ticket = answer.result(10)
        assert ticket is not None
        got = road.read(NS, ask, [h for h in hits if h is not None][: len(ask)], ticket)
        assert np.array_equal(got.payloads, rows[: len(ask)])
        assert road.lookup_pins == 0
        road.end_reads()
        _pins_back_to(tier, pool, before)
        road.release_reads()
