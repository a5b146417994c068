"""Comparing, zeroing, copying and viewing whole page rows.

``memoryview ==`` compares item by item and ``bytes(a) == bytes(b)`` copies both pages; libc
``memcmp`` on the two addresses runs near memory bandwidth, which keeps a dedup hit (hash +
compare) cheap (docs/measured-choices.md). Gathers and scatters of rows on a device run on an
8-byte-word view of the rows (:func:`as_words`): torch moves one element per index step and
thread, so a ``uint8`` row moves a byte at a time where an ``int64`` row moves eight.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

__all__ = ["as_words", "equal_bytes", "copy_rows", "zero_row"]


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - platforms without a global libc
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_int
    return fn


_MEMCMP = _load_memcmp()
_MEMMOVE = ctypes.memmove


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``uint8 [n, row_bytes]``) viewed as ``int64 [n, row_bytes // 8]`` when its
    layout allows (rows of whole, aligned 8-byte words), else ``rows`` itself; the same bytes
    either way, so a gather or scatter of whole rows may use whichever it gets."""
    if (
        rows.dtype == torch.uint8
        and rows.dim() == 2
        and rows.shape[1] % 8 == 0
        and rows.stride(1) == 1
        and (rows.shape[0] <= 1 or rows.stride(0) % 8 == 0)
        and rows.storage_offset() % 8 == 0
        and rows.data_ptr() % 8 == 0
    ):
        return rows.view(torch.int64)
    return rows


def equal_bytes(data: torch.Tensor, a: int, b: int) -> bool:
    """True when rows ``a`` and ``b`` of the contiguous ``uint8`` matrix ``data`` are equal."""
    if _MEMCMP is not None and data.device.type == "cpu":
        row = data.shape[1]
        base = data.data_ptr()
        return bool(_MEMCMP(base + a * row, base + b * row, row) == 0)
    return bool(torch.equal(data[a], data[b]))


def zero_row(data: torch.Tensor, index: int) -> None:
    """Zero row ``index`` of the contiguous ``uint8`` matrix ``data``.

    On host memory ``ctypes.memset``: torch's ``zero_`` on one row pays its dispatch and
    thread-pool overhead, which dwarfs writing the row's bytes.
    """
    if data.device.type == "cpu":
        row = data.shape[1]
        ctypes.memset(data.data_ptr() + index * row, 0, row)
    else:
        data[index].zero_()


def copy_rows(dst: torch.Tensor, slots: list[int], src: torch.Tensor) -> None:
    """``dst[slots[i]] = src[i]`` for every row, as few memcpy calls as possible.

    Runs of consecutive slots (what a fresh or recently drained free list hands out) become one
    ``memmove`` each; ``index_copy_`` is the fallback for device memory or non-contiguous input,
    on 8-byte words into device memory.
    """
    if (
        _MEMMOVE is None
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not src.is_contiguous()
    ):
        index = torch.tensor(slots, dtype=torch.long, device=dst.device)
        moved = src.to(dst.device)
        if dst.device.type != "cpu":
            wide_dst, wide_src = as_words(dst), as_words(moved)
            if wide_dst.dtype == wide_src.dtype:
                dst, moved = wide_dst, wide_src
        dst.index_copy_(0, index, moved)
        return
    row = dst.shape[1]
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            _MEMMOVE(dst_base + slots[start] * row, src_base + start * row, (i - start) * row)
            start = i
