"""The disk tier: checksummed page records in immutable segment files, verified on every read.

Why segment files (one per written batch) and not one file per page: a per-page fsync costs a
journal commit each, and a file per page wrote several times slower than segments
(docs/measured-choices.md); a segment pays one fsync and one directory fsync per batch, the
durability point of a raw write. Records stay individually checksummed, so one bad record is
quarantined alone and its neighbours stay readable.

Eviction works on segments: a segment's recency is the last use of any of its pages, and the
least recently used segment is unlinked whole (pages of one batch are usually one request's
prefix, used together). ``delete`` overwrites single records with tombstones; their bytes are
reclaimed when the segment's last page goes. Recency is not persisted: after a restart the
segments' modification times order them.

Segment IO goes around the page cache (``O_DIRECT``) where the filesystem allows it, else
through it; ``DiskTierConfig.direct_io`` says why and chooses (``_direct`` has the transfers).
"""

from __future__ import annotations

import asyncio
import functools
import os
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from tessera_ray.errors import (
    CorruptPageError,
    LayoutMismatchError,
    PageNotFoundError,
    StorageConfigError,
    StorageError,
)
from tessera_ray.storage import _direct as D
from tessera_ray.storage import _files as F
from tessera_ray.storage import _io
from tessera_ray.storage._format import head_bytes_at, record_heads, scan_segment
from tessera_ray.storage._progress import Progress
from tessera_ray.storage.config import DiskTierConfig
from tessera_ray.storage.keys import ContentHasher, Payload, content_hasher, normalize_key
from tessera_ray.storage.keys import writable_view as _writable
from tessera_ray.storage.tier import Tier, TierCapabilities

__all__ = ["DiskTier", "DiskTierStats"]

_T = TypeVar("_T")
_Item = tuple[bytes, memoryview]


@dataclass(slots=True)
class _Entry:
    segment: _Segment
    offset: int
    payload_len: int
    head_bytes: int


@dataclass(slots=True, eq=False)
class _Segment:
    name: str
    size: int
    live: set[bytes] = field(default_factory=set)


@dataclass(frozen=True, kw_only=True)
class DiskTierStats:
    pages: int
    segments: int
    used_bytes: int
    capacity_bytes: int
    corrupt_total: int
    evicted_pages_total: int
    partials_cleaned: int
    orphans: int


class DiskTier(Tier):
    """Pages of one layout in segment files under ``root`` (see the module docstring).

    Opening an existing root rebuilds the index from the segments' headers, deletes
    ``.partial`` leftovers of killed writers and quarantines records it cannot trust.
    """

    capabilities = TierCapabilities(
        persistent=True, verifies_reads=True, evicts=True, reads_into=True
    )

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        *,
        fingerprint: str,
        namespace: str = "default",
        hasher: ContentHasher | None = None,
        segment_max_bytes: int = 64 << 20,
        io_threads: int = 4,
        direct_io: bool | None = None,
        progress: bool | None = None,
    ) -> None:
        cfg = DiskTierConfig(
            root=Path(root),
            capacity_bytes=capacity_bytes,
            fingerprint=fingerprint,
            namespace=namespace,
            segment_max_bytes=segment_max_bytes,
            io_threads=io_threads,
            direct_io=direct_io,
            progress=progress,
        )
        self.config = cfg
        self._root = cfg.root
        self._seg_dir = cfg.root / F.SEGMENTS
        self._fp16 = F.fingerprint_bytes(cfg.fingerprint)
        # The root's own content hash feeds every record checksum (see _format); a custom
        # hasher only names pages.
        self._hashing = _io.Hashing(
            digest=content_hasher(cfg.namespace, cfg.fingerprint), key_of=hasher
        )
        self._index: dict[bytes, _Entry] = {}
        self._segments: OrderedDict[str, _Segment] = OrderedDict()  # oldest use first
        self._used = 0
        self._corrupt_total = 0
        self._evicted_pages = 0
        self._partials_cleaned = 0
        self._orphans = 0
        self._lock_fd: int | None = None
        self._direct = False
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="tessera-disk")
        self._open(custom_hasher=hasher is not None)

    @classmethod
    def from_config(cls, cfg: DiskTierConfig, *, hasher: ContentHasher | None = None) -> DiskTier:
        return cls(
            cfg.root,
            cfg.capacity_bytes,
            fingerprint=cfg.fingerprint,
            namespace=cfg.namespace,
            hasher=hasher,
            segment_max_bytes=cfg.segment_max_bytes,
            io_threads=cfg.io_threads,
            direct_io=cfg.direct_io,
            progress=cfg.progress,
        )

    # --- opening / restart ------------------------------------------------------------------

    def _open(self, *, custom_hasher: bool) -> None:
        root = self._root
        try:
            for d in (root, self._seg_dir, root / F.QUARANTINE):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise F.storage_error(exc, f"cannot create tier root {root}") from None
        meta = F.read_meta(root)
        want = F.RootMeta(
            fingerprint=self.config.fingerprint,
            namespace=self.config.namespace,
            hasher="custom" if custom_hasher else F.DEFAULT_HASHER,
        )
        if meta is None:
            try:
                F.write_meta(root, want)
            except OSError as exc:
                raise F.storage_error(exc, f"cannot initialise tier root {root}") from None
        elif meta.fingerprint != want.fingerprint or meta.namespace != want.namespace:
            raise LayoutMismatchError(
                f"tier root {root} holds layout {meta.fingerprint} (namespace "
                f"{meta.namespace!r}), not {want.fingerprint} ({want.namespace!r}); open it with "
                "that layout or use another root"
            )
        self._direct = self._choose_direct()
        self._lock_fd = F.take_lock(self._root, what="close it there first")
        self._rebuild()

    def _choose_direct(self) -> bool:
        wanted = self.config.direct_io
        if wanted is False:
            return False
        if D.direct_supported(self._root / F.META_NAME):
            return True
        if wanted:
            raise StorageConfigError(
                f"direct_io=True but the filesystem of {self._root} does not support O_DIRECT; "
                "use direct_io=None (auto) or False, or a root on another filesystem"
            )
        return False

    @property
    def direct_io(self) -> bool:
        """Whether this root's segments are read and written around the page cache."""
        return self._direct

    def _rebuild(self) -> None:
        names = sorted(os.listdir(self._seg_dir))
        segs: list[tuple[float, str, int]] = []
        for name in names:
            path = self._seg_dir / name
            if name.endswith(F.PARTIAL_SUFFIX):
                # A writer died before its rename: the batch was never acknowledged.
                try:
                    path.unlink()
                    self._partials_cleaned += 1
                except OSError:
                    pass  # read-only root: never indexed, so never served
            elif F.segment_name_ok(name):
                st = path.stat()
                segs.append((st.st_mtime, name, st.st_size))
            else:
                self._orphans += 1  # not ours: fsck reports it, the tier ignores it
        segs.sort()
        show = Progress.wanted(
            len(segs), min_items=self.config.progress_min_files, force=self.config.progress
        )
        bar = Progress(f"indexing {self._root}", len(segs), enabled=show)
        for _mtime, name, size in segs:
            self._load_segment(name, size)
            bar.advance()
        bar.close()
        self._evict_for(0)

    def _load_segment(self, name: str, size: int) -> None:
        path = self._seg_dir / name
        if size == 0:
            self._try_repair(lambda: F.quarantine_file(self._root, path, "empty segment"))
            return
        seg = _Segment(name=name, size=size)
        fd = os.open(path, os.O_RDONLY)
        try:
            items = scan_segment(fd, size)
        finally:
            os.close(fd)
        for item in items:
            if item.dead:
                continue
            h = item.header
            problem = item.problem
            if problem is None and h is not None and h.fingerprint != self._fp16:
                problem = "layout fingerprint mismatch"
            if problem is not None:
                key = h.key if h is not None else None
                self._corrupt_total += 1
                self._try_repair(
                    functools.partial(
                        self._quarantine, name, item.offset, item.span, key, problem, size
                    )
                )
                continue
            assert h is not None
            if h.key in self._index:  # a duplicate from racing writers: first copy wins
                continue
            self._index[h.key] = _Entry(seg, item.offset, h.payload_len, h.head_bytes)
            seg.live.add(h.key)
        if seg.live:
            self._segments[name] = seg
            self._used += size
        else:
            self._try_repair(lambda: self._unlink_segments([name]))

    @staticmethod
    def _try_repair(fn: Callable[[], object]) -> None:
        try:
            fn()
        except OSError:
            pass  # read-only root: the record is not indexed, so it is never served

    # --- IO helpers -------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _quarantine(
        self, seg_name: str, offset: int, span: int, key: bytes | None, reason: str, size: int
    ) -> None:
        F.quarantine_span(self._root, seg_name, offset, span, key, reason)
        F.kill_span(self._seg_dir / seg_name, offset, span, size)

    def _unlink_segments(self, names: list[str]) -> None:
        for name in names:
            try:
                (self._seg_dir / name).unlink()
            except FileNotFoundError:
                pass
        if names:
            F.fsync_dir(self._seg_dir)

    def _evict_for(self, incoming: int) -> list[str]:
        """Drop least recently used segments from the index until ``incoming`` bytes fit; the
        caller unlinks the returned files."""
        gone: list[str] = []
        while self._segments and self._used + incoming > self.config.capacity_bytes:
            _, seg = self._segments.popitem(last=False)
            for key in seg.live:
                del self._index[key]
            self._evicted_pages += len(seg.live)
            seg.live.clear()
            self._used -= seg.size
            gone.append(seg.name)
        if gone and incoming == 0:
            self._try_repair(lambda: self._unlink_segments(gone))
        return gone

    # --- writes -----------------------------------------------------------------------------

    def _write_segment(self, name: str, items: list[_Item], digests: list[bytes]) -> int:
        return _io.write_segment(
            self._seg_dir, name, self._fp16, items, digests, direct=self._direct
        )

    def _segment_name(self, keys: list[bytes]) -> str:
        # Named by a hash of its content hashes (plus time and pid, so that rewriting the same
        # keys after a delete never reuses a name): hex only, never caller text.
        salt = struct.pack("<qq", time.time_ns(), os.getpid())
        while True:
            name = xxhash.xxh3_128_hexdigest(b"".join(keys) + salt) + F.SEGMENT_SUFFIX
            if name not in self._segments:
                return name
            salt += b"\0"

    def _chunks(self, fresh: list[_Item]) -> list[list[_Item]]:
        """``fresh`` cut into runs that each fit one segment (order kept)."""
        chunks: list[list[_Item]] = [[]]
        size = 0
        for key, view in fresh:
            rec = head_bytes_at(0, view.nbytes) + view.nbytes  # its size first in a segment
            if rec > self.config.capacity_bytes:
                raise StorageError(
                    f"a page of {view.nbytes} B does not fit in capacity_bytes "
                    f"{self.config.capacity_bytes}; raise the capacity"
                )
            if chunks[-1] and size + rec > self.config.segment_max_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append((key, view))
            size += rec
        return chunks

    async def put_many(
        self, items: Sequence[tuple[bytes | str, Payload]], *, prehashed: bool = False
    ) -> None:
        """Store pages under their content hashes (see :class:`Tier`).

        ``prehashed``: the caller just computed every key from its payload with this root's
        hasher (a pool spilling pages it sealed), so the write does not hash the payloads
        again: on a root with the default hasher the key is the digest the record checksum
        needs. Reads verify every page whatever was claimed here, so a wrong claim stores a
        record that fails its checks, is quarantined and is never served. Without it (the
        default) a payload that does not hash to its key fails the batch before anything is
        written. A root with a custom key function always hashes.
        """
        views = self._views(items)
        fresh: list[tuple[bytes, memoryview]] = []
        seen: set[bytes] = set()
        for key, view in views:
            entry = self._index.get(key)
            if entry is not None:
                self._segments.move_to_end(entry.segment.name)
            elif key not in seen:
                seen.add(key)
                fresh.append((key, view))
        if not fresh:
            return
        if prehashed and self._hashing.key_of is None:
            all_digests = [key for key, _ in fresh]
        else:
            # One pass over each payload: checks its key and gives the digest its record
            # checksum needs, before anything is evicted or written.
            all_digests = await self._run(_io.digest_batch, fresh, self._hashing)
        done = 0
        for chunk in self._chunks(fresh):
            digests = all_digests[done : done + len(chunk)]
            done += len(chunk)
            heads = record_heads(v.nbytes for _, v in chunk)
            size = sum(heads) + sum(v.nbytes for _, v in chunk)
            gone = self._evict_for(size)
            self._used += size  # reserved before the write so concurrent puts respect capacity
            name = self._segment_name([k for k, _ in chunk])
            try:
                if gone:
                    await self._run(self._unlink_segments, gone)
                await self._run(self._write_segment, name, chunk, digests)
            except OSError as exc:
                self._used -= size
                if isinstance(exc, StorageError):
                    raise
                raise F.storage_error(
                    exc, f"cannot write {len(chunk)} pages to {self._root}"
                ) from None
            seg = _Segment(name=name, size=size)
            offset = 0
            for (key, view), head in zip(chunk, heads, strict=True):
                if key not in self._index:  # a concurrent put may have stored it meanwhile
                    self._index[key] = _Entry(seg, offset, view.nbytes, head)
                    seg.live.add(key)
                offset += head + view.nbytes
            self._segments[name] = seg

    # --- reads ------------------------------------------------------------------------------

    async def _read(
        self, keys: Sequence[bytes | str], outs: list[memoryview] | None
    ) -> list[bytes | int | _io.Corrupt | None]:
        raws = [normalize_key(k) for k in keys]
        plan: list[_io.ReadItem] = []
        entries: list[_Entry] = []
        where: list[int] = []
        for i, key in enumerate(raws):
            entry = self._index.get(key)
            if entry is not None:
                plan.append(
                    _io.ReadItem(
                        key, entry.segment.name, entry.offset, entry.payload_len, entry.head_bytes
                    )
                )
                entries.append(entry)
                where.append(i)
                self._segments.move_to_end(entry.segment.name)
        views = [outs[i] for i in where] if outs is not None else None
        got = await self._run(
            functools.partial(_io.read_records, direct=self._direct),
            self._seg_dir,
            plan,
            views,
            self._fp16,
            self._hashing,
            self._quarantine,
        )
        out: list[bytes | int | _io.Corrupt | None] = [None] * len(raws)
        dead: list[str] = []
        for item, entry, i, result in zip(plan, entries, where, got, strict=True):
            out[i] = result
            if isinstance(result, _io.Corrupt):
                self._corrupt_total += 1
                self._drop(item.key, entry, dead)
        if dead:
            await self._run(self._unlink_segments, dead)
        return out

    def _drop(self, key: bytes, entry: _Entry, dead: list[str]) -> None:
        if self._index.get(key) is not entry:
            return
        del self._index[key]
        seg = entry.segment
        seg.live.discard(key)
        if not seg.live and self._segments.pop(seg.name, None) is not None:
            self._used -= seg.size
            dead.append(seg.name)

    async def get_many(self, keys: Sequence[bytes | str]) -> list[bytes | None]:
        return [r if isinstance(r, bytes) else None for r in await self._read(keys, None)]

    async def get_many_into(
        self, keys: Sequence[bytes | str], outs: Sequence[Payload]
    ) -> list[int | None]:
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        views = [_writable(o) for o in outs]
        return [r if isinstance(r, int) else None for r in await self._read(keys, views)]

    def _raise_for(self, key: bytes, result: object) -> None:
        if isinstance(result, _io.Corrupt):
            raise CorruptPageError(
                f"page {key.hex()} failed verification ({result.reason}); it was quarantined "
                f"under {self._root / F.QUARANTINE} and will not be served: recompute it"
            )
        raise PageNotFoundError(f"no page {key.hex()} in disk tier {self._root}")

    async def get(self, key: bytes | str) -> bytes:
        raw = normalize_key(key)
        (result,) = await self._read([raw], None)
        if not isinstance(result, bytes):
            self._raise_for(raw, result)
        assert isinstance(result, bytes)
        return result

    async def get_into(self, key: bytes | str, out: Payload) -> int:
        raw = normalize_key(key)
        (result,) = await self._read([raw], [_writable(out)])
        if not isinstance(result, int):
            self._raise_for(raw, result)
        assert isinstance(result, int)
        return result

    # --- the rest of the interface ----------------------------------------------------------

    async def contains_many(self, keys: Sequence[bytes | str]) -> list[bool]:
        return [normalize_key(k) in self._index for k in keys]

    def _delete_records(self, spans: list[tuple[str, int, int, int]], unlink: list[str]) -> None:
        for seg_name, offset, span, size in spans:
            try:
                F.kill_span(self._seg_dir / seg_name, offset, span, size)
            except FileNotFoundError:
                pass
        self._unlink_segments(unlink)

    async def delete_many(self, keys: Sequence[bytes | str]) -> list[bool]:
        raws = [normalize_key(k) for k in keys]
        removed: list[bool] = []
        dead: list[str] = []
        spans: list[tuple[str, int, int, int]] = []
        for key in raws:
            entry = self._index.get(key)
            removed.append(entry is not None)
            if entry is None:
                continue
            self._drop(key, entry, dead)
            if entry.segment.live:  # others still live there: tombstone just this record
                span = entry.head_bytes + entry.payload_len
                spans.append((entry.segment.name, entry.offset, span, entry.segment.size + 1))
        spans = [s for s in spans if s[0] not in dead]
        if spans or dead:
            try:
                await self._run(self._delete_records, spans, dead)
            except OSError as exc:
                raise F.storage_error(exc, f"cannot delete pages from {self._root}") from None
        return removed

    async def keys(self) -> AsyncIterator[bytes]:
        for key in list(self._index):
            yield key

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            pages=len(self._index),
            segments=len(self._segments),
            used_bytes=self._used,
            capacity_bytes=self.config.capacity_bytes,
            corrupt_total=self._corrupt_total,
            evicted_pages_total=self._evicted_pages,
            partials_cleaned=self._partials_cleaned,
            orphans=self._orphans,
        )

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
