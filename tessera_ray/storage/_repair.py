"""Repairs the disk tier makes to its own segment files: quarantine, tombstones, unlinks.

Shared by opening a root (``_recovery``) and serving it (``disk``), so a bad record is set
aside the same way whether a restart scan or a read found it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tessera_ray.storage import _files as F

__all__ = ["Span", "delete_records", "quarantine_record", "try_repair", "unlink_segments"]

Span = tuple[str, int, int, int]
"""``(segment name, offset, span bytes, file size)`` of one record to tombstone."""


def try_repair(fn: Callable[[], object]) -> None:
    try:
        fn()
    except OSError:
        pass  # read-only root: the record is not indexed, so it is never served


def quarantine_record(
    root: Path, seg_name: str, offset: int, span: int, key: bytes | None, reason: str, size: int
) -> None:
    """Copy a bad record into the quarantine, then make it invisible to later scans."""
    F.quarantine_span(root, seg_name, offset, span, key, reason)
    F.kill_span(root / F.SEGMENTS / seg_name, offset, span, size)


def unlink_segments(seg_dir: Path, names: list[str]) -> None:
    for name in names:
        try:
            (seg_dir / name).unlink()
        except FileNotFoundError:
            pass
    if names:
        F.fsync_dir(seg_dir)


def delete_records(seg_dir: Path, spans: list[Span], unlink: list[str]) -> None:
    """Tombstone single deleted records, then unlink segments left without live pages."""
    for seg_name, offset, span, size in spans:
        try:
            F.kill_span(seg_dir / seg_name, offset, span, size)
        except FileNotFoundError:
            pass
    unlink_segments(seg_dir, unlink)
