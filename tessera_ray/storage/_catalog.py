"""The disk tier's in-memory index: where each page's record lies, and segment recency.

Plain bookkeeping, no file IO: eviction only decides which segments go and returns their names,
so the caller can unlink them off the event loop (or, while opening a root, right away).
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from tessera_ray.storage import _files as F

__all__ = ["Catalog", "Entry", "Segment"]


@dataclass(slots=True, eq=False)
class Segment:
    name: str
    size: int
    live: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class Entry:
    segment: Segment
    offset: int
    payload_len: int
    head_bytes: int


class Catalog:
    """Pages to records, and segments in least-recently-used order against a byte capacity.

    A segment's recency is the last use of any of its pages; eviction drops whole segments.
    """

    __slots__ = ("capacity_bytes", "evicted_pages", "index", "segments", "used")

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.index: dict[bytes, Entry] = {}
        self.segments: OrderedDict[str, Segment] = OrderedDict()  # oldest use first
        self.used = 0  # bytes of indexed segments plus writes reserved in flight
        self.evicted_pages = 0

    def touch(self, entry: Entry) -> None:
        self.segments.move_to_end(entry.segment.name)

    def claim(self, seg: Segment, key: bytes, offset: int, payload_len: int, head: int) -> None:
        """Index ``key`` at this record of ``seg`` unless a copy is indexed already: the first
        copy wins (racing writers, a concurrent put of the same page)."""
        if key in self.index:
            return
        self.index[key] = Entry(seg, offset, payload_len, head)
        seg.live.add(key)

    def evict_for(self, incoming: int) -> list[str]:
        """Drop least recently used segments until ``incoming`` more bytes fit; the caller
        unlinks the returned files."""
        gone: list[str] = []
        while self.segments and self.used + incoming > self.capacity_bytes:
            _, seg = self.segments.popitem(last=False)
            for key in seg.live:
                del self.index[key]
            self.evicted_pages += len(seg.live)
            seg.live.clear()
            self.used -= seg.size
            gone.append(seg.name)
        return gone

    def drop(self, key: bytes, entry: Entry, dead: list[str]) -> None:
        """Unindex one page (if ``entry`` is still its record); a segment left without live
        pages is appended to ``dead`` for the caller to unlink."""
        if self.index.get(key) is not entry:
            return
        del self.index[key]
        seg = entry.segment
        seg.live.discard(key)
        if not seg.live and self.segments.pop(seg.name, None) is not None:
            self.used -= seg.size
            dead.append(seg.name)

    def new_name(self, keys: list[bytes]) -> str:
        """A fresh segment file name for a batch of these content hashes.

        Hex only, never caller text; time and pid are mixed in so that rewriting the same keys
        after a delete never reuses a name.
        """
        salt = struct.pack("<qq", time.time_ns(), os.getpid())
        while True:
            name = xxhash.xxh3_128_hexdigest(b"".join(keys) + salt) + F.SEGMENT_SUFFIX
            if name not in self.segments:
                return name
            salt += b"\0"
