"""Host pool pages in a shared-memory file, so other processes of the node can map them.

A pool whose config names a ``shared_memory_dir`` keeps its pages in one file of that directory,
``tessera-<pid>-<token>.slab``, mapped shared: a reader on the same node maps it read-only once
(:class:`SlabMapping`) and copies pages out of it, instead of asking a network transport to move
them. The file is created with the whole size reserved (``posix_fallocate``), so a full tmpfs
fails when the pool starts with an error naming the directory and the bytes, never as a SIGBUS
on some later write. It is readable by its owner's user only (a pool holds tenants' context).

The owner holds a shared ``flock`` on the file for its life; the kernel drops it when the
process ends, however it ends. That lock is the liveness signal: a reader asks whether the
owner still lives after each copy (:meth:`SlabMapping.owner_alive`), and a pool starting in
the directory removes the files nobody holds (:func:`sweep_dead_slabs`), owners killed before
they could unlink theirs. The pid in the name is for people: a pid says nothing across pid
namespaces sharing one ``/dev/shm``, a lock does.

Mapped memory is never trusted on its own: a reader verifies every page it copied against the
content hash the owner exported under its pin, as for any transport.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tessera_ray.errors import PeerMappingError, PoolConfigError, PoolMemoryError

__all__ = [
    "SlabInfo",
    "SlabMapping",
    "is_slab_path",
    "shared_host_zeros",
    "slab_of",
    "sweep_dead_slabs",
]

_NAME = re.compile(r"^tessera-(\d+)-([0-9a-f]{32})\.slab(\.partial)?$")
_PARTIAL_GRACE_S = 60.0
"""A ``.partial`` file younger than this may be a pool being created right now (it takes its
lock a moment after creating the file): the sweep leaves it alone."""


@dataclass(frozen=True, kw_only=True)
class SlabInfo:
    """What a reader needs to map a pool's pages (small, picklable; published with the pool's
    transport data)."""

    path: str
    """The slab file (absent where the reader runs in another container)."""
    nbytes: int
    token: str
    """Random per slab: a restarted pool has a new file, never the old one refilled."""
    num_pages: int
    page_bytes: int


_LIVE: dict[int, SlabInfo] = {}
"""Slabs of this process by the address of their first byte (see :func:`slab_of`)."""
_LIVE_LOCK = threading.Lock()


def slab_of(data: torch.Tensor) -> SlabInfo | None:
    """The slab holding pool tensor ``data`` (made by :func:`shared_host_zeros`), or ``None``
    when its memory is private."""
    if data.device.type != "cpu":
        return None
    with _LIVE_LOCK:
        info = _LIVE.get(data.data_ptr())
    if info is None or info.nbytes != data.numel() * data.element_size():
        return None
    return info


def shared_host_zeros(
    directory: str, num_pages: int, page_bytes: int, *, pin: bool = False
) -> torch.Tensor:
    """A zeroed ``uint8 [num_pages, page_bytes]`` tensor over a new slab file in ``directory``
    (page-aligned, every page allocated now). ``pin``: also page-lock it for device copies
    (``cudaHostRegister``). Raises :class:`PoolConfigError` for a missing directory and
    :class:`PoolMemoryError` when it cannot hold the pool; nothing is left behind then."""
    nbytes = num_pages * page_bytes
    if not os.path.isdir(directory):
        raise PoolConfigError(
            f"shared_memory_dir {directory!r} is not a directory; create it (a tmpfs such as "
            "/dev/shm) or set shared_memory_dir=None to keep pool pages private"
        )
    sweep_dead_slabs(directory)
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise _too_small(directory, nbytes, f"it has {free:,} B free")
    token = secrets.token_hex(16)
    path = os.path.join(directory, f"tessera-{os.getpid()}-{token}.slab")
    partial = path + ".partial"
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise PoolConfigError(
            f"cannot create a pool file in shared_memory_dir {directory!r}: {e.strerror}; "
            "give this user write access or set shared_memory_dir=None"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held for the pool's life: the liveness signal
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise _too_small(directory, nbytes, "reserving it failed") from e
            raise PoolConfigError(
                f"cannot reserve {nbytes:,} B in shared_memory_dir {directory!r}: {e.strerror}"
            ) from e
        os.rename(partial, path)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    with contextlib.suppress(AttributeError, OSError):  # no THP for shmem here: plain pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(mapping)
    flat = torch.frombuffer(view, dtype=torch.uint8)  # keeps ``view`` alive: see below
    address = flat.data_ptr()
    pinned = _pin(address, nbytes, directory) if pin else False
    info = SlabInfo(
        path=path, nbytes=nbytes, token=token, num_pages=num_pages, page_bytes=page_bytes
    )
    with _LIVE_LOCK:
        _LIVE[address] = info
    # When the last tensor over the slab goes (or the process exits normally), unpin, unlink
    # and drop the lock; the mapping itself goes with the view, after this ran.
    weakref.finalize(view, _release, address, fd, path, mapping, pinned)
    return flat.view(num_pages, page_bytes)


def _too_small(directory: str, nbytes: int, why: str) -> PoolMemoryError:
    return PoolMemoryError(
        f"shared_memory_dir {directory!r} cannot hold a pool of {nbytes:,} B ({why}); give it "
        "more room (a container's --shm-size), ask for fewer pages, or set "
        "shared_memory_dir=None"
    )


def _pin(address: int, nbytes: int, directory: str) -> bool:
    """Page-lock the slab for device copies, as pinned tensors are."""
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = runtime.cudaHostRegister(address, nbytes, 0)
    if err != runtime.cudaError.success:
        raise PoolMemoryError(
            f"cudaHostRegister of a {nbytes:,} B pool in {directory!r} failed ({err}); set "
            "pin_memory=False or shared_memory_dir=None"
        )
    return True


def _release(address: int, fd: int, path: str, mapping: mmap.mmap, pinned: bool) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(address, None)
    if pinned:
        with contextlib.suppress(Exception):  # the CUDA context may be gone at exit
            torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)
    del mapping  # unmapped once the view that holds it goes too


def is_slab_path(path: str, directory: str) -> bool:
    """Whether ``path`` names a slab file :func:`shared_host_zeros` made in ``directory`` (a
    process asked to map a slab by path maps nothing else)."""
    head, name = os.path.split(path)
    match = _NAME.match(name)
    if match is None or match.group(3):
        return False
    try:
        return os.path.samefile(head, directory)
    except OSError:
        return False


def sweep_dead_slabs(directory: str) -> int:
    """Remove the slab files of ``directory`` no process holds (their owners died without
    unlinking them); returns how many. Files of other users are left alone."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    now = time.time()
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            st = os.fstat(fd)
            if match.group(3) and now - st.st_mtime < _PARTIAL_GRACE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == st.st_ino:  # still the file we locked
                    os.unlink(path)
                    removed += 1
        finally:
            os.close(fd)
    return removed


class SlabMapping:
    """A mapping of another process's slab (reader side), made once per peer, read-only unless
    asked otherwise.

    Raises :class:`PeerMappingError` when the file cannot be opened (absent: another
    container; no rights) or is not the size its descriptor says.
    """

    def __init__(self, info: SlabInfo, *, writable: bool = False) -> None:
        """``writable``: map it for writing too (a pool answering into an engine's slab)."""
        if info.nbytes != info.num_pages * info.page_bytes or info.nbytes <= 0:
            raise PeerMappingError(f"slab descriptor of {info.path} is inconsistent: {info}")
        try:
            fd = os.open(info.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError as e:
            raise PeerMappingError(f"cannot open {info.path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if size != info.nbytes:
                raise PeerMappingError(f"{info.path} holds {size:,} B, not {info.nbytes:,} B")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, info.nbytes, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, PeerMappingError):
                raise PeerMappingError(f"cannot map {info.path}: {e}") from e
            raise
        self.info = info
        self._fd = fd
        self._mapping = mapping
        self._bytes: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)
        self.writable = writable
        self.address = int(self._bytes.ctypes.data)
        """Address of page 0 in this process (read-only memory unless ``writable``)."""

    @property
    def closed(self) -> bool:
        return self._bytes is None

    def page(self, index: int) -> memoryview:
        """Page ``index``'s bytes, read-only, in place (for tests and checks)."""
        if self._bytes is None:
            raise PeerMappingError(f"the mapping of {self.info.path} is closed")
        pb = self.info.page_bytes
        return self._bytes[index * pb : (index + 1) * pb].data

    def pages(self, count: int) -> np.ndarray:
        """The first ``count`` pages, ``uint8 [count, page_bytes]``, in place (read-only unless
        the mapping is ``writable``)."""
        if self._bytes is None:
            raise PeerMappingError(f"the mapping of {self.info.path} is closed")
        if not 0 <= count <= self.info.num_pages:
            raise PeerMappingError(f"{count} pages of a slab of {self.info.num_pages}")
        pb = self.info.page_bytes
        return self._bytes[: count * pb].reshape(count, pb)

    def owner_alive(self) -> bool:
        """Whether the slab's owner process still holds it (see the module docstring)."""
        if self._bytes is None:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        """Unmap (idempotent); a dead owner's memory is freed once no reader maps it."""
        if self._bytes is None:
            return
        self._bytes = None
        with contextlib.suppress(BufferError):  # a page view still held: unmapped with it
            self._mapping.close()
        os.close(self._fd)
