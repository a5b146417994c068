"""Offline checker of a disk-tier root: every record's header, checksum and content hash.

``fsck(root)`` only reads; ``fsck(root, repair=True)`` takes the root's lock (so no tier may
have it open), quarantines corrupt records, deletes ``.partial`` leftovers and moves foreign
files to the quarantine. The ``tessera-ray fsck`` command wraps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tessera_ray.errors import StorageError
from tessera_ray.storage import _files as F
from tessera_ray.storage._format import HEADER_BYTES, ScanItem, record_check, scan_segment
from tessera_ray.storage._progress import Progress
from tessera_ray.storage.keys import ContentHasher, content_hasher

__all__ = ["FsckProblem", "FsckReport", "fsck"]

_KNOWN_ROOT = {F.META_NAME, "LOCK", F.SEGMENTS, F.QUARANTINE}


@dataclass(frozen=True, kw_only=True)
class FsckProblem:
    kind: str
    """``corrupt``, ``partial``, ``orphan`` or ``empty``."""
    path: str
    offset: int | None = None
    reason: str = ""

    def render(self) -> str:
        at = f" @ {self.offset}" if self.offset is not None else ""
        why = f": {self.reason}" if self.reason else ""
        return f"{self.kind:<8} {self.path}{at}{why}"


@dataclass(kw_only=True)
class FsckReport:
    root: str
    segments: int = 0
    records_ok: int = 0
    content_hash_checked: bool = True
    repaired: bool = False
    problems: list[FsckProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def count(self, kind: str) -> int:
        return sum(p.kind == kind for p in self.problems)

    def render(self) -> str:
        lines = [p.render() for p in self.problems]
        verdict = "clean" if self.ok else ("repaired" if self.repaired else "PROBLEMS FOUND")
        lines.append(
            f"{self.root}: {self.segments} segments, {self.records_ok} records ok, "
            f"{self.count('corrupt')} corrupt, {self.count('partial')} partial, "
            f"{self.count('orphan')} orphan, {self.count('empty')} empty: {verdict}"
        )
        if not self.content_hash_checked:
            lines.append("note: the root uses a custom content hash; only checksums were checked")
        return "\n".join(lines)


def _check_record(
    fd: int, item: ScanItem, fp16: bytes, digest: ContentHasher, key_is_digest: bool
) -> str | None:
    h = item.header
    if item.problem is not None or h is None:
        return item.problem or "unreadable header"
    if h.fingerprint != fp16:
        return "layout fingerprint mismatch"
    head = os.pread(fd, HEADER_BYTES, item.offset)
    payload = memoryview(os.pread(fd, h.payload_len, item.offset + h.head_bytes))
    d = digest(payload)
    if record_check(head[:64], d) != h.record_check:
        return "record checksum mismatch"
    if key_is_digest and d != h.key:
        return "content hash mismatch"
    return None


def fsck(root: str | Path, *, repair: bool = False, progress: bool | None = None) -> FsckReport:
    """Check every record under ``root``; see the module docstring for ``repair``."""
    root = Path(root)
    meta = F.read_meta(root)
    if meta is None or not (root / F.SEGMENTS).is_dir():
        raise StorageError(f"{root} is not a tessera-ray disk tier root (no {F.META_NAME})")
    lock_fd = None
    if repair:
        lock_fd = F.take_lock(root, what="stop it (it is in a running tier) before fsck --repair")
    try:
        return _fsck(root, meta, repair=repair, progress=progress)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _fsck(root: Path, meta: F.RootMeta, *, repair: bool, progress: bool | None) -> FsckReport:
    report = FsckReport(root=str(root), repaired=repair)
    # The record checksum covers the payload through the root's default content hash, so
    # payloads are checked even where pages are named by a custom key function.
    digest = content_hasher(meta.namespace, meta.fingerprint)
    key_is_digest = meta.hasher == F.DEFAULT_HASHER
    report.content_hash_checked = key_is_digest
    fp16 = F.fingerprint_bytes(meta.fingerprint)
    seg_dir = root / F.SEGMENTS
    for name in sorted(os.listdir(root)):
        if name not in _KNOWN_ROOT and name != F.META_NAME + F.PARTIAL_SUFFIX:
            report.problems.append(FsckProblem(kind="orphan", path=str(root / name)))
            if repair:
                F.quarantine_file(root, root / name, "orphan file in the tier root")
    names = sorted(os.listdir(seg_dir))
    bar = Progress(
        f"fsck {root}", len(names), enabled=Progress.wanted(len(names), min_items=1, force=progress)
    )
    for name in names:
        bar.advance()
        path = seg_dir / name
        if name.endswith(F.PARTIAL_SUFFIX):
            report.problems.append(
                FsckProblem(kind="partial", path=str(path), reason="unfinished write")
            )
            if repair:
                path.unlink(missing_ok=True)
            continue
        if not F.segment_name_ok(name) or not path.is_file():
            report.problems.append(FsckProblem(kind="orphan", path=str(path)))
            if repair:
                F.quarantine_file(root, path, "orphan file among the segments")
            continue
        report.segments += 1
        size = path.stat().st_size
        if size == 0:
            report.problems.append(FsckProblem(kind="empty", path=str(path)))
            if repair:
                F.quarantine_file(root, path, "empty segment")
            continue
        bad: list[tuple[ScanItem, str]] = []
        fd = os.open(path, os.O_RDONLY)
        try:
            for item in scan_segment(fd, size):
                if item.dead:
                    continue
                reason = _check_record(fd, item, fp16, digest, key_is_digest)
                if reason is None:
                    report.records_ok += 1
                else:
                    bad.append((item, reason))
                    report.problems.append(
                        FsckProblem(
                            kind="corrupt", path=str(path), offset=item.offset, reason=reason
                        )
                    )
        finally:
            os.close(fd)
        # Last first: truncating a bad tail never moves the offsets of earlier spans.
        for item, reason in reversed(bad) if repair else ():
            key = item.header.key if item.header is not None else None
            F.quarantine_span(root, name, item.offset, item.span, key, reason)
            F.kill_span(path, item.offset, item.span, path.stat().st_size)
    bar.close()
    return report
