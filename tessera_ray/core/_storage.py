"""The pool's page memory: one ``uint8 [num_pages, page_bytes]`` tensor, and a flat host view.

Kept apart from the pool's bookkeeping because where the bytes live (device, pinned host, or
page-aligned host mappings the disk tier can read into directly) is a config decision made once.
"""

from __future__ import annotations

import torch

from tessera_ray.core.config import PoolConfig, check_fits
from tessera_ray.core.hostmem import aligned_host_zeros

__all__ = ["page_storage"]


def page_storage(config: PoolConfig, page_bytes: int) -> tuple[torch.Tensor, memoryview | None]:
    """Zeroed page memory for ``config``, and for host memory a flat ``memoryview`` of it.

    The view lets xxh3 read a page in place, without a copy; slicing it is cheaper than
    building a numpy row per page. ``None`` on a device, whose bytes the CPU cannot read.
    """
    check_fits(config, page_bytes)
    pinned = config.resolved_pin_memory()
    if config.is_cuda or pinned:  # device and pinned allocations are page-aligned already
        data = torch.zeros(
            (config.num_pages, page_bytes),
            dtype=torch.uint8,
            device=config.device,
            pin_memory=pinned,
        )
    else:
        data = aligned_host_zeros(config.num_pages, page_bytes)
    host = None if config.is_cuda else data.numpy().reshape(-1).data
    return data, host
