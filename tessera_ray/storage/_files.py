"""Filesystem layout of a disk-tier root, shared by :class:`DiskTier` and :func:`fsck`::

    ROOT/TESSERA_TIER.json       format version, layout fingerprint, namespace, hasher
    ROOT/LOCK                    flock'ed by the one process that has the root open
    ROOT/segments/<32 hex>.seg   immutable record files (one per written batch)
    ROOT/segments/*.partial      a write in progress, or left by a killed writer
    ROOT/quarantine/             bytes of every record that failed verification + a JSON note

Every name under ``segments/`` and ``quarantine/`` is built from hex hashes and integers by
this module; names read back from disk are matched against those patterns, never joined into
paths as they are.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.errors import (
    DiskFullError,
    LayoutMismatchError,
    ReadOnlyStorageError,
    StorageError,
    StorageLockedError,
)
from tessera_ray.storage._format import FORMAT_VERSION, TOMBSTONE_BYTES, pack_tombstone

__all__ = [
    "META_NAME",
    "SEGMENTS",
    "QUARANTINE",
    "PARTIAL_SUFFIX",
    "SEGMENT_SUFFIX",
    "RootMeta",
    "fingerprint_bytes",
    "read_meta",
    "write_meta",
    "fsync_dir",
    "segment_name_ok",
    "quarantine_span",
    "quarantine_file",
    "kill_span",
    "storage_error",
    "take_lock",
]

META_NAME = "TESSERA_TIER.json"
SEGMENTS = "segments"
QUARANTINE = "quarantine"
PARTIAL_SUFFIX = ".partial"
SEGMENT_SUFFIX = ".seg"
_SEGMENT_RE = re.compile(r"[0-9a-f]{32}\.seg")
DEFAULT_HASHER = "xxh3-128/namespace+fingerprint"


def fingerprint_bytes(fingerprint: str) -> bytes:
    """The 16 header bytes standing for a layout fingerprint string."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


@dataclass(frozen=True, kw_only=True)
class RootMeta:
    fingerprint: str
    namespace: str
    hasher: str
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": self.format_version,
                "fingerprint": self.fingerprint,
                "namespace": self.namespace,
                "hasher": self.hasher,
            },
            indent=2,
        )


def storage_error(exc: OSError, doing: str) -> StorageError:
    """Map an OS error to the hierarchy: ENOSPC -> DiskFullError, EROFS -> ReadOnly..."""
    code = exc.errno
    what = exc.strerror or str(exc)
    out: StorageError
    if code in (errno.ENOSPC, errno.EDQUOT):
        out = DiskFullError(
            f"{doing}: no space left on the device ({what}); nothing already stored was lost. "
            "Free space or lower capacity_bytes below what the filesystem holds"
        )
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        out = ReadOnlyStorageError(
            f"{doing}: the tier root is not writable ({what}); stored pages stay readable. "
            "Remount it read-write or point the tier at a writable root"
        )
    else:
        out = StorageError(f"{doing}: {what}")
    out.errno = code
    return out


def fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is: fsync the directory itself.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(root: Path) -> RootMeta | None:
    path = root / META_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot read {path}: {exc}; restore it or use a fresh root") from None
    if data.get("format_version") != FORMAT_VERSION:
        raise LayoutMismatchError(
            f"{path} has format version {data.get('format_version')}, this build reads "
            f"{FORMAT_VERSION}; use a fresh root"
        )
    return RootMeta(
        fingerprint=str(data["fingerprint"]),
        namespace=str(data["namespace"]),
        hasher=str(data["hasher"]),
    )


def write_meta(root: Path, meta: RootMeta) -> None:
    path = root / META_NAME
    tmp = root / (META_NAME + PARTIAL_SUFFIX)
    with open(tmp, "w") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def segment_name_ok(name: str) -> bool:
    return _SEGMENT_RE.fullmatch(name) is not None


def _note(qdir: Path, stem: str, note: dict[str, object]) -> None:
    (qdir / f"{stem}.json").write_text(json.dumps({**note, "time": time.time()}, indent=2))


def quarantine_span(
    root: Path, seg_name: str, offset: int, span: int, key: bytes | None, reason: str
) -> str:
    """Copy ``span`` bytes of a segment at ``offset`` into the quarantine with a note; returns
    the quarantine stem. Reads what exists (a truncated file yields fewer bytes)."""
    qdir = root / QUARANTINE
    seg_hex = seg_name.removesuffix(SEGMENT_SUFFIX)
    stem = f"{key.hex() if key is not None else 'unknown'}-{seg_hex}-{offset}"
    src = root / SEGMENTS / seg_name
    data = b""
    try:
        fd = os.open(src, os.O_RDONLY)
        try:
            data = os.pread(fd, max(span, 0), offset)
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass
    with open(qdir / f"{stem}.rec", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _note(
        qdir,
        stem,
        {
            "reason": reason,
            "segment": seg_name,
            "offset": offset,
            "span_bytes": span,
            "copied_bytes": len(data),
            "content_hash": key.hex() if key is not None else None,
        },
    )
    fsync_dir(qdir)
    return stem


def quarantine_file(root: Path, path: Path, reason: str) -> str:
    """Move a whole file (an orphan, an empty segment) into the quarantine with a note."""
    qdir = root / QUARANTINE
    stem = "file-" + hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest()
    os.replace(path, qdir / f"{stem}.rec")
    _note(qdir, stem, {"reason": reason, "original_path": str(path)})
    fsync_dir(qdir)
    fsync_dir(path.parent)
    return stem


def kill_span(seg_path: Path, offset: int, span: int, file_size: int) -> None:
    """Make a span invisible to future scans: truncate when it runs to the end of the file,
    otherwise overwrite its start with a tombstone covering exactly ``span`` bytes."""
    fd = os.open(seg_path, os.O_WRONLY)
    try:
        if offset + span >= file_size:
            os.ftruncate(fd, offset)
        elif span >= TOMBSTONE_BYTES:
            os.pwrite(fd, pack_tombstone(span), offset)
        else:  # too short for a tombstone: leave it, scans report it again (harmless)
            return
        os.fdatasync(fd)
    finally:
        os.close(fd)


def take_lock(root: Path, *, what: str) -> int:
    """flock ``root/LOCK`` exclusively (one process per root); returns the descriptor."""
    path = root / "LOCK"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        try:  # a read-only root can still be locked through a read-only descriptor
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise storage_error(exc, f"cannot lock tier root {root}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageLockedError(f"tier root {root} is open in another process; {what}") from None
    return fd
