"""Descriptor lists of the NIXL transport: one descriptor per page slot of every layer group.

Pure arithmetic over addresses, apart from the agent, so the layout a prepared list is built
with (groups concatenated, group ``g``'s slot ``s`` at ``offsets[g] + s``) is in one place.
"""

from __future__ import annotations

import numpy as np

__all__ = ["memory_of", "slot_descs"]


def memory_of(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a torch device string (``"cuda:1"``, ``"cpu"``)."""
    if device.startswith("cuda"):
        _, _, idx = device.partition(":")
        return "VRAM", int(idx or 0)
    return "DRAM", 0


def slot_descs(regions: list[tuple[int, int, int]], dev: int) -> tuple[np.ndarray, list[int]]:
    """Nx3 ``(address, length, device)``, one row per page slot of every ``(base, num_pages,
    page_bytes)`` region, and each region's first row."""
    rows, offsets = [], []
    start = 0
    for base, num_pages, page_bytes in regions:
        descs = np.empty((num_pages, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_bytes)
        descs[:, 1] = page_bytes
        descs[:, 2] = dev
        rows.append(descs)
        offsets.append(start)
        start += num_pages
    return np.concatenate(rows), offsets
