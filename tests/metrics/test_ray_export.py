"""Metrics reach the head node's Prometheus endpoint: forced dedup collisions, one quarantined
disk record, a transfer and directory lookups, each found with its expected value."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tessera_ray.actors.client import POOL_PREFIX, PoolActor, TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import DirectoryStats, Tier
from tessera_ray.actors.messages import PoolStatus
from tessera_ray.core import content_seed, token_key
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.metrics import exported_names
from tessera_ray.metrics_scrape import Samples, total
from tessera_ray.metrics_scrape import scrape_until as _scrape_until
from tests.conftest import SimCluster
from tests.metrics._weak_hash import weak_hash

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla", num_layers=2, num_heads=4))
NAMESPACE = "tessera-test-metrics"
SCRAPE_DEADLINE_S = 40.0


def keys(ns: str, n: int, salt: int) -> list[bytes]:
    return [token_key(ns, LAYOUT.fingerprint, None, [salt * 1000 + i] * 64) for i in range(n)]


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)


def expected_seal_counts(ns: str, payloads: np.ndarray) -> tuple[int, int]:
    """(dedup hits, collisions) of sealing these blocks' pages in order under the weak hash,
    computed from the bytes alone: equal bytes share, a hash match with other bytes collides."""
    (group,) = LAYOUT.groups
    page_bytes = LAYOUT.block_bytes // len(group.layers)
    seed = content_seed(ns, LAYOUT.fingerprint)
    index: dict[int, list[bytes]] = defaultdict(list)
    hits = collisions = 0
    for row in payloads:
        for i in range(len(group.layers)):
            page = row[i * page_bytes : (i + 1) * page_bytes].tobytes()
            digest = weak_hash(memoryview(page), seed)
            if page in index[digest]:
                hits += 1
                continue
            collisions += bool(index[digest])
            index[digest].append(page)
    return hits, collisions


def node_ports(head_port: int) -> list[int]:
    """Every alive node's metrics port: the head's is the fixture's; actors placed with soft
    affinity (directory shards) may still land on another simulated node."""
    ports = [int(n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]]
    assert head_port in ports
    return ports


def value(samples: Samples, name: str, **labels: str) -> float | None:
    # Other tests' tiers share the cluster: only this test's namespace.
    return total(samples, name, ray_namespace=NAMESPACE, **labels)


def scrape_until(ports: list[int], ready: Callable[[Samples], bool]) -> Samples:
    return _scrape_until(ports, ready, SCRAPE_DEADLINE_S)


def test_metrics_reach_the_nodes_prometheus_endpoint(
    tessera_cluster: SimCluster, tmp_path: Path
) -> None:
    head = tessera_cluster.node_ids[0]
    pool_cfg = PoolServiceConfig(
        num_blocks=24, disk_root=tmp_path / "disk", lease_s=5.0, metrics_interval_s=0.5
    )
    config = TierConfig(
        model="tiny-mla", pool=pool_cfg, num_shards=2, ray_namespace=NAMESPACE, pools_per_node=2
    )
    tier = TesseraClient.start(config, layout=LAYOUT, pools_on=[head])
    # A third pool on the head node seals with a 4-bit hash, so distinct pages collide.
    weak = f"{POOL_PREFIX}weak-0"
    weak_actor = PoolActor.options(  # type: ignore[attr-defined]
        name=weak,
        namespace=NAMESPACE,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
    ).remote(weak, LAYOUT, pool_cfg, NAMESPACE, config.num_shards, content_hash=weak_hash)
    ray.get(weak_actor.ready.remote())
    tier = TesseraClient(tier.config, LAYOUT, [*tier.pools, weak])
    try:
        _workload_and_check(tier, tessera_cluster.metrics_export_port, weak, tmp_path / "disk")
    finally:
        tier.stop()


def _workload_and_check(tier: TesseraClient, port: int, weak: str, disk: Path) -> None:
    src, dst = tier.pools[:2]
    # 1. Forced collisions (and one duplicate block: dedup hits) on the weak pool.
    data = blocks(12, 1)
    data = np.concatenate([data, data[:1]])
    tier.store("collide", keys("collide", 13, 1), data, pool=weak)
    hits, collisions = expected_seal_counts("collide", data)
    assert collisions > 0 and hits == 2
    # 2. One corrupt disk record: spill a block, flip a byte of its segment, read it back.
    spill_key = keys("integrity", 1, 2)
    tier.store("integrity", spill_key, blocks(1, 2), pool=src)
    assert len(tier.evict(src, 24).spilled) == 1
    (segment,) = [p for p in (disk / src).rglob("blocks/segments/*") if p.is_file()]
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the payload: the record's checksum no longer matches
    segment.write_bytes(bytes(raw))
    assert tier.read("integrity", spill_key, pool=src) == [None]  # never served
    # 3. A transfer between pools, and one key the owner does not hold (a transfer error).
    moved = keys("xfer", 2, 3)
    tier.store("xfer", moved, blocks(2, 3), pool=src)
    assert set(tier.fetch("xfer", moved, into=dst).fetched) == set(moved)
    absent = keys("xfer", 1, 4)
    assert ray.get(tier.pool(dst).fetch_from.remote(src, "xfer", absent)) != [None]

    tier.flush_metrics()
    pools, shards = tier.status()
    status = {p.name: p for p in pools if isinstance(p, PoolStatus)}
    dir_stats = [s for s in shards if isinstance(s, DirectoryStats)]
    assert len(status) == 3 and len(dir_stats) == 2
    assert status[weak].collisions == collisions and status[weak].dedup_hits == hits
    assert status[src].quarantines == 1
    lookups = sum(s.lookups for s in dir_stats)
    hits_dir = sum(s.hits for s in dir_stats)

    def ready(s: Samples) -> bool:
        return (
            value(s, "tessera_dedup_collisions_total", pool=weak) == collisions
            and value(s, "tessera_disk_quarantines_total", pool=src) == 1
            and value(s, "tessera_transfer_latency_seconds_count", pool=dst) == 2
            and value(s, "tessera_directory_lookups_total") == lookups
            and value(s, "tessera_blocks", pool=src, tier="memory") is not None
        )

    s = scrape_until(node_ports(port), ready)
    assert value(s, "tessera_dedup_collisions_total", pool=weak) == collisions
    assert value(s, "tessera_dedup_hits_total", pool=weak) == hits
    page_bytes = LAYOUT.block_bytes // len(LAYOUT.groups[0].layers)
    assert value(s, "tessera_dedup_bytes_saved_total", pool=weak) == hits * page_bytes
    assert value(s, "tessera_dedup_collisions_total", pool=src) is None  # none on xxh3-128
    assert value(s, "tessera_disk_quarantines_total", pool=src) == 1
    assert value(s, "tessera_blocks_spilled_total", pool=src) == 1
    assert value(s, "tessera_evictions_total", pool=src) == status[src].evictions > 0
    assert value(s, "tessera_transfer_bytes_total", pool=dst) == 2 * LAYOUT.block_bytes
    # Both fetches pinned over src's channel; nobody knocked without the secret.
    assert value(s, "tessera_channel_pins_total", pool=src) == status[src].channel_pins == 2
    assert value(s, "tessera_channel_refused_total", pool=src) is None
    assert value(s, "tessera_transfer_errors_total", pool=dst) == 1
    assert value(s, "tessera_transfer_latency_seconds_count", pool=dst) == 2
    assert value(s, "tessera_directory_lookups_total") == lookups
    assert value(s, "tessera_directory_hits_total") == hits_dir
    assert (value(s, "tessera_directory_misses_total") or 0) == lookups - hits_dir
    for name, st in status.items():
        for tier_name, tier in (("memory", Tier.MEMORY), ("disk", Tier.DISK)):
            labels = {"pool": name, "tier": tier_name}
            assert value(s, "tessera_pages_used", **labels) == st.pages_used[tier]
            assert value(s, "tessera_pages_free", **labels) == st.pages_free[tier]
            assert value(s, "tessera_blocks", **labels) == st.tier_counts[tier]
        assert value(s, "tessera_pool_heartbeat_timestamp_seconds", pool=name) is not None
    assert status[weak].pages_used[Tier.MEMORY] == 2 * 13 - hits
    if status[dst].transport == "nixl":  # NIXL worked: nothing fell back
        assert value(s, "tessera_transport_fallbacks_total", pool=dst) is None
    # Every tessera sample on the endpoint is a declared metric.
    assert {n for n in s if "tessera_" in n} <= exported_names(ray=True)
