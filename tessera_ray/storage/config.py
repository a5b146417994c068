"""Validated configurations of the storage tiers (units in names, one docstring per field)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessera_ray.errors import StorageConfigError

__all__ = ["DiskTierConfig", "HostTierConfig"]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise StorageConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DiskTierConfig:
    """Configuration of one :class:`~tessera_ray.storage.DiskTier` root."""

    root: Path
    """Directory of the tier; created if missing. One process opens it at a time."""
    capacity_bytes: int
    """Most bytes the tier's segment files may occupy; least recently used batches go first."""
    fingerprint: str
    """Layout fingerprint (``ModelLayout.fingerprint``); a root holds one layout only."""
    namespace: str = "default"
    """Tenant namespace keying the content hash (with the fingerprint)."""
    segment_max_bytes: int = 64 << 20
    """A batch larger than this is written as several segment files (bounds one write)."""
    io_threads: int = 4
    """Threads doing file IO, hashing and checksums off the event loop; each keeps one read in
    flight. More threads than cores are not faster: each thread's verification competes for
    the cores the others need to keep their reads in flight (docs/measured-choices.md). Each
    staged direct transfer holds one staging buffer while it runs."""
    direct_io: bool | None = None
    """Read and write segments around the page cache (``O_DIRECT``). None (the default): direct
    where the root's filesystem supports it, else buffered; True: required (opening a root on a
    filesystem without it fails); False: buffered.

    Why direct by default: the tier sits under a memory pool that caches the hot pages, so a
    second copy in the page cache competes with the pool for RAM, and through the page cache
    buffered segment writes fell short of a raw append; buffered I/O wins only where pages are
    restored right after they spill (docs/measured-choices.md)."""
    progress: bool | None = None
    """Force the progress line shown while a root is opened on (True) or off (False); None:
    shown on a TTY stderr when the root holds many segment files."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        _positive("capacity_bytes", self.capacity_bytes)
        _positive("segment_max_bytes", self.segment_max_bytes)
        _positive("io_threads", self.io_threads)
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise StorageConfigError(
                f"direct_io must be None, True or False, got {self.direct_io!r}"
            )
        if not self.fingerprint:
            raise StorageConfigError("fingerprint must be a non-empty layout fingerprint")


@dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    """Configuration of a :class:`~tessera_ray.storage.HostMemoryTier`."""

    capacity_bytes: int
    """Size of the one host slab; pinned when CUDA is available."""
    slot_bytes: int
    """Size of one slot; every page must fit in one (the pool's page size)."""
    pin_memory: bool | None = None
    """Pin the slab (page-locked, for fast device copies); None: pin when CUDA is available."""

    def __post_init__(self) -> None:
        _positive("capacity_bytes", self.capacity_bytes)
        _positive("slot_bytes", self.slot_bytes)
        if self.slot_bytes > self.capacity_bytes:
            raise StorageConfigError(
                f"slot_bytes ({self.slot_bytes}) exceeds capacity_bytes ({self.capacity_bytes})"
            )

    @property
    def num_slots(self) -> int:
        return self.capacity_bytes // self.slot_bytes
