"""The verified fetch: what the owner exports, and the reader's read-verify-seal step.

Owner: pin the pages (take references under a lease), then :func:`export_pages` names their
slots and content hashes. Reader: :func:`fetch_verified` reads them into reserved slots with one
transport request, recomputes every page's keyed content hash over the bytes that landed,
seals the pages that match and releases the rest. Nothing is sealed before its bytes verified,
and every reserved slot ends sealed (returned in ``fetched``) or back on the free list (named in
``failed``). The owner unpins when the reader answers, whatever the outcome.

The reads hash what they land (``Transport.read_many(hash_seed=...)``) when the pool is in
host memory and seals with the owner's hash: the transport hashes each page where its bytes
just arrived, still in cache, and the reader compares those digests with the export before
sealing, without a second pass over the bytes. Over a transport whose reads overlap the caller
(NIXL), on a machine with cores to spare, a fetch is split into reads of about
``TransportConfig.chunk_bytes``, all queued at once; each chunk is verified and sealed as soon
as it lands, while the next one is read. A failure part-way keeps the chunks already verified
and sealed (``fetched``) and returns every later slot (``failed``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from tessera_ray.core import (
    BlockPool,
    ContentHash,
    ContentHashFn,
    PageHandle,
    content_seed,
    xxh3_128,
)
from tessera_ray.errors import (
    PageSealedError,
    PageShapeError,
    TransferTimeoutError,
    TransportConfigError,
    TransportError,
)
from tessera_ray.transport._fetch_records import (
    FailedPage,
    FailureReason,
    FetchedPage,
    PageExport,
    PageFetchResult,
    all_failed,
)
from tessera_ray.transport.base import TransferTicket, Transport

# The records live in _fetch_records; they stay importable from here, where callers look.
__all__ = [
    "PageExport",
    "export_pages",
    "FailureReason",
    "FetchedPage",
    "FailedPage",
    "PageFetchResult",
    "fetch_verified",
    "fetch_verified_many",
]


def export_pages(
    pool: BlockPool,
    handles: Sequence[PageHandle],
    *,
    namespace: str,
    peer: str,
    group: int = 0,
) -> PageExport:
    """Owner side: the export of sealed, pinned pages ``handles`` of ``pool`` (layer group
    ``group`` of the owner's transport), with the hashes they were sealed with."""
    return PageExport(
        peer=peer,
        namespace=namespace,
        fingerprint=pool.fingerprint,
        page_bytes=pool.page_bytes,
        slots=tuple(int(pool.slot(h)) for h in handles),
        content_hashes=tuple(int(pool.content_hash_of(h)) for h in handles),
        group=group,
    )


def _page_views(pool: BlockPool, slots: list[int]) -> list[memoryview]:
    """Host byte views of pages ``slots`` (in place for a host pool, a staged copy on a GPU)."""
    pb = pool.page_bytes
    if pool.data.device.type == "cpu":
        flat = pool.data.numpy().reshape(-1).data
        return [flat[s * pb : (s + 1) * pb] for s in slots]
    index = torch.tensor(slots, dtype=torch.long, device=pool.data.device)
    host = pool.data.index_select(0, index).cpu().numpy().reshape(-1).data
    return [host[i * pb : (i + 1) * pb] for i in range(len(slots))]


@dataclass(slots=True)
class _Pending:
    """One export in flight: its reserved pages, and the reads (chunks) it was split into."""

    export: PageExport
    pool: BlockPool
    handles: list[PageHandle]
    slots: list[int]
    hash_seed: int | None = None
    """Seed the reads hash their pages with, when they do (see the module docstring)."""
    chunks: list[tuple[int, int, TransferTicket | None]] = field(default_factory=list)
    """``(first position, end position, ticket)`` per read, in order."""
    next_chunk: int = 0
    """Chunks before it are settled (their pages sealed or released)."""
    done: PageFetchResult | None = None


def fetch_verified(
    transport: Transport,
    export: PageExport,
    *,
    local: Sequence[PageHandle] | None = None,
    timeout_s: float | None = None,
    content_hash: ContentHashFn = xxh3_128,
) -> PageFetchResult:
    """Read ``export``'s pages into the transport's pool of ``export.group``, verify, seal.

    ``local`` are reserved writable pages of that pool, one per exported page; ``None``
    reserves them here (raising ``PoolExhaustedError`` before anything moves). The function
    owns them from the call on: each ends sealed (``fetched``) or released (``failed``).
    ``content_hash`` must be the hash the owner's pool seals with (the default everywhere).
    """
    return fetch_verified_many(
        transport,
        [export],
        local=None if local is None else [local],
        timeout_s=timeout_s,
        content_hash=content_hash,
    )[0]


def fetch_verified_many(
    transport: Transport,
    exports: Sequence[PageExport],
    *,
    local: Sequence[Sequence[PageHandle]] | None = None,
    timeout_s: float | None = None,
    content_hash: ContentHashFn = xxh3_128,
) -> list[PageFetchResult]:
    """:func:`fetch_verified` of several exports (one per layer group, or per owner): every
    read is posted before the first is waited for, so they overlap where the backend allows.
    ``timeout_s`` bounds the whole call. Slots are reserved for all exports before any read."""
    if local is not None and len(local) != len(exports):
        raise TransportConfigError(f"{len(local)} reserved lists for {len(exports)} exports")
    slots: list[list[int] | None] = []
    for i, e in enumerate(exports):
        pool = transport.pool_of(e.group)
        if local is None:
            slots.append(None)
            continue
        if len(local[i]) != len(e):
            raise TransportConfigError(f"{len(local[i])} reserved pages for {len(e)} exported")
        try:
            slots.append(pool.writable_slots(local[i]))
        except (PageSealedError, PageShapeError) as err:
            raise TransportConfigError(
                f"reserved pages must be distinct and writable (allocated, not sealed): {err}"
            ) from err
    pending = [
        _reserve(transport, e, None if local is None else list(local[i]), slots[i], content_hash)
        for i, e in enumerate(exports)
    ]
    deadline = time.monotonic() + (transport.config.timeout_s if timeout_s is None else timeout_s)
    try:
        for p in pending:
            _start(transport, p)
    except BaseException:
        for p in pending:
            _drop(transport, p)
        raise
    results = []
    for i, p in enumerate(pending):
        try:
            results.append(_finish(transport, p, deadline, content_hash))
        except BaseException:
            for q in pending[i:]:
                _drop(transport, q)
            raise
    return results


def _reserve(
    transport: Transport,
    export: PageExport,
    local: list[PageHandle] | None,
    local_slots: list[int] | None,
    content_hash: ContentHashFn,
) -> _Pending:
    pool = transport.pool_of(export.group)
    if export.fingerprint != pool.fingerprint or export.page_bytes != pool.page_bytes:
        if local:
            pool.release_many(local)
        done = all_failed(
            export,
            FailureReason.LAYOUT_MISMATCH,
            f"owner pool {export.fingerprint!r}/{export.page_bytes} B does not match this pool "
            f"{pool.fingerprint!r}/{pool.page_bytes} B",
        )
        return _Pending(export, pool, [], [], done=done)
    if not len(export):
        return _Pending(export, pool, [], [], done=PageFetchResult((), (), 0))
    # The read hashes the landed pages only for a host pool that seals with the owner's hash,
    # where they are still in the CPU's cache. A device pool gains nothing from that: _finish
    # hashes each chunk in one batch on the device (BlockPool.seal_verified).
    seed = (
        content_seed(export.namespace, pool.fingerprint)
        if content_hash is pool.content_hash_fn and pool.data.device.type == "cpu"
        else None
    )
    if local is not None and local_slots is not None:
        return _Pending(export, pool, local, local_slots, seed)
    # Pages this call just allocated: their slot is in the handle, no lookup needed.
    handles = pool.allocate_many(len(export))
    return _Pending(export, pool, handles, [h.offset // h.length for h in handles], seed)


def _chunk_pages(transport: Transport, page_bytes: int, n: int) -> int:
    chunk_bytes = transport.config.chunk_bytes
    if not transport.capabilities.overlaps_caller or chunk_bytes == 0:
        return n  # nothing would overlap: one request
    return max(1, chunk_bytes // page_bytes)


def _start(transport: Transport, p: _Pending) -> None:
    if p.done is not None:
        return
    e, n = p.export, len(p.export)
    step = _chunk_pages(transport, e.page_bytes, n)
    bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
    try:
        tickets = transport.read_many(
            e.peer,
            [(e.slots[a:b], p.slots[a:b]) for a, b in bounds],
            group=e.group,
            hash_seed=p.hash_seed,
        )
    except TransportError as err:
        p.chunks.append((0, n, None))  # read_many left nothing running
        p.done = _fail_from(transport, p, 0, err, None)
        return
    p.chunks = [(a, b, t) for (a, b), t in zip(bounds, tickets, strict=True)]


def _fail_from(
    transport: Transport, p: _Pending, chunk: int, err: TransportError, failed_safe: bool | None
) -> PageFetchResult:
    """Chunks from ``chunk`` on failed with ``err``: chunk ``chunk`` is the read that failed
    (its slots safe or not; ``None`` when no read failed but one could not start), later ones
    are aborted. Every slot that can no longer be written is released, the rest withheld."""
    reason = (
        FailureReason.TIMEOUT
        if isinstance(err, TransferTimeoutError)
        else FailureReason.TRANSFER_FAILED
    )
    release: list[PageHandle] = []
    withheld = 0
    start = p.chunks[chunk][0]
    for i, (a, b, ticket) in enumerate(p.chunks[chunk:]):
        if i == 0 and failed_safe is not None:
            safe = failed_safe
        else:
            safe = ticket is None or transport.abort(ticket)
        if safe:
            release += p.handles[a:b]
        else:
            withheld += b - a
    p.next_chunk = len(p.chunks)
    if release:
        p.pool.release_many(release)
    e = p.export
    failed = tuple(
        FailedPage(i, ContentHash(e.content_hashes[i]), reason, str(err))
        for i in range(start, len(e))
    )
    return PageFetchResult((), failed, 0, withheld)


def _drop(transport: Transport, p: _Pending) -> None:
    """Give back what an interrupted fetch holds; a read still in flight could write into its
    slots, so they are freed only once the transport confirms it was cancelled."""
    if p.done is None:
        release: list[PageHandle] = []
        for a, b, ticket in p.chunks[p.next_chunk :]:
            if ticket is None or transport.abort(ticket):
                release += p.handles[a:b]
        if not p.chunks:
            release = p.handles
        p.pool.release_many(release)
    p.done = p.done or PageFetchResult((), (), 0)


def _mismatch(export: PageExport, i: int, got: int | None) -> FailedPage:
    want = export.content_hashes[i]
    seen = f"hashed to {got:032x}" if got is not None else "did not hash to it"
    return FailedPage(
        i,
        ContentHash(want),
        FailureReason.HASH_MISMATCH,
        f"page {i} (owner slot {export.slots[i]}) from {export.peer!r} {seen}, expected "
        f"{want:032x}: corrupted, not installed",
    )


def _finish(
    transport: Transport, p: _Pending, deadline: float, content_hash: ContentHashFn
) -> PageFetchResult:
    if p.done is not None:
        return p.done
    export, pool, handles = p.export, p.pool, p.handles
    seed = content_seed(export.namespace, pool.fingerprint)
    # The C function directly for the default hash: one Python frame less per page.
    fn = xxhash.xxh3_128_intdigest if content_hash is xxh3_128 else content_hash
    fetched: list[FetchedPage] = []
    failed: list[FailedPage] = []
    withheld = landed = 0
    while p.next_chunk < len(p.chunks):
        a, b, ticket = p.chunks[p.next_chunk]
        assert ticket is not None
        try:
            digests = transport.wait(ticket, max(deadline - time.monotonic(), 0.0))
        except TransportError as err:
            tail = _fail_from(transport, p, p.next_chunk, err, err.slots_safe)
            failed += tail.failed
            withheld = tail.withheld_slots
            break
        p.next_chunk += 1
        landed += b - a
        if content_hash is pool.content_hash_fn:
            # The pool hashes with the owner's function: verify and seal in one hash pass.
            sealed, mismatched = pool.seal_verified(
                handles[a:b], export.namespace, export.content_hashes[a:b], digests
            )
            bad = [_mismatch(export, a + m, None) for m in mismatched]
            fetched += [
                FetchedPage(i, r.content_hash, r.handle, r.deduplicated)
                for i, r in enumerate(sealed, a)
                if r is not None
            ]
        else:
            good: list[int] = []
            bad = []
            for i, view in zip(range(a, b), _page_views(pool, p.slots[a:b]), strict=True):
                got = fn(view, seed)
                if got == export.content_hashes[i]:
                    good.append(i)
                else:
                    bad.append(_mismatch(export, i, got))
            if good:
                results = pool.seal_many([handles[i] for i in good], export.namespace)
                fetched += (
                    FetchedPage(i, r.content_hash, r.handle, r.deduplicated)
                    for i, r in zip(good, results, strict=True)
                )
        if bad:
            pool.release_many([handles[f.position] for f in bad])
            failed += bad
    failed.sort(key=lambda f: f.position)
    p.done = PageFetchResult(tuple(fetched), tuple(failed), landed * pool.page_bytes, withheld)
    return p.done
