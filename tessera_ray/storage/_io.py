"""Blocking file IO of the disk tier, run on its thread pool: segment writes, verified reads."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.core.hostmem import buffer_address
from tessera_ray.errors import InvalidKeyError
from tessera_ray.storage import _direct as D
from tessera_ray.storage import _files as F
from tessera_ray.storage._format import (
    ALIGNED_HEAD_BYTES,
    BLOCK_BYTES,
    HEADER_BYTES,
    pack_header,
    parse_header,
    record_check,
    record_heads,
)
from tessera_ray.storage.keys import ContentHasher

__all__ = [
    "Corrupt",
    "Hashing",
    "ReadItem",
    "digest_batch",
    "write_all",
    "write_segment",
    "verify_record",
    "read_records",
]

_IOV_MAX = 1024  # Linux UIO_MAXIOV: the most buffers one writev takes


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
    head_bytes: int
    """Where the payload starts, from ``offset`` (the record's header block)."""

    @property
    def end(self) -> int:
        return self.offset + self.head_bytes + self.payload_len


@dataclass(frozen=True, slots=True)
class Hashing:
    """How a tier proves a payload: ``digest`` is the root's default content hash (it feeds
    the record checksum, see ``_format``); ``key_of`` names pages when the tier was given
    its own key function, else ``None``: the key is the digest, one pass serves both."""

    digest: ContentHasher
    key_of: ContentHasher | None = None

    def key(self, payload: memoryview, digest: bytes) -> bytes:
        return digest if self.key_of is None else self.key_of(payload)


def digest_batch(items: list[tuple[bytes, memoryview]], hashing: Hashing) -> list[bytes]:
    """Each payload's digest, after checking that it hashes to its key (nothing is written
    when one does not)."""
    digests: list[bytes] = []
    for key, view in items:
        digest = hashing.digest(view)
        if hashing.key(view, digest) != key:
            raise InvalidKeyError(
                f"payload of {view.nbytes} B does not hash to its key {key.hex()}; "
                "hash the page with the tier's (namespace, fingerprint)"
            )
        digests.append(digest)
    return digests


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
    seg_dir: Path,
    name: str,
    fingerprint: bytes,
    items: list[tuple[bytes, memoryview]],
    digests: list[bytes],
    *,
    direct: bool = False,
) -> int:
    """Atomically create one segment: ``.partial``, fsync, rename, fsync of the directory.

    A crash at any point leaves either no segment or the whole one; the ``.partial`` a killed
    writer leaves is deleted when the root is next opened. ``digests[i]`` is the payload digest
    of ``items[i]`` (from :func:`digest_batch`), so the payloads are not hashed again here.
    ``direct`` writes around the page cache (see ``_direct``); the protocol is the same.
    """
    path = seg_dir / name
    partial = seg_dir / (name + F.PARTIAL_SUFFIX)
    bufs: list[memoryview | bytes] = []
    heads = record_heads(v.nbytes for _, v in items)
    for (key, view), digest, head in zip(items, digests, heads, strict=True):
        bufs.append(pack_header(fingerprint, key, view.nbytes, digest, head))
        bufs.append(view)
    total = sum(heads) + sum(v.nbytes for _, v in items)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = os.open(partial, flags, 0o644)
    try:
        if direct:
            D.write_direct(fd, bufs, total)
            os.fdatasync(fd)  # covers the new size: what reading the data back needs
        else:
            write_all(fd, bufs)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)  # ENOSPC mid-write: give the space back
        raise
    os.close(fd)
    os.rename(partial, path)
    F.fsync_dir(seg_dir)
    return total


def verify_record(
    item: ReadItem,
    head: bytes | memoryview,
    payload: memoryview,
    fingerprint: bytes,
    hashing: Hashing,
) -> str | None:
    """``None`` when the record is intact and is the page asked for, else the reason.

    One pass over the payload (its digest) checks both the record checksum and the content
    hash; a custom key function adds its own pass.
    """
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
    digest = hashing.digest(payload)
    if record_check(head[:64], digest) != header.record_check:
        return "record checksum mismatch"
    if hashing.key(payload, digest) != item.key:
        return "content hash mismatch"
    return None


Quarantine = Callable[[str, int, int, bytes, str, int], None]
"""``(segment, offset, span, key, reason, file size)``: move a bad record aside."""


def _read_into(
    fd: int, item: ReadItem, out: memoryview, head: memoryview
) -> tuple[memoryview, memoryview]:
    """Header block and payload of one record with one preadv, straight into ``head``
    (scratch of ``ALIGNED_HEAD_BYTES``) and the caller's buffer; what each received (a read
    cut short by the end of the file leaves them short, which verification calls
    truncated)."""
    payload = out[: item.payload_len]
    got = os.preadv(fd, [head[: item.head_bytes], payload], item.offset)
    return head[: min(got, HEADER_BYTES)], payload[: max(0, got - item.head_bytes)]


def _read_one(fd: int, item: ReadItem) -> tuple[bytes, bytes]:
    head = os.pread(fd, HEADER_BYTES, item.offset)
    return head, os.pread(fd, item.payload_len, item.offset + item.head_bytes)


def _scatter_ok(plan: list[ReadItem], run: list[int], outs: list[memoryview]) -> bool:
    """Whether one direct preadv can land the run's payloads straight in ``outs``: aligned
    records back to back in the file, each payload whole blocks, each buffer block-aligned."""
    if 2 * len(run) > _IOV_MAX:
        return False
    end = plan[run[0]].offset
    for i in run:
        item = plan[i]
        if (
            item.offset != end
            or item.head_bytes != ALIGNED_HEAD_BYTES
            or item.offset % BLOCK_BYTES
            or item.payload_len % BLOCK_BYTES
            or buffer_address(outs[i]) % BLOCK_BYTES
        ):
            return False
        end = item.end
    return True


_WINDOW_GAP_BYTES = 1 << 20
"""Records further apart than this are read with separate direct reads, not one spanning the
unwanted bytes between them."""


def _windows(plan: list[ReadItem], idxs: list[int]) -> list[list[int]]:
    """Indices of records (sorted by offset) cut into runs that one staging-sized read
    covers."""
    runs: list[list[int]] = []
    start = end = 0
    for i in idxs:
        item = plan[i]
        rec_end = item.end
        if (
            runs
            and item.offset - end <= _WINDOW_GAP_BYTES
            and D.align_up(rec_end) - D.align_down(start) <= D.STAGING_BYTES
        ):
            runs[-1].append(i)
        else:
            runs.append([i])
            start = item.offset
        end = rec_end
    return runs


def _check_out(i: int, out: memoryview, item: ReadItem) -> None:
    if out.nbytes < item.payload_len:
        raise ValueError(
            f"output buffer {i} holds {out.nbytes} B, the page has {item.payload_len} B"
        )


class _SegmentReader:
    """Reads and verifies the records of one open segment file (see :func:`read_records`)."""

    def __init__(
        self,
        fd: int,
        plan: list[ReadItem],
        outs: list[memoryview] | None,
        fingerprint: bytes,
        hashing: Hashing,
    ) -> None:
        self.fd = fd
        self.plan = plan
        self.outs = outs
        self.fingerprint = fingerprint
        self.hashing = hashing

    def buffered(self, idxs: list[int]) -> Iterator[tuple[int, str | None, bytes | int]]:
        # In file order, one record at a time: each read returns as soon as its record is in,
        # so verifying it overlaps the kernel's readahead of the next ones (reading a whole
        # batch with one preadv measured slower: nothing is verified until all of it arrived).
        scratch = memoryview(bytearray(ALIGNED_HEAD_BYTES))
        for i in idxs:
            item = self.plan[i]
            head: bytes | memoryview
            if self.outs is None:
                # Returned as bytes: pread allocates them, so one read per part, no copy.
                head, data = _read_one(self.fd, item)
                view = memoryview(data)
                reason = verify_record(item, head, view, self.fingerprint, self.hashing)
                yield i, reason, data
            else:
                _check_out(i, self.outs[i], item)
                head, view = _read_into(self.fd, item, self.outs[i], scratch)
                reason = verify_record(item, head, view, self.fingerprint, self.hashing)
                if reason is not None:  # no unverified byte stays in a caller's buffer
                    self.outs[i][: item.payload_len] = bytes(item.payload_len)
                yield i, reason, item.payload_len

    def direct(self, idxs: list[int]) -> Iterator[tuple[int, str | None, bytes | int]]:
        # Whole windows of records per aligned read. Into the caller's buffers where they and
        # the records are aligned (zero copy: the payloads never pass through a staging
        # buffer), else into a staging buffer, verified there and copied out.
        plan = self.plan
        outs = self.outs
        for run in _windows(plan, idxs):
            if outs is not None:
                for i in run:
                    _check_out(i, outs[i], plan[i])
                if _scatter_ok(plan, run, outs):
                    try:
                        scattered = self._scattered(run, outs)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:  # EINVAL: the device wants 4 KiB blocks
                            raise
                    else:
                        yield from scattered
                        continue
            yield from self._staged(run)

    def _scattered(
        self, run: list[int], outs: list[memoryview]
    ) -> list[tuple[int, str | None, bytes | int]]:
        """One preadv of the run: header blocks into staging, payloads into ``outs``. A
        payload that fails verification is zeroed: no unverified byte stays in a caller's
        buffer."""
        plan = self.plan
        first = plan[run[0]].offset
        verdicts: list[tuple[int, str | None, bytes | int]] = []
        with D.staging(len(run) * ALIGNED_HEAD_BYTES) as heads:
            iov: list[memoryview] = []
            for k, i in enumerate(run):
                iov.append(heads[k * ALIGNED_HEAD_BYTES : (k + 1) * ALIGNED_HEAD_BYTES])
                iov.append(outs[i][: plan[i].payload_len])
            got = os.preadv(self.fd, iov, first)
            del iov
            for k, i in enumerate(run):
                item = plan[i]
                have = got - (item.offset - first)  # bytes of this record that arrived
                head = heads[k * ALIGNED_HEAD_BYTES : k * ALIGNED_HEAD_BYTES + HEADER_BYTES]
                body = outs[i][: max(0, min(item.payload_len, have - item.head_bytes))]
                if have < HEADER_BYTES:
                    head = head[: max(0, have)]
                reason = verify_record(item, head, body, self.fingerprint, self.hashing)
                if reason is None:
                    verdicts.append((i, None, item.payload_len))
                else:
                    outs[i][: item.payload_len] = bytes(item.payload_len)
                    verdicts.append((i, reason, 0))
                del head, body
        return verdicts

    def _staged(self, run: list[int]) -> Iterator[tuple[int, str | None, bytes | int]]:
        """The run read into a staging buffer, verified there: only bytes that passed
        verification reach the caller."""
        plan = self.plan
        first, last = plan[run[0]], plan[run[-1]]
        verdicts: list[tuple[int, str | None, bytes | int]] = []
        with D.read_direct(self.fd, first.offset, last.end) as (buf, base):
            for i in run:
                item = plan[i]
                rel = base + item.offset - first.offset
                head = buf[rel : rel + HEADER_BYTES]
                start = rel + item.head_bytes
                body = buf[start : start + item.payload_len]
                reason = verify_record(item, head, body, self.fingerprint, self.hashing)
                if reason is not None:
                    verdicts.append((i, reason, 0))
                elif self.outs is None:
                    verdicts.append((i, None, bytes(body)))
                else:
                    self.outs[i][: item.payload_len] = body
                    verdicts.append((i, None, item.payload_len))
                del head, body  # views of the staging buffer, released with it
        yield from verdicts


def read_records(
    seg_dir: Path,
    plan: list[ReadItem],
    outs: list[memoryview] | None,
    fingerprint: bytes,
    hashing: Hashing,
    quarantine: Quarantine,
    *,
    direct: bool = False,
) -> list[bytes | int | Corrupt | None]:
    """Read and verify each record (into ``outs[i]`` when given); quarantine failures here,
    off the event loop. ``None`` marks a segment that vanished (evicted meanwhile): a miss.
    ``direct`` reads around the page cache (see ``_direct``)."""
    results: list[bytes | int | Corrupt | None] = [None] * len(plan)
    by_seg: dict[str, list[int]] = {}
    for i, item in enumerate(plan):
        by_seg.setdefault(item.segment, []).append(i)
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    for seg_name, idxs in by_seg.items():
        try:
            fd = os.open(seg_dir / seg_name, flags)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            reader = _SegmentReader(fd, plan, outs, fingerprint, hashing)
            ordered = sorted(idxs, key=lambda j: plan[j].offset)
            for i, reason, value in (reader.direct if direct else reader.buffered)(ordered):
                if reason is None:
                    results[i] = value
                    continue
                item = plan[i]
                try:
                    span = item.head_bytes + item.payload_len
                    quarantine(seg_name, item.offset, span, item.key, reason, size)
                except OSError as exc:
                    reason += f" (could not quarantine: {exc.strerror})"
                results[i] = Corrupt(reason)
        finally:
            os.close(fd)
    return results
