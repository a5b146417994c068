"""``tessera-ray start`` / ``stop``: run the tier on a running Ray cluster (Ray imported
lazily here, so ``tessera-ray size`` stays fast and Ray-free).

``start`` joins the cluster ``ray start`` runs on this machine (or ``--address``) and never
starts a Ray of its own: the tier's detached actors would die with that Ray when the command
exits. An embedded Ray is for ``make demo``, tests and :meth:`TesseraClient.start` in a
long-lived process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tessera_ray._cli_config import UsageError, add_geometry_options, model_config

__all__ = ["add_tier_commands"]


def _join(address: str) -> str:
    """Connect this process to the running Ray cluster at ``address``; its address."""
    import logging

    import ray

    try:
        if not ray.is_initialized():  # a caller in-process (tests) may be connected already
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:
        raise UsageError(
            f"no running Ray cluster at --address {address!r} ({exc}); start one with "
            "`ray start --head --node-ip-address 127.0.0.1` or pass the address of one"
        ) from None
    return str(ray.get_runtime_context().gcs_address)


def _cmd_start(ns: argparse.Namespace) -> int:
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.layout import build_layout

    custom = model_config(ns, format=ns.format)
    if (ns.model is None) == (custom is None):
        raise UsageError(
            "name the tier's model with exactly one of --model, --config and --hf-config"
        )
    layout = None if custom is None else build_layout(custom)
    model = ns.model if layout is None else layout.model
    address = _join(ns.address)
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    nodes = len(alive)
    print(f"tessera-ray: joined the Ray cluster at {address} ({nodes} nodes alive)")
    config = TierConfig(
        model=model,
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
    client = TesseraClient.start(config, layout=layout, address=ns.address)
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
    start.add_argument(
        "--address",
        default="auto",
        help="Ray cluster to join (default: auto, the one `ray start` runs on this machine)",
    )
    start.add_argument("--model", help="layout preset (tessera-ray size --list)")
    add_geometry_options(start)
    start.add_argument("--format", default=None, help="storage format (default: the engine's)")
    start.add_argument("--num-blocks", type=int, required=True, help="token blocks per pool")
    start.add_argument("--device", default="cpu", help="pool memory: cpu or cuda")
    start.add_argument("--shards", type=int, default=2, help="directory shards")
    start.add_argument("--disk-root", default=None, help="disk tier root (one folder per pool)")
    start.add_argument("--disk-capacity-gib", type=float, default=64.0, help="disk tier size")
    start.add_argument("--ray-namespace", default="tessera", help="Ray namespace of the actors")
    start.set_defaults(handler=_cmd_start)
    stop = sub.add_parser("stop", help="stop the tier's actors (disk tiers stay on disk)")
    stop.add_argument("--address", default="auto", help="Ray cluster (default: auto)")
    stop.add_argument("--ray-namespace", default="tessera", help="Ray namespace of the actors")
    stop.set_defaults(handler=_cmd_stop)
