"""The transport's one validated configuration."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from tessera_ray.errors import TransportConfigError

__all__ = ["TransportConfig", "TransportKind", "TRANSPORT_KINDS", "SameNode", "SAME_NODE_MODES"]

TransportKind = Literal["auto", "nixl", "ray", "local"]
TRANSPORT_KINDS: tuple[str, ...] = ("auto", "nixl", "ray", "local")
SameNode = Literal["auto", "mapped", "backend"]
SAME_NODE_MODES: tuple[str, ...] = ("auto", "mapped", "backend")


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Which transport moves pages between pools, and how long a transfer may take."""

    kind: TransportKind = "auto"
    """``"nixl"`` (one-sided reads over UCX), ``"ray"`` (the Ray object store), ``"local"``
    (same process, a copy), or ``"auto"``: NIXL when it starts, else Ray, with the reason logged
    and counted (:func:`tessera_ray.transport.fallback_counts`)."""
    timeout_s: float = 10.0
    """Default time a :meth:`Transport.wait` or a verified fetch may take before it is aborted
    and its slots returned."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """NIXL backend plugins the agent creates (UCX moves host and device memory)."""
    nixl_num_threads: int = 0
    """Worker threads of the NIXL backend; 0 keeps the backend's default."""
    fetch_chunk_bytes: int | None = None
    """A verified fetch over a transport whose reads overlap the caller (NIXL) is split into
    reads of about this many bytes, so verifying and sealing one overlaps reading the next
    (each is still one request over many slots). 0 reads everything in one request. ``None``
    picks by the CPUs this process may use (:attr:`chunk_bytes`): 4 MiB with 4 or more, else
    0. With 2, the READ's copy and the hashing share both cores and the memory bus, so the
    overlap never came (docs/measured-choices.md)."""
    hash_chunk_bytes: int = 512 << 10
    """A NIXL read that hashes what it lands (every verified fetch from a host pool) is posted
    as requests of about this many bytes, each page hashed right after its request completes,
    on the I/O thread that copied it, while the bytes are likely still in that core's cache
    (docs/verified-fetch-probes.md). 0 posts each part as one request."""
    nixl_progress_delay_us: int = 200
    """Pause of the NIXL progress thread between two progress calls. NIXL's Python API starts
    it at 0, which spins one core per agent even when idle (on a small node with several pools
    that starves everything else); the pause adds at most itself to a transfer's completion,
    well under an actor round trip (docs/measured-choices.md). 0 restores the spinning
    thread."""
    nixl_agent_on_demand: bool = False
    """Start the NIXL agent (and its progress thread) only when something needs it: this
    transport's metadata asked for, or a peer added that cannot be read through mapped memory.
    A reader whose peers are all on its node then never runs an agent at all (the vLLM
    connector's workers, which read from their node's pool). Such a transport publishes no
    agent in its own peer info until one runs (a reader is read from by nobody). ``False``
    starts it at once, so a missing backend is refused at construction (what a pool, whose
    agent its peers read from, wants)."""

    same_node: SameNode = "auto"
    """How pages move from a pool on the same node (same Ray node id): ``"auto"`` maps the
    owner's pool memory once (its shared-memory slab, or CUDA IPC for device pools) and reads
    are a copy out of it, with the backend (NIXL) carrying the reads of a peer whose memory
    cannot be mapped (logged and counted as a fallback); ``"mapped"`` refuses such a peer and
    any peer on another node; ``"backend"`` never maps (docs/same-node.md)."""

    def __post_init__(self) -> None:
        if self.kind not in TRANSPORT_KINDS:
            raise TransportConfigError(
                f"kind must be one of {', '.join(TRANSPORT_KINDS)}, got {self.kind!r}"
            )
        if self.same_node not in SAME_NODE_MODES:
            raise TransportConfigError(
                f"same_node must be one of {', '.join(SAME_NODE_MODES)}, got {self.same_node!r}"
            )
        _positive("timeout_s", self.timeout_s)
        if not self.nixl_backends or not all(isinstance(b, str) and b for b in self.nixl_backends):
            raise TransportConfigError(
                f"nixl_backends must be non-empty backend names, got {self.nixl_backends!r}"
            )
        if isinstance(self.nixl_num_threads, bool) or not isinstance(self.nixl_num_threads, int):
            raise TransportConfigError(
                f"nixl_num_threads must be an int, got {self.nixl_num_threads!r}"
            )
        if (
            isinstance(self.hash_chunk_bytes, bool)
            or not isinstance(self.hash_chunk_bytes, int)
            or self.hash_chunk_bytes < 0
        ):
            raise TransportConfigError(
                f"hash_chunk_bytes must be an int >= 0, got {self.hash_chunk_bytes!r}"
            )
        chunk = self.fetch_chunk_bytes
        if chunk is not None:
            if isinstance(chunk, bool) or not isinstance(chunk, int):
                raise TransportConfigError(
                    f"fetch_chunk_bytes must be an int or None, got {chunk!r}"
                )
            if chunk < 0:
                raise TransportConfigError(f"fetch_chunk_bytes must be >= 0, got {chunk}")
        if (
            isinstance(self.nixl_progress_delay_us, bool)
            or not isinstance(self.nixl_progress_delay_us, int)
            or not 0 <= self.nixl_progress_delay_us <= 1_000_000
        ):
            raise TransportConfigError(
                f"nixl_progress_delay_us must be an int in [0, 1000000], "
                f"got {self.nixl_progress_delay_us!r}"
            )
        if not isinstance(self.nixl_agent_on_demand, bool):
            raise TransportConfigError(
                f"nixl_agent_on_demand must be a bool, got {self.nixl_agent_on_demand!r}"
            )
        if self.nixl_num_threads < 0:
            raise TransportConfigError(
                f"nixl_num_threads must be >= 0, got {self.nixl_num_threads}"
            )

    @property
    def chunk_bytes(self) -> int:
        """``fetch_chunk_bytes``, with ``None`` resolved for the CPUs this process may use."""
        if self.fetch_chunk_bytes is not None:
            return self.fetch_chunk_bytes
        return AUTO_CHUNK_BYTES if usable_cpus() >= AUTO_CHUNK_MIN_CPUS else 0


AUTO_CHUNK_BYTES = 4 << 20
AUTO_CHUNK_MIN_CPUS = 4
"""Below it a fetch reads in one request: the copy, the progress thread and the hashing
would share too few cores for a split read to overlap anything."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TransportConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    if value <= 0:
        raise TransportConfigError(f"{name} must be positive, got {value}")
