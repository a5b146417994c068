"""Direct (``O_DIRECT``) file IO for segment files: aligned staging buffers, streamed writes,
windowed reads. Used where the filesystem allows it unless ``DiskTierConfig.direct_io`` is False
(see there for when each mode wins).

Why bypass the page cache: the tier sits under a memory pool that already caches the hot
pages, so a second copy in the kernel's page cache only competes with the pool for memory, and
writing through it costs a copy plus dirty-page writeback that an fsync then waits for. The
figures that chose it are in docs/measured-choices.md (disk tier, direct I/O).

Direct IO needs the buffer, the file offset and the length aligned to the device's logical
block: writes, and reads into buffers that are not block-aligned, go through a page-aligned
staging buffer; a write is padded to the alignment and the file truncated back to its true
length before its fsync. Reads of aligned records into aligned buffers (pool slots) skip the
staging buffer: one scattered ``preadv`` per window (see ``_io``). Staging buffers are
shared by every tier of the process and reused (a fresh 8 MiB buffer costs ~2,000 page faults
and its zeroing before its first byte moves); there are as many as transfers ever ran at once.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "ALIGN",
    "STAGING_BYTES",
    "align_down",
    "align_up",
    "direct_supported",
    "staging",
    "write_direct",
    "read_direct",
]

ALIGN = 4096
"""Alignment of buffers, offsets and lengths (covers 512 B and 4 KiB logical blocks)."""
STAGING_BYTES = 8 << 20
"""Size of one staging buffer: a 64-page MLA batch (4.7 MB) is one write; larger segments
stream through it in 8 MiB writes, which keep the device busy without holding a whole segment
in a second buffer."""

_free: list[mmap.mmap] = []
_free_lock = threading.Lock()


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def direct_supported(path: Path) -> bool:
    """Whether the filesystem holding ``path`` (an existing file) accepts ``O_DIRECT``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


@contextmanager
def staging(nbytes: int) -> Iterator[memoryview]:
    """A page-aligned buffer of at least ``nbytes``, held for the ``with`` block: a reused
    ``STAGING_BYTES`` buffer, or a fresh one for a transfer larger than that."""
    if nbytes > STAGING_BYTES:
        big = mmap.mmap(-1, align_up(nbytes))
        with memoryview(big) as view:
            yield view
        big.close()
        return
    with _free_lock:
        buf = _free.pop() if _free else None
    if buf is None or len(buf) != STAGING_BYTES:  # STAGING_BYTES is patched by tests
        buf = mmap.mmap(-1, STAGING_BYTES)
    try:
        with memoryview(buf) as view:
            yield view
    finally:
        with _free_lock:
            _free.append(buf)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_direct(fd: int, bufs: Iterable[memoryview | bytes], total: int) -> None:
    """Write the concatenation of ``bufs`` (``total`` bytes) at the start of ``fd``, opened
    with ``O_DIRECT``: streamed through the staging buffer in aligned writes, the last one
    zero-padded, then the file cut back to ``total`` bytes (the caller fsyncs)."""
    with staging(STAGING_BYTES) as stage:
        cap = stage.nbytes
        fill = 0
        written = 0
        for buf in bufs:
            src = memoryview(buf).cast("B")
            pos = 0
            while pos < src.nbytes:
                n = min(cap - fill, src.nbytes - pos)
                stage[fill : fill + n] = src[pos : pos + n]
                fill += n
                pos += n
                if fill == cap:
                    _pwrite_all(fd, stage, written)
                    written += cap
                    fill = 0
        if fill:
            padded = align_up(fill)
            stage[fill:padded] = bytes(padded - fill)
            _pwrite_all(fd, stage[:padded], written)
            written += fill
    if written != total:
        raise ValueError(f"segment buffers hold {written} B, expected {total} B")
    os.ftruncate(fd, total)


@contextmanager
def read_direct(fd: int, start: int, end: int) -> Iterator[tuple[memoryview, int]]:
    """Bytes ``[start, end)`` of ``fd`` (opened with ``O_DIRECT``) read with one aligned
    ``preadv`` into a staging buffer held for the ``with`` block; yields the bytes read and
    the offset in them where ``start`` lies. They are shorter than asked when the file ends
    first (a truncated record stays detectable)."""
    lo = align_down(start)
    hi = align_up(end)
    with staging(hi - lo) as buf:
        got = os.preadv(fd, [buf[: hi - lo]], lo)
        with buf[: max(got, 0)] as view:
            yield view, start - lo
