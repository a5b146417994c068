"""Where the tier's Ray actors are started, found and stopped: Ray itself (an embedded local
Ray when none is connected), the directory shards and the pools with their actor options, and
the node this process runs on. :class:`~tessera_ray.actors.client.TesseraClient`'s ``start``,
``connect`` and ``stop`` call these; what to start where is worked out without Ray in
:mod:`~tessera_ray.actors._client_nodes`.

Actor names: ``tessera-dir-<i>`` and ``tessera-pool-<node>-<i>`` in the tier's Ray namespace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tessera_ray.actors._client_nodes import inherited_raylet_node, pool_specs
from tessera_ray.actors._ray_handles import POOL_PREFIX, ActorCache, PoolRef, shard_name
from tessera_ray.actors.config import TierConfig
from tessera_ray.actors.directory_actor import DirectoryActor
from tessera_ray.actors.pool_actor import PoolActor
from tessera_ray.errors import PoolUnavailableError
from tessera_ray.layout import ModelLayout, preset_layout

__all__ = ["Deployment", "start_tier", "connect_tier", "stop_tier", "this_node"]


def this_node() -> str:
    """The Ray node this process runs on. A process started under a Ray worker (vLLM's engine
    core under a Serve replica) that joins Ray as a driver of its own is attached to a node by
    address: the head's, where several nodes share a host. The node whose raylet started the
    worker it descends from is the one it runs on; Ray passes that raylet down to children."""
    return (
        os.environ.get("RAY_NODE_ID")
        or inherited_raylet_node()
        or ray.get_runtime_context().get_node_id()
    )


@dataclass(frozen=True, slots=True)
class Deployment:
    """A running tier, as a client needs it: its settings, layout and pools by name."""

    config: TierConfig
    layout: ModelLayout
    pools: list[str]
    owns_ray: bool
    """True when :func:`start_tier` started the embedded Ray; :func:`stop_tier` then shuts it
    down."""


def start_tier(
    config: TierConfig,
    *,
    layout: ModelLayout | None,
    address: str | None,
    pools_on: Sequence[str] | None,
    quiet: bool,
    tenant_secret: bytes | None,
) -> Deployment:
    """Start (or find, by name) the directory shards on this node and the pools on every alive
    node, or on the node ids in ``pools_on``; wait until every pool answers. See
    :meth:`~tessera_ray.actors.client.TesseraClient.start` for the parameters."""
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(
            address=address or "local",
            namespace=config.ray_namespace,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.ERROR,
            log_to_driver=not quiet,
        )
    layout = layout or preset_layout(config.model, format=config.format)
    here = ray.get_runtime_context().get_node_id()
    # What goes where first: a configuration that cannot run refuses before anything starts.
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]
    nodes = list(pools_on) if pools_on is not None else list(alive)
    specs = pool_specs(config, nodes, alive, POOL_PREFIX)
    for i in range(config.num_shards):
        DirectoryActor.options(  # type: ignore[attr-defined]
            name=shard_name(i),
            namespace=config.ray_namespace,
            lifetime="detached",
            max_restarts=-1,
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        ).remote(
            i,
            config.num_shards,
            config.ray_namespace,
            config.health_interval_s,
            config.pool.metrics_interval_s,
            tenant_secret,
        )
    handles = [
        PoolActor.options(  # type: ignore[attr-defined]
            name=spec.name,
            namespace=config.ray_namespace,
            lifetime="detached",
            get_if_exists=True,
            num_gpus=spec.num_gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(spec.node, soft=False),
        ).remote(
            spec.name,
            layout,
            spec.config,
            config.ray_namespace,
            config.num_shards,
            None,
            tenant_secret,
        )
        for spec in specs
    ]
    ray.get([h.ready.remote() for h in handles])
    # Only a Ray this call started locally is this client's to shut down.
    return Deployment(config, layout, [s.name for s in specs], owns_ray and address is None)


def connect_tier(ray_namespace: str, *, address: str | None) -> Deployment:
    """Find a running tier by its actors' names; its layout and settings are asked of a pool
    (never the tenant secret, which no actor hands out)."""
    if not ray.is_initialized():
        # log_to_driver off: a process that attaches (an engine's scheduler and workers, a
        # client) is a Ray driver, and would otherwise stream every worker's log of the whole
        # cluster to its own output, on a thread of its own.
        ray.init(
            address=address or "auto",
            namespace=ray_namespace,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
    named = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == ray_namespace
    ]
    pools = sorted(n for n in named if n.startswith(POOL_PREFIX))
    if not pools:
        raise PoolUnavailableError(
            f"no tessera-ray pools in Ray namespace {ray_namespace!r}; start the tier first "
            f"(tessera-ray start)"
        )
    layout, pool_cfg, num_shards = PoolRef(ActorCache(ray_namespace), pools[0]).describe_now()
    config = TierConfig(
        model=layout.model, pool=pool_cfg, num_shards=num_shards, ray_namespace=ray_namespace
    )
    return Deployment(config, layout, pools, owns_ray=False)


def stop_tier(config: TierConfig, pools: Sequence[str], *, owns_ray: bool) -> None:
    """Kill the tier's actors (the disk tiers stay on disk), and Ray if ``owns_ray``."""
    for name in [*pools, *(shard_name(i) for i in range(config.num_shards))]:
        try:
            ray.kill(ray.get_actor(name, namespace=config.ray_namespace), no_restart=True)
        except ValueError:
            pass  # not running (never started, or already stopped)
    if owns_ray:
        ray.shutdown()
