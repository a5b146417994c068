"""Zero-copy byte comparison of two host pages.

``memoryview ==`` compares item by item and ``bytes(a) == bytes(b)`` copies both pages; libc
``memcmp`` on the two addresses runs near memory bandwidth, which keeps a dedup hit (hash +
compare) cheap (docs/measured-choices.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

__all__ = ["equal_bytes", "copy_rows", "zero_row"]


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
    ``memmove`` each; ``index_copy_`` is the fallback for device memory or non-contiguous input.
    """
    if (
        _MEMMOVE is None
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not src.is_contiguous()
    ):
        index = torch.tensor(slots, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, index, src.to(dst.device))
        return
    row = dst.shape[1]
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            _MEMMOVE(dst_base + slots[start] * row, src_base + start * row, (i - start) * row)
            start = i
