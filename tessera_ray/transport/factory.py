"""Choosing the transport from config; ``auto`` falls back to Ray with a logged, counted reason."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tessera_ray.errors import TransportUnavailableError
from tessera_ray.transport._fallbacks import count_fallback, fallback_counts
from tessera_ray.transport.base import Transport
from tessera_ray.transport.config import TransportConfig
from tessera_ray.transport.local import LocalTransport
from tessera_ray.transport.nixl import NixlTransport
from tessera_ray.transport.ray_object import RayObjectTransport

__all__ = ["make_transport", "fallback_counts", "TRANSPORTS"]

log = logging.getLogger(__name__)

TRANSPORTS: dict[str, type[Transport]] = {
    "nixl": NixlTransport,
    "ray": RayObjectTransport,
    "local": LocalTransport,
}
"""Transport class per config kind (``auto`` tries ``nixl``, then ``ray``)."""


def make_transport(
    config: TransportConfig,
    *,
    name: str | None = None,
    endpoint: Any = None,
    node: str | None = None,
) -> Transport:
    """The transport ``config.kind`` names, not yet registered (call ``register(pool)``).

    ``name`` must be unique in the cluster (it becomes the NIXL agent name); a random one is
    made when omitted. ``endpoint`` is this pool's actor handle, used by the Ray fallback.
    ``node`` is the Ray node id this process runs on: peers that publish the same node are
    read through their mapped memory (``TransportConfig.same_node``); ``None`` never maps.
    """
    name = name or f"tessera-{uuid.uuid4().hex[:16]}"
    if config.kind == "auto":
        try:
            return NixlTransport(config, name=name, node=node)
        except TransportUnavailableError as e:
            reason = type(e.__cause__ or e).__name__
            log.warning(
                "transport 'auto': NIXL unavailable (%s), falling back to Ray: %s", reason, e
            )
            count_fallback("nixl", "ray", reason)
            return RayObjectTransport(config, name=name, endpoint=endpoint, node=node)
    if config.kind == "ray":
        return RayObjectTransport(config, name=name, endpoint=endpoint, node=node)
    if config.kind == "local":  # peers in this process: nothing to map
        return LocalTransport(config, name=name)
    return TRANSPORTS[config.kind](config, name=name, node=node)
