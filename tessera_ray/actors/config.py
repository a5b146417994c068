"""Validated configuration of a pool actor and of the tier as a whole (units in names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tessera_ray.errors import TierConfigError
from tessera_ray.transport.config import TransportConfig

__all__ = ["PoolServiceConfig", "TierConfig"]


def _positive(name: str, value: float, *, integer: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TierConfigError(f"{name} must be positive, got {value!r}")
    if integer and not isinstance(value, int):
        raise TierConfigError(f"{name} must be an integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PoolServiceConfig:
    """One pool actor: how many token blocks it holds in memory, and its disk tier."""

    num_blocks: int
    """Token blocks held in memory (each block is one page per layer of every layer group)."""
    device: str = "cpu"
    """Where the pool tensors live: ``"cpu"`` or ``"cuda[:N]"``."""
    disk_root: Path | None = None
    """Root of this pool's disk tier; ``None``: no disk tier, evicted last copies are lost
    (counted in ``lost_blocks``)."""
    disk_capacity_bytes: int = 1 << 30
    """Most bytes the disk tier keeps (per namespace) before it evicts old batches."""
    lease_s: float = 30.0
    """Default lifetime of a reservation or a pin; expired ones are released."""
    max_lease_s: float = 600.0
    """Longest lease a caller may ask for."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """How this pool pulls pages from other pools (``auto``: NIXL, else the object store; a
    pool on the same node through its mapped memory, ``TransportConfig.same_node``)."""
    shared_memory_dir: Path | None = Path("/dev/shm")
    """Where a CPU pool keeps its pages, in a file other pools and connector workers of the node
    map to read them with a copy (docs/same-node.md); reserved in full when the pool starts, so
    a missing or too small directory fails the start. ``None``: private memory, every read
    from this pool over NIXL. Device pools share theirs through CUDA IPC and ignore it."""
    pin_channel: bool = True
    """Serve pins and unpins for readers on a direct TCP channel (authenticated by a secret
    passed through Ray), and use other pools' channels when fetching: a Ray actor call costs
    more than the NIXL read of a few hundred pages on small nodes (``actors/channel.py``).
    False: every pin is a Ray actor call."""
    metrics_interval_s: float = 5.0
    """How often the pool (and the directory shards) export their snapshots as metrics."""
    write_through: bool = False
    """Also put every stored block on the disk tier before the store is acknowledged (needs
    ``disk_root``): a pool process that dies then loses nothing it acknowledged, at the cost
    of a disk write on the store path. Off: memory is a cache, and only the last copy of an
    evicted block goes to disk."""

    def __post_init__(self) -> None:
        _positive("num_blocks", self.num_blocks)
        _positive("disk_capacity_bytes", self.disk_capacity_bytes)
        _positive("lease_s", self.lease_s, integer=False)
        _positive("max_lease_s", self.max_lease_s, integer=False)
        _positive("metrics_interval_s", self.metrics_interval_s, integer=False)
        if self.lease_s > self.max_lease_s:
            raise TierConfigError(f"lease_s {self.lease_s} exceeds max_lease_s {self.max_lease_s}")
        if self.disk_root is not None:
            object.__setattr__(self, "disk_root", Path(self.disk_root))
        if self.write_through and self.disk_root is None:
            raise TierConfigError("write_through needs a disk tier: set disk_root")
        if self.shared_memory_dir is not None:
            object.__setattr__(self, "shared_memory_dir", Path(self.shared_memory_dir))
        if self.transport.same_node == "mapped":
            if self.transport.kind not in ("auto", "nixl"):
                raise TierConfigError(
                    f"transport.same_node='mapped' needs transport kind 'auto' or 'nixl', "
                    f"got {self.transport.kind!r}"
                )
            if self.shared_memory_dir is None and not self.device.startswith("cuda"):
                raise TierConfigError(
                    "transport.same_node='mapped' needs shared pool memory: set "
                    "shared_memory_dir (a tmpfs such as /dev/shm)"
                )


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """The whole tier on one Ray cluster: its pools and directory shards."""

    model: str
    """Layout preset name (``tessera-ray size --list``)."""
    format: str | None = None
    """Storage format; ``None``: the model's engine format."""
    pool: PoolServiceConfig
    num_shards: int = 2
    """Directory shards (actors); token keys are split among them by their first bytes."""
    ray_namespace: str = "tessera"
    """Ray namespace holding the tier's named actors."""
    pools_per_node: int = 1
    """Pool actors per node on CPU clusters (on GPU nodes: one per GPU)."""
    health_interval_s: float = 2.0
    """How often directory shards check that pools are alive."""

    def __post_init__(self) -> None:
        _positive("num_shards", self.num_shards)
        _positive("pools_per_node", self.pools_per_node)
        _positive("health_interval_s", self.health_interval_s, integer=False)
        if not self.ray_namespace:
            raise TierConfigError("ray_namespace must be non-empty")
