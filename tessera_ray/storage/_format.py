"""On-disk record format of the disk tier, and the scanner that walks a segment file.

A segment file is a run of records; a record is a header block and the payload::

    magic        8s   b"TSRAYPG1"
    version      u16  FORMAT_VERSION
    header_bytes u16  where the payload starts, from the record's start: 72 (compact) or
                      512 (aligned: the 72 header bytes, then zeros)
    flags        u32  0 (reserved)
    fingerprint  16s  the layout fingerprint (32 hex chars as 16 bytes)
    content_hash 16s  the page key
    payload_len  u64
    header_check u64  xxh3-64 of the 56 bytes above: lets a scan trust ``payload_len`` and
                      skip the payload without reading it
    record_check u64  xxh3-64 of the 64 header bytes above + the payload digest

The payload digest is the xxh3-128 of the payload keyed with the root's content seed (the
tier's default content hash of the page). Why a digest and not the payload itself: the tier
must hash every payload anyway to prove it is the page its key names, and a second full pass
for the checksum would cost as much again (docs/measured-choices.md).
With the digest, one pass over the payload yields both checks, and still every payload bit
reaches the record checksum (through a 128-bit digest). For a root with the default hasher the
digest *is* the key, so reads and writes hash each payload exactly once; a root with a custom
key function (tests, manifests) hashes twice. ``fsck`` rebuilds the digest function from the
root's namespace and fingerprint, so it checks payloads of custom-hasher roots too.

Why aligned records: a payload that starts on a 512 B boundary of the file and fills whole
512 B blocks can be read with ``O_DIRECT`` straight into an aligned caller buffer (a pool slot),
with no staging copy (see ``_io``). A record is aligned when its payload is a whole number of
blocks and the record itself starts on a block boundary, which holds for every record of a
segment of such pages (segments start at offset 0 and aligned records keep the boundary): MLA
pages (73,728 B = 144 blocks) pay 440 B of padding per page (0.6%). Other payloads (the 64 B
manifests, odd page sizes) stay compact, without padding. The zeros of the header block are
covered by no check: nothing reads them.

A removed record (deleted, or quarantined) is overwritten in place by a 24-byte tombstone
(``b"TSRAYDD1"``, span u64, xxh3-64 of both), so a later scan skips exactly that span even
when the original header was the corrupt part.

Why xxh3 for the checksums: it already ships with the content hash (xxhash), runs at memory
speed (so verifying costs little next to a cold read), and detects random bit flips as well
as a CRC for this purpose; a CRC32C would need a new dependency or a pure-Python path.
Integrity against an attacker is not its job: the content hash and the byte comparison in the
pool handle sharing decisions.

Format history: version 1 checksummed the payload bytes directly (a second pass); version 2
had compact records only. Roots of older versions are refused when opened ("use a fresh
root"): the tier is a cache, and a page it lacks is recomputed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

__all__ = [
    "MAGIC",
    "DEAD_MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "BLOCK_BYTES",
    "ALIGNED_HEAD_BYTES",
    "head_bytes_at",
    "record_heads",
    "TOMBSTONE_BYTES",
    "Header",
    "pack_header",
    "parse_header",
    "record_check",
    "pack_tombstone",
    "parse_tombstone",
    "ScanItem",
    "scan_segment",
]

MAGIC = b"TSRAYPG1"
DEAD_MAGIC = b"TSRAYDD1"
FORMAT_VERSION = 3
_HEAD = struct.Struct("<8sHHI16s16sQ")  # up to payload_len: 56 bytes
_CHECKS = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _CHECKS.size  # 72
BLOCK_BYTES = 512
"""The logical block ``O_DIRECT`` transfers are aligned to (512 B on this VM's virtio disk; a
device with 4 KiB blocks refuses the zero-copy reads, and the tier falls back to staging)."""
ALIGNED_HEAD_BYTES = BLOCK_BYTES
_TOMB = struct.Struct("<8sQQ")
TOMBSTONE_BYTES = _TOMB.size  # 24


@dataclass(frozen=True, slots=True)
class Header:
    fingerprint: bytes
    key: bytes
    payload_len: int
    record_check: int
    head_bytes: int = HEADER_BYTES

    @property
    def span(self) -> int:
        return self.head_bytes + self.payload_len


def head_bytes_at(offset: int, payload_len: int) -> int:
    """Header block size of a record written at ``offset`` of its segment: aligned where the
    payload can land on block boundaries, else compact."""
    if offset % BLOCK_BYTES == 0 and payload_len % BLOCK_BYTES == 0:
        return ALIGNED_HEAD_BYTES
    return HEADER_BYTES


def record_heads(payload_lens: Iterable[int]) -> list[int]:
    """Header block size of each record of a fresh segment holding these payloads, in order."""
    heads: list[int] = []
    offset = 0
    for n in payload_lens:
        head = head_bytes_at(offset, n)
        heads.append(head)
        offset += head + n
    return heads


def record_check(header64: bytes | memoryview, digest: bytes) -> int:
    """The record checksum from the first 64 header bytes and the payload digest."""
    return xxhash.xxh3_64_intdigest(bytes(header64) + digest)


def pack_header(
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
    digest: bytes,
    head_bytes: int = HEADER_BYTES,
) -> bytes:
    """The ``head_bytes`` header block of a record whose payload has ``payload_len`` bytes and
    ``digest``: the 72 header bytes, zero padded."""
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, head_bytes, 0, fingerprint, key, payload_len)
    head64 = head + _U64.pack(xxhash.xxh3_64_intdigest(head))
    return head64 + _U64.pack(record_check(head64, digest)) + bytes(head_bytes - HEADER_BYTES)


def parse_header(buf: bytes | memoryview) -> Header | str:
    """The header in ``buf[:72]``, or the reason it cannot be trusted."""
    if len(buf) < HEADER_BYTES:
        return "truncated header"
    magic, version, hbytes, _flags, fp, key, plen = _HEAD.unpack_from(buf, 0)
    hcheck, rcheck = _CHECKS.unpack_from(buf, _HEAD.size)
    if magic != MAGIC:
        return "bad magic"
    if xxhash.xxh3_64_intdigest(buf[: _HEAD.size]) != hcheck:
        return "header checksum mismatch"
    if version != FORMAT_VERSION:
        return f"unsupported format version {version}"
    if hbytes not in (HEADER_BYTES, ALIGNED_HEAD_BYTES):
        return f"unsupported header size {hbytes}"
    return Header(fingerprint=fp, key=key, payload_len=plen, record_check=rcheck, head_bytes=hbytes)


def pack_tombstone(span: int) -> bytes:
    head = struct.pack("<8sQ", DEAD_MAGIC, span)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def parse_tombstone(buf: bytes | memoryview) -> int | None:
    """The span a valid tombstone covers, else ``None``."""
    if len(buf) < TOMBSTONE_BYTES:
        return None
    magic, span, check = _TOMB.unpack_from(buf, 0)
    if magic != DEAD_MAGIC or check != xxhash.xxh3_64_intdigest(bytes(buf[:16])):
        return None
    return int(span)


@dataclass(frozen=True, slots=True)
class ScanItem:
    """One span of a segment: a record (``header`` set), a tombstone, or a bad span."""

    offset: int
    span: int
    header: Header | None = None
    problem: str | None = None
    dead: bool = False


def _next_magic(fd: int, start: int, size: int) -> int:
    """Offset of the next record or tombstone magic at or after ``start``, else ``size``."""
    import os

    chunk = 1 << 20
    pos = start
    while pos < size:
        data = os.pread(fd, min(chunk + 8, size - pos), pos)
        hits = [i for i in (data.find(MAGIC), data.find(DEAD_MAGIC)) if i >= 0]
        if hits:
            return pos + min(hits)
        pos += chunk
    return size


def scan_segment(fd: int, size: int) -> list[ScanItem]:
    """Walk a segment's headers (payloads are not read; reads verify them).

    A header that cannot be trusted makes the span up to the next magic a bad span; a record
    whose payload runs past the end of the file is a truncated record.
    """
    import os

    items: list[ScanItem] = []
    pos = 0
    while pos < size:
        buf = os.pread(fd, HEADER_BYTES, pos)
        span = parse_tombstone(buf)
        if span is not None and span >= TOMBSTONE_BYTES and pos + span <= size:
            items.append(ScanItem(offset=pos, span=span, dead=True))
            pos += span
            continue
        header = parse_header(buf)
        if isinstance(header, str):
            end = _next_magic(fd, pos + 1, size)
            items.append(ScanItem(offset=pos, span=end - pos, problem=header))
            pos = end
            continue
        total = header.span
        if pos + total > size:
            items.append(
                ScanItem(offset=pos, span=size - pos, header=header, problem="truncated record")
            )
            break
        items.append(ScanItem(offset=pos, span=total, header=header))
        pos += total
    return items
