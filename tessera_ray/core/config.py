"""The pool's validated configuration and the memory check made before allocating."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tessera_ray.errors import PoolConfigError, PoolMemoryError

__all__ = ["PoolConfig", "available_memory_bytes", "check_fits"]

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How many pages a :class:`~tessera_ray.core.BlockPool` holds, and where."""

    num_pages: int
    """Page slots in the pool; the pool tensor is ``num_pages x page_bytes`` bytes."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"`` / ``"cuda:N"``."""
    pin_memory: bool | None = None
    """Pin host pages for fast DMA; ``None`` pins exactly when a CPU pool runs next to a GPU."""
    max_memory_fraction: float = 0.9
    """Refuse a pool larger than this fraction of the device's available memory."""
    scrub_freed_pages: bool = True
    """Zero a page when it returns to the free list, so the next holder (maybe another tenant)
    can never read what it held. Costs one memset per freed page."""
    shared_memory_dir: str | None = None
    """Host pools only: keep the pages in a file of this shared-memory directory (a tmpfs such
    as ``/dev/shm``), so other processes of the node can map them and read pages with a copy
    instead of a network transfer (docs/same-node.md). The whole size is reserved when the
    pool starts: a missing or too small directory fails then, never later. ``None``: private
    anonymous memory."""

    def __post_init__(self) -> None:
        if isinstance(self.num_pages, bool) or not isinstance(self.num_pages, int):
            raise PoolConfigError(f"num_pages must be an int, got {self.num_pages!r}")
        if self.num_pages <= 0:
            raise PoolConfigError(f"num_pages must be positive, got {self.num_pages}")
        if self.device.split(":")[0] not in _DEVICES:
            raise PoolConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 0.0 < self.max_memory_fraction <= 1.0:
            raise PoolConfigError(
                f"max_memory_fraction must be in (0, 1], got {self.max_memory_fraction}"
            )
        if self.pin_memory and self.is_cuda:
            raise PoolConfigError("pin_memory applies to cpu pools only")
        if self.shared_memory_dir is not None:
            if not isinstance(self.shared_memory_dir, str | os.PathLike):
                raise PoolConfigError(
                    f"shared_memory_dir must be a directory path or None, got "
                    f"{self.shared_memory_dir!r}"
                )
            object.__setattr__(self, "shared_memory_dir", os.fspath(self.shared_memory_dir))
            if not self.shared_memory_dir:
                raise PoolConfigError("shared_memory_dir must be a directory path or None")
            if self.is_cuda:
                raise PoolConfigError(
                    "shared_memory_dir applies to cpu pools only (device pools are shared "
                    "through CUDA IPC)"
                )

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def resolved_pin_memory(self) -> bool:
        if self.is_cuda:
            return False
        if self.pin_memory is not None:
            return self.pin_memory
        import torch

        return bool(torch.cuda.is_available())


def available_memory_bytes(device: str) -> int:
    """Bytes the device can still give: MemAvailable on the host, free memory on a GPU."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise PoolConfigError(f"device {device!r} requested but CUDA is not available")
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    # No /proc (not Linux): fall back to physical memory, a looser but still finite bound.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(config: PoolConfig, page_bytes: int) -> None:
    """Raise :class:`PoolMemoryError` before allocating a pool the device cannot hold."""
    want = config.num_pages * page_bytes
    have = available_memory_bytes(config.device)
    limit = int(have * config.max_memory_fraction)
    if want > limit:
        raise PoolMemoryError(
            f"a pool of {config.num_pages:,} pages x {page_bytes:,} B = {want:,} B does not fit "
            f"on {config.device}: {have:,} B available, limit {limit:,} B "
            f"(max_memory_fraction={config.max_memory_fraction}); ask for at most "
            f"{limit // page_bytes:,} pages"
        )
