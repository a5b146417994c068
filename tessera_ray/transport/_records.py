"""The records of the transport API: what a pool publishes for its readers (:class:`PeerInfo`,
with how a process of its node maps its memory), what a transport can do, and a read's ticket
and state. Plain frozen data, cheap to pickle; :mod:`~tessera_ray.transport.base` re-exports
every name, where callers look.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tessera_ray.core.shm import SlabInfo

__all__ = [
    "TransferState",
    "TransportCapabilities",
    "PoolRegion",
    "DeviceShare",
    "MemoryShare",
    "PeerInfo",
    "TransferTicket",
]


class TransferState(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    """What a transport can do, for the chooser and for callers deciding how to fetch."""

    one_sided: bool
    """Reads need no code to run on the owner (NIXL): the owner only pins and exports."""
    cross_process: bool
    """Peers may live in other processes (False for the in-process copy)."""
    device_memory: bool
    """Pool memory on a GPU is moved without staging through the host."""
    overlaps_caller: bool = False
    """A read proceeds while the caller works (NIXL's I/O thread), so a fetch split into
    several reads verifies one while the next lands."""


@dataclass(frozen=True, slots=True)
class PoolRegion:
    """One registered pool (layer group) as a peer sees it."""

    num_pages: int
    page_bytes: int
    base_addr: int
    """Address of page 0 in the owner's process (what NIXL descriptors name)."""
    device: str = "cpu"


@dataclass(frozen=True, kw_only=True)
class DeviceShare:
    """A device pool tensor as another process opens it (CUDA IPC, through torch's tensor
    sharing). Equal when the token is: the handle is opaque."""

    token: str
    device: str
    num_pages: int
    page_bytes: int
    handle: tuple[Any, ...] = field(compare=False, repr=False)
    """The arguments of torch's ``rebuild_cuda_tensor`` for the pool tensor."""


MemoryShare = SlabInfo | DeviceShare
"""How a process of a pool's node maps one layer group's pool memory."""


@dataclass(frozen=True, kw_only=True)
class PeerInfo:
    """What a reader needs to read a pool actor's slots; published through the directory once
    per pool actor at start-up (cheap to pickle)."""

    kind: str
    """The transport kind that produced it; a peer of another kind is refused."""
    name: str
    """The transport's unique name (NIXL agent name); :class:`PageExport` names it as ``peer``."""
    fingerprint: str
    """Layout fingerprint of the registered pools: pages of different layouts never mix."""
    regions: tuple[PoolRegion, ...]
    """One per registered pool, in layer-group order (a read's ``group`` indexes it)."""
    metadata: bytes = b""
    """Backend connection data (NIXL agent metadata, with the registered memory)."""
    node: str | None = None
    """Ray node id of the owner's process; ``None``: unknown (never read through mapped
    memory)."""
    mappings: tuple[MemoryShare | None, ...] = ()
    """Per layer group, how a process on the owner's node maps its pool memory (a shared-memory
    slab, a CUDA IPC handle); ``None`` where it cannot."""
    endpoint: Any = field(default=None, compare=False)
    """Where to ask for bytes when reads are not one-sided (the Ray fallback: the owner's actor
    handle); ``None`` otherwise."""


@dataclass(frozen=True, slots=True)
class TransferTicket:
    """One read in flight; hand it to :meth:`Transport.wait`, :meth:`poll` or :meth:`abort`."""

    id: int
    peer: str
    group: int
    num_pages: int
    nbytes: int
    hash_seed: int | None = None
    """Seed of the content hashes the read takes of the pages it landed; ``None``: none."""
    mapped: bool = False
    """Carried through the peer's mapped memory (:meth:`Transport.carrier`), not the backend."""
