"""Moving pages between workers: NIXL one-sided reads, a local copy, the Ray object store.

Set-up, once per pool: ``t = make_transport(config, name=..., node=...)``, ``info =
t.register(pool)``, publish ``info``; each reader calls ``t.add_peers([...])``. With ``node``
(the Ray node id), peers on the same node are read through their mapped memory
(``TransportConfig.same_node``). A fetch: the owner pins the pages and returns
:func:`export_pages`; the reader calls :func:`fetch_verified`; the owner unpins.
"""

from tessera_ray.transport._mapped import MAPPED, MappedPeer
from tessera_ray.transport._records import DeviceShare, MemoryShare
from tessera_ray.transport.base import (
    PeerInfo,
    PoolRegion,
    TransferState,
    TransferTicket,
    Transport,
    TransportCapabilities,
)
from tessera_ray.transport.config import (
    SAME_NODE_MODES,
    TRANSPORT_KINDS,
    SameNode,
    TransportConfig,
    TransportKind,
)
from tessera_ray.transport.factory import TRANSPORTS, fallback_counts, make_transport
from tessera_ray.transport.fetch import (
    FailedPage,
    FailureReason,
    FetchedPage,
    PageExport,
    PageFetchResult,
    export_pages,
    fetch_verified,
    fetch_verified_many,
)
from tessera_ray.transport.local import LocalTransport
from tessera_ray.transport.nixl import NixlTransport
from tessera_ray.transport.ray_object import SERVE_METHOD, RayObjectTransport

__all__ = [
    "Transport",
    "TransportCapabilities",
    "TransportConfig",
    "TransportKind",
    "TRANSPORT_KINDS",
    "SameNode",
    "SAME_NODE_MODES",
    "MemoryShare",
    "MAPPED",
    "MappedPeer",
    "DeviceShare",
    "TRANSPORTS",
    "PeerInfo",
    "PoolRegion",
    "TransferTicket",
    "TransferState",
    "LocalTransport",
    "NixlTransport",
    "RayObjectTransport",
    "SERVE_METHOD",
    "make_transport",
    "fallback_counts",
    "PageExport",
    "export_pages",
    "PageFetchResult",
    "FetchedPage",
    "FailedPage",
    "FailureReason",
    "fetch_verified",
    "fetch_verified_many",
]
