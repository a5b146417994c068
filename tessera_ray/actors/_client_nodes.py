"""Where the client's pools go, worked out without Ray: the pools to start on each node, and
the node a process descends from.

Kept apart from :mod:`~tessera_ray.actors.deploy` so these load and test without Ray; it passes
in what Ray told it (the alive nodes, the name prefix) and starts the actors itself.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.errors import TierConfigError

__all__ = ["PoolSpec", "pool_specs", "inherited_raylet_node"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool actor to start: its name, the node it is pinned to, its settings and GPUs."""

    name: str
    node: str
    config: PoolServiceConfig
    num_gpus: int


def pool_specs(
    config: TierConfig, nodes: Sequence[str], alive: Mapping[str, Mapping[str, Any]], prefix: str
) -> list[PoolSpec]:
    """The pools to start on ``nodes`` (``alive``: Ray's node records by id): one per GPU, its
    pages in device memory, on GPU nodes; ``pools_per_node`` on CPU nodes. Each pool with a
    disk tier gets a directory of its own under ``disk_root``. ``prefix``: the pools' name
    prefix, passed in because the module that defines it imports Ray.

    Raises :class:`TierConfigError` for a tier that forces same-node reads
    (``transport.same_node="mapped"``) across several nodes, before anything starts."""
    if config.pool.transport.same_node == "mapped" and len(set(nodes)) > 1:
        raise TierConfigError(
            f"transport.same_node='mapped' reads only pools of one node, but this tier spans "
            f"{len(set(nodes))} nodes; use same_node='auto' (NIXL between nodes)"
        )
    specs: list[PoolSpec] = []
    for node in nodes:
        gpus = int(alive.get(node, {}).get("Resources", {}).get("GPU", 0))
        for j in range(gpus or config.pools_per_node):
            name = f"{prefix}{node[:12]}-{j}"
            pool_cfg = config.pool
            if gpus:
                pool_cfg = dataclasses.replace(pool_cfg, device="cuda")
            if pool_cfg.disk_root is not None:
                pool_cfg = dataclasses.replace(pool_cfg, disk_root=pool_cfg.disk_root / name)
            specs.append(PoolSpec(name, node, pool_cfg, 1 if gpus else 0))
    return specs


def inherited_raylet_node() -> str | None:
    """The node id on the command line of the raylet in ``RAY_RAYLET_PID`` (set in Ray's
    workers, inherited by their children); ``None`` where there is none to read (a driver
    started by hand, a host without ``/proc``)."""
    pid = os.environ.get("RAY_RAYLET_PID")
    if not pid or not pid.isdigit():
        return None
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for arg in args:
        if arg.startswith(b"--node_id="):
            return arg.split(b"=", 1)[1].decode()
    return None
