"""Blocking file IO of the disk tier, run on its thread pool: segment writes, verified reads."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.storage import _files as F
from tessera_ray.storage._format import HEADER_BYTES, pack_header, parse_header, record_check
from tessera_ray.storage.keys import ContentHasher

__all__ = ["Corrupt", "ReadItem", "write_all", "write_segment", "verify_record", "read_records"]

_IOV_MAX = 512


class Corrupt:
    """A read that failed verification (and was quarantined); never carries page bytes."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ReadItem:
    key: bytes
    segment: str
    offset: int
    payload_len: int


def write_all(fd: int, bufs: list[memoryview | bytes]) -> None:
    """writev every buffer, resuming after short writes (the payloads are never copied)."""
    pending = [memoryview(b).cast("B") for b in bufs]
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        while n and pending:
            head = pending[0]
            if n >= head.nbytes:
                n -= head.nbytes
                pending.pop(0)
            else:
                pending[0] = head[n:]
                n = 0


def write_segment(
    seg_dir: Path, name: str, fingerprint: bytes, items: list[tuple[bytes, memoryview]]
) -> int:
    """Atomically create one segment: ``.partial``, fsync, rename, fsync of the directory.

    A crash at any point leaves either no segment or the whole one; the ``.partial`` a killed
    writer leaves is deleted when the root is next opened.
    """
    path = seg_dir / name
    partial = seg_dir / (name + F.PARTIAL_SUFFIX)
    bufs: list[memoryview | bytes] = []
    for key, view in items:
        bufs.append(pack_header(fingerprint, key, view))
        bufs.append(view)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, bufs)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)  # ENOSPC mid-write: give the space back
        raise
    os.close(fd)
    os.rename(partial, path)
    F.fsync_dir(seg_dir)
    return sum(HEADER_BYTES + v.nbytes for _, v in items)


def verify_record(
    item: ReadItem, head: bytes, payload: memoryview, fingerprint: bytes, hasher: ContentHasher
) -> str | None:
    """``None`` when the record is intact and is the page asked for, else the reason."""
    if len(head) < HEADER_BYTES or payload.nbytes < item.payload_len:
        return "truncated record (the file is shorter than the record)"
    header = parse_header(head)
    if isinstance(header, str):
        return header
    if header.fingerprint != fingerprint:
        return "layout fingerprint mismatch"
    if header.key != item.key:
        return "header names another content hash"
    if header.payload_len != item.payload_len:
        return "payload length changed"
    if record_check(head[:64], payload) != header.record_check:
        return "record checksum mismatch"
    if hasher(payload) != item.key:
        return "content hash mismatch"
    return None


Quarantine = Callable[[str, int, int, bytes, str, int], None]
"""``(segment, offset, span, key, reason, file size)``: move a bad record aside."""


def read_records(
    seg_dir: Path,
    plan: list[ReadItem],
    outs: list[memoryview] | None,
    fingerprint: bytes,
    hasher: ContentHasher,
    quarantine: Quarantine,
) -> list[bytes | int | Corrupt | None]:
    """Read and verify each record (into ``outs[i]`` when given); quarantine failures here,
    off the event loop. ``None`` marks a segment that vanished (evicted meanwhile): a miss."""
    results: list[bytes | int | Corrupt | None] = [None] * len(plan)
    by_seg: dict[str, list[int]] = {}
    for i, item in enumerate(plan):
        by_seg.setdefault(item.segment, []).append(i)
    for seg_name, idxs in by_seg.items():
        try:
            fd = os.open(seg_dir / seg_name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            for i in idxs:
                item = plan[i]
                head = os.pread(fd, HEADER_BYTES, item.offset)
                data: bytes | None = None
                if outs is None:
                    data = os.pread(fd, item.payload_len, item.offset + HEADER_BYTES)
                    view = memoryview(data)
                else:
                    out = outs[i]
                    if out.nbytes < item.payload_len:
                        raise ValueError(
                            f"output buffer {i} holds {out.nbytes} B, the page has "
                            f"{item.payload_len} B"
                        )
                    view = out[: item.payload_len]
                    view = view[: os.preadv(fd, [view], item.offset + HEADER_BYTES)]
                reason = verify_record(item, head, view, fingerprint, hasher)
                if reason is None:
                    results[i] = data if data is not None else item.payload_len
                    continue
                try:
                    span = HEADER_BYTES + item.payload_len
                    quarantine(seg_name, item.offset, span, item.key, reason, size)
                except OSError as exc:
                    reason += f" (could not quarantine: {exc.strerror})"
                results[i] = Corrupt(reason)
        finally:
            os.close(fd)
    return results
