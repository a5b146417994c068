"""Scatter whole pages into a pool tensor with as few copies as possible."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["scatter_rows", "gather_rows"]


def scatter_rows(dst: torch.Tensor, slots: list[int], src: np.ndarray) -> None:
    """``dst[slots[i]] = src[i]``; runs of consecutive slots become one ``memmove``.

    ``src`` may be read-only (Ray hands object-store arrays out that way), which ``torch``
    refuses to wrap without a copy; on host memory the raw addresses avoid both.
    """
    if dst.device.type != "cpu" or not src.flags.c_contiguous:
        index = torch.tensor(slots, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, index, torch.tensor(src).to(dst.device))
        return
    row = dst.shape[1]
    dst_base, src_base = dst.data_ptr(), src.ctypes.data
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            ctypes.memmove(dst_base + slots[start] * row, src_base + start * row, (i - start) * row)
            start = i


def gather_rows(dst: torch.Tensor, local: list[int], src_address: int, remote: list[int]) -> None:
    """``dst[local[i]] = src[remote[i]]``, ``src`` a host matrix of ``dst``'s row size at
    ``src_address`` (another pool's mapped memory, read-only here); runs consecutive on both
    sides (what a fresh free list and a block's pages usually are) become one ``memmove``."""
    row = dst.shape[1]
    dst_base = dst.data_ptr()
    n = len(local)
    start = 0
    for i in range(1, n + 1):
        if i == n or local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1:
            ctypes.memmove(
                dst_base + local[start] * row, src_address + remote[start] * row, (i - start) * row
            )
            start = i
