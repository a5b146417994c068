"""``tessera-ray start`` / ``stop``: run the tier on an existing Ray cluster (Ray imported
lazily here, so ``tessera-ray size`` stays fast and Ray-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_tier_commands"]


def _cmd_start(ns: argparse.Namespace) -> int:
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig

    config = TierConfig(
        model=ns.model,
        format=ns.format,
        pool=PoolServiceConfig(
            num_blocks=ns.num_blocks,
            device=ns.device,
            disk_root=Path(ns.disk_root) if ns.disk_root else None,
            disk_capacity_bytes=int(ns.disk_capacity_gib * (1 << 30)),
        ),
        num_shards=ns.shards,
        ray_namespace=ns.ray_namespace,
    )
    client = TesseraClient.start(config, address=ns.address)
    print(
        f"tessera-ray: {len(client.pools)} pools ({config.model}, {client.layout.block_bytes:,} B "
        f"per block, {config.pool.num_blocks:,} blocks each), {config.num_shards} directory "
        f"shards, Ray namespace {config.ray_namespace!r}"
    )
    for name in client.pools:
        print(f"  {name}")
    return 0


def _cmd_stop(ns: argparse.Namespace) -> int:
    from tessera_ray.actors.client import TesseraClient

    client = TesseraClient.connect(ns.ray_namespace, address=ns.address)
    client.stop()
    print(f"tessera-ray: stopped {len(client.pools)} pools and {client.config.num_shards} shards")
    return 0


def add_tier_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    start = sub.add_parser("start", help="start the tier on a Ray cluster (detached actors)")
    start.add_argument("--address", default=None, help="Ray address (default: auto-detect)")
    start.add_argument("--model", required=True, help="layout preset (tessera-ray size --list)")
    start.add_argument("--format", default=None, help="storage format (default: the engine's)")
    start.add_argument("--num-blocks", type=int, required=True, help="token blocks per pool")
    start.add_argument("--device", default="cpu", help="pool memory: cpu or cuda")
    start.add_argument("--shards", type=int, default=2, help="directory shards")
    start.add_argument("--disk-root", default=None, help="disk tier root (one folder per pool)")
    start.add_argument("--disk-capacity-gib", type=float, default=64.0, help="disk tier size")
    start.add_argument("--ray-namespace", default="tessera", help="Ray namespace of the actors")
    start.set_defaults(handler=_cmd_start)
    stop = sub.add_parser("stop", help="stop the tier's actors (disk tiers stay on disk)")
    stop.add_argument("--address", default=None, help="Ray address (default: auto-detect)")
    stop.add_argument("--ray-namespace", default="tessera", help="Ray namespace of the actors")
    stop.set_defaults(handler=_cmd_stop)
