"""The disk tier: checksummed page records in immutable segment files, verified on every read.

Why segment files (one per written batch) and not one file per page: a per-page fsync costs a
journal commit each, while a segment pays one fsync and one directory fsync per batch, the
durability point of a raw write (measurements: docs/measured-choices.md). Records stay
individually checksummed, so one bad record is quarantined alone and its neighbours stay
readable.

Eviction works on segments: a segment's recency is the last use of any of its pages, and the
least recently used segment is unlinked whole (pages of one batch are usually one request's
prefix, used together). ``delete`` overwrites single records with tombstones; their bytes are
reclaimed when the segment's last page goes. Recency is not persisted: after a restart the
segments' modification times order them.

Segment IO goes around the page cache (``O_DIRECT``) where the filesystem allows it, else
through it; ``DiskTierConfig.direct_io`` says why and chooses (``_direct`` has the transfers).
The index and eviction live in ``_catalog``, opening and the restart scan in ``_recovery``,
quarantine, tombstones and unlinks in ``_repair``.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tessera_ray.errors import CorruptPageError, PageNotFoundError, StorageError
from tessera_ray.storage import _files as F
from tessera_ray.storage import _io
from tessera_ray.storage._catalog import Catalog, Entry, Segment
from tessera_ray.storage._format import head_bytes_at, record_heads
from tessera_ray.storage._recovery import choose_direct, prepare_root, rebuild
from tessera_ray.storage._repair import Span, delete_records, quarantine_record, unlink_segments
from tessera_ray.storage.config import DiskTierConfig
from tessera_ray.storage.keys import ContentHasher, Payload, content_hasher, normalize_key
from tessera_ray.storage.keys import writable_view as _writable
from tessera_ray.storage.tier import StorageTier, TierCapabilities

__all__ = ["DiskTier", "DiskTierStats"]

_T = TypeVar("_T")
_Item = tuple[bytes, memoryview]


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


class DiskTier(StorageTier):
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
        self._cat = Catalog(cfg.capacity_bytes)
        # A bad record found by a read is quarantined on the IO thread that read it.
        self._quarantine: _io.Quarantine = functools.partial(quarantine_record, self._root)
        self._corrupt_total = 0
        self._partials_cleaned = 0
        self._orphans = 0
        self._lock_fd: int | None = None
        self._direct = False
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="tessera-disk")
        self._open(custom_hasher=hasher is not None)

    # --- opening / restart ------------------------------------------------------------------

    def _open(self, *, custom_hasher: bool) -> None:
        prepare_root(self.config, custom_hasher=custom_hasher)
        self._direct = choose_direct(self.config)
        self._lock_fd = F.take_lock(self._root, what="close it there first")
        found = rebuild(self.config, self._fp16, self._cat)
        self._partials_cleaned = found.partials_cleaned
        self._orphans = found.orphans
        self._corrupt_total = found.corrupt

    @property
    def direct_io(self) -> bool:
        """Whether this root's segments are read and written around the page cache."""
        return self._direct

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- writes -----------------------------------------------------------------------------

    def _write_segment(self, name: str, items: list[_Item], digests: list[bytes]) -> int:
        return _io.write_segment(
            self._seg_dir, name, self._fp16, items, digests, direct=self._direct
        )

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
        """Store pages under their content hashes (see :class:`StorageTier`).

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
            entry = self._cat.index.get(key)
            if entry is not None:
                self._cat.touch(entry)
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
            gone = self._cat.evict_for(size)
            self._cat.used += size  # reserved before the write: concurrent puts respect capacity
            name = self._cat.new_name([k for k, _ in chunk])
            try:
                if gone:
                    await self._run(unlink_segments, self._seg_dir, gone)
                await self._run(self._write_segment, name, chunk, digests)
            except OSError as exc:
                self._cat.used -= size
                if isinstance(exc, StorageError):
                    raise
                raise F.storage_error(
                    exc, f"cannot write {len(chunk)} pages to {self._root}"
                ) from None
            seg = Segment(name=name, size=size)
            offset = 0
            for (key, view), head in zip(chunk, heads, strict=True):
                # A concurrent put may have stored the page meanwhile: claim keeps that copy.
                self._cat.claim(seg, key, offset, view.nbytes, head)
                offset += head + view.nbytes
            self._cat.segments[name] = seg

    # --- reads ------------------------------------------------------------------------------

    async def _read(
        self, keys: Sequence[bytes | str], outs: list[memoryview] | None
    ) -> list[bytes | int | _io.Corrupt | None]:
        raws = [normalize_key(k) for k in keys]
        plan: list[_io.ReadItem] = []
        entries: list[Entry] = []
        where: list[int] = []
        for i, key in enumerate(raws):
            entry = self._cat.index.get(key)
            if entry is not None:
                plan.append(
                    _io.ReadItem(
                        key, entry.segment.name, entry.offset, entry.payload_len, entry.head_bytes
                    )
                )
                entries.append(entry)
                where.append(i)
                self._cat.touch(entry)
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
                self._cat.drop(item.key, entry, dead)
        if dead:
            await self._run(unlink_segments, self._seg_dir, dead)
        return out

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
        return [normalize_key(k) in self._cat.index for k in keys]

    async def delete_many(self, keys: Sequence[bytes | str]) -> list[bool]:
        raws = [normalize_key(k) for k in keys]
        removed: list[bool] = []
        dead: list[str] = []
        spans: list[Span] = []
        for key in raws:
            entry = self._cat.index.get(key)
            removed.append(entry is not None)
            if entry is None:
                continue
            self._cat.drop(key, entry, dead)
            if entry.segment.live:  # others still live there: tombstone just this record
                span = entry.head_bytes + entry.payload_len
                spans.append((entry.segment.name, entry.offset, span, entry.segment.size + 1))
        spans = [s for s in spans if s[0] not in dead]
        if spans or dead:
            try:
                await self._run(delete_records, self._seg_dir, spans, dead)
            except OSError as exc:
                raise F.storage_error(exc, f"cannot delete pages from {self._root}") from None
        return removed

    async def keys(self) -> AsyncIterator[bytes]:
        for key in list(self._cat.index):
            yield key

    def __len__(self) -> int:
        return len(self._cat.index)

    @property
    def used_bytes(self) -> int:
        return self._cat.used

    @property
    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            pages=len(self._cat.index),
            segments=len(self._cat.segments),
            used_bytes=self._cat.used,
            capacity_bytes=self.config.capacity_bytes,
            corrupt_total=self._corrupt_total,
            evicted_pages_total=self._cat.evicted_pages,
            partials_cleaned=self._partials_cleaned,
            orphans=self._orphans,
        )

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
