"""Host memory for pages: page-aligned anonymous mappings that ask for transparent huge pages.

Why not ``torch.zeros`` or ``bytes``: torch aligns host tensors to 64 B only, and ``O_DIRECT``
reads need block-aligned buffers. From a page boundary every page of a size that is whole
512 B blocks (MLA: 73,728 B) is aligned, so the disk tier reads pages straight into them with
no staging copy. Huge pages keep the memory physically contiguous in 2 MiB runs, so a direct
read into it is a few large device transfers rather than one per 4 KiB page: reading 2,048 MLA
pages back from the disk tier (13 interleaved rounds, this VM) ran at 0.90 of a raw cold read
into huge pages, 0.80 into a fresh 4 KiB-page tensor and 0.58 into a ``torch.zeros`` pool
allocated early (its pages scattered). Where the kernel has no transparent huge pages the
mappings are plain pages, still aligned.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

__all__ = ["aligned_host_bytes", "aligned_host_zeros", "buffer_address"]


def aligned_host_bytes(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed, page-aligned host memory (faulted in on first touch)."""
    if nbytes <= 0:
        raise ValueError(f"cannot map {nbytes} B; ask for at least one byte")
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: plain pages still work
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mapping)  # the view keeps the mapping alive


def aligned_host_zeros(num_pages: int, page_bytes: int) -> torch.Tensor:
    """Zeroed ``[num_pages, page_bytes]`` uint8 host tensor over :func:`aligned_host_bytes`,
    every page faulted in now (as ``torch.zeros`` does), not on first use."""
    flat = torch.frombuffer(aligned_host_bytes(num_pages * page_bytes), dtype=torch.uint8)
    flat.zero_()
    return flat.view(num_pages, page_bytes)


def buffer_address(view: memoryview) -> int:
    """Address of a writable buffer's first byte (what direct IO alignment is judged on)."""
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c  # releases the export, so the buffer can be resized or closed later
