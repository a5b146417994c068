"""Pool and directory snapshots as metrics (the actor shells call these periodically).

Instrumenting from snapshots keeps ``core``, ``storage`` and ``transport`` free of metrics
calls: they keep their own cumulative counters, and these functions turn each snapshot into
gauge values and counter increments (:meth:`~tessera_ray.metrics.Metrics.set_total`).
"""

from __future__ import annotations

import time

from tessera_ray.actors.directory import DirectoryStats, Tier
from tessera_ray.actors.messages import PoolStatus
from tessera_ray.metrics import Metrics

__all__ = ["export_pool_status", "export_directory_stats", "pool_tags"]

_TIER_NAMES = {Tier.MEMORY: "memory", Tier.DISK: "disk"}


def pool_tags(ray_namespace: str, pool: str, node: str) -> dict[str, str]:
    return {"ray_namespace": ray_namespace, "pool": pool, "node": node}


def export_pool_status(
    metrics: Metrics,
    status: PoolStatus,
    ray_namespace: str,
    fallbacks: dict[tuple[str, str, str], int] | None = None,
) -> None:
    """Record one pool snapshot (and this process's transport fallbacks, if given)."""
    tags = pool_tags(ray_namespace, status.name, status.node)
    stored = {
        Tier.MEMORY: status.blocks_in_memory * status.block_bytes,
        Tier.DISK: status.disk_bytes,
    }
    for tier, name in _TIER_NAMES.items():
        if tier not in status.pages_used:
            continue  # no such tier on this pool (no disk root)
        tier_tags = {**tags, "tier": name}
        metrics.set("tessera_pages_used", status.pages_used[tier], tier_tags)
        metrics.set("tessera_pages_free", status.pages_free.get(tier, 0), tier_tags)
        metrics.set("tessera_blocks", status.tier_counts.get(tier, 0), tier_tags)
        metrics.set("tessera_bytes_stored", stored[tier], tier_tags)
    metrics.set("tessera_pool_heartbeat_timestamp_seconds", time.time(), tags)
    metrics.set_total("tessera_dedup_hits", status.dedup_hits, tags)
    metrics.set_total("tessera_dedup_bytes_saved", status.bytes_saved_by_dedup, tags)
    metrics.set_total("tessera_dedup_collisions", status.collisions, tags)
    metrics.set_total("tessera_evictions", status.evictions, tags)
    metrics.set_total("tessera_blocks_spilled", status.spills, tags)
    metrics.set_total("tessera_blocks_lost", status.lost_blocks, tags)
    metrics.set_total("tessera_disk_quarantines", status.quarantines, tags)
    metrics.set_total("tessera_memory_rotten_blocks", status.rotten_blocks, tags)
    metrics.set_total("tessera_channel_pins", status.channel_pins, tags)
    metrics.set_total("tessera_channel_refused", status.channel_refused, tags)
    metrics.set_total("tessera_transfer_mapped_bytes", status.mapped_bytes_in, tags)
    for (src, dst, reason), count in (fallbacks or {}).items():
        fb_tags = {**tags, "from_kind": src, "to_kind": dst, "reason": reason}
        metrics.set_total("tessera_transport_fallbacks", count, fb_tags)


def export_directory_stats(metrics: Metrics, stats: DirectoryStats, ray_namespace: str) -> None:
    """Record one directory-shard snapshot."""
    tags = {"ray_namespace": ray_namespace, "shard": str(stats.shard)}
    metrics.set_total("tessera_directory_lookups", stats.lookups, tags)
    metrics.set_total("tessera_directory_hits", stats.hits, tags)
    metrics.set_total("tessera_directory_misses", stats.misses, tags)
    metrics.set_total("tessera_directory_purged_pools", stats.purged_pools, tags)
    metrics.set("tessera_directory_token_keys", stats.token_keys, tags)
    metrics.set("tessera_directory_replicas", stats.replicas, tags)
