"""Sealing: hash a writable page, share an equal stored page or install it in the dedup index.

Pages are shared only after their bytes compare equal; a matching content hash is a candidate,
never proof. :func:`seal_page` runs once per sealed page, so it stays lean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tessera_ray.core._bytes import equal_bytes
from tessera_ray.core._records import SEALED, PageRecord
from tessera_ray.core._refs import decref, incref
from tessera_ray.core.results import ContentHash, PageHandle, SealResult
from tessera_ray.errors import PageSealedError, PageShapeError

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["hash_pages", "seal_page", "seal_many", "seal_verified"]


def hash_pages(pool: BlockPool, slots: Sequence[int], seed: int) -> list[int]:
    """Content hashes of the bytes now in pages ``slots``; host pages are hashed in place."""
    fn, host, pb = pool._hash, pool._host, pool.page_bytes
    if host is None:
        return pool._device_hasher().hash_rows(slots, seed)
    return [fn(host[s * pb : (s + 1) * pb], seed) for s in slots]


def seal_page(
    pool: BlockPool, rec: PageRecord, ns: int, handle: PageHandle, digest: int | None = None
) -> SealResult:
    """Seal writable ``rec`` (named by ``handle``) under namespace id ``ns``; ``digest`` is its
    content hash when the caller already computed it over the bytes now in the page."""
    i = rec.index
    if digest is None:
        host, pb = pool._host, pool.page_bytes
        page = host[i * pb : (i + 1) * pb] if host is not None else pool._page_buffer(i)
        digest = pool._hash(page, pool._dedup.seeds[ns])
    index = pool._dedup.buckets[ns]
    if digest not in index:
        # Fresh content, the common case: one dict probe, no candidate to compare. Kept lean
        # because sealing must run near raw xxh3 speed (bench_pool's seal_fresh_pages target).
        index[digest] = rec
        rec.state, rec.namespace, rec.digest = SEALED, ns, digest
        pool._sealed += 1
        return SealResult(handle, ContentHash(digest), False, False)
    for cand in pool._dedup.candidates(ns, digest):
        if equal_bytes(pool.data, cand.index, i):
            incref(pool, cand)
            decref(pool, rec)
            pool._dedup_hits += 1
            return SealResult(pool._handle(cand), ContentHash(digest), True, False)
    pool._collisions += 1
    pool._dedup.insert(ns, digest, rec)
    rec.state, rec.namespace, rec.digest = SEALED, ns, digest
    pool._sealed += 1
    return SealResult(handle, ContentHash(digest), False, True)


def seal_many(pool: BlockPool, handles: Sequence[PageHandle], namespace: str) -> list[SealResult]:
    """Seal writable pages ``handles`` under ``namespace``, all checked before any is sealed."""
    recs = pool._distinct(handles)
    for r in recs:
        if r.state == SEALED:
            raise PageSealedError(f"page {r.index} is already sealed")
    ns = pool._dedup.namespace(namespace)
    if pool._host is None:  # device pages: hashed in batches, not copied out one by one
        digests = hash_pages(pool, [r.index for r in recs], pool._dedup.seeds[ns])
        return [
            seal_page(pool, r, ns, h, d) for r, h, d in zip(recs, handles, digests, strict=True)
        ]
    return [seal_page(pool, r, ns, h) for r, h in zip(recs, handles, strict=True)]


def seal_verified(
    pool: BlockPool,
    handles: Sequence[PageHandle],
    namespace: str,
    expected: Sequence[int],
    digests: Sequence[int] | None,
) -> tuple[list[SealResult | None], list[int]]:
    """Seal the pages whose content hash equals ``expected[i]``; see
    :meth:`BlockPool.seal_verified`. Every check runs before any page is sealed."""
    if len(expected) != len(handles):
        raise PageShapeError(f"{len(expected)} expected hashes for {len(handles)} pages")
    if digests is not None and len(digests) != len(handles):
        raise PageShapeError(f"{len(digests)} digests for {len(handles)} pages")
    recs = pool._distinct(handles)
    for r in recs:
        if r.state == SEALED:
            raise PageSealedError(f"page {r.index} is already sealed")
    ns = pool._dedup.namespace(namespace)
    if digests is None:
        digests = pool.hash_pages([r.index for r in recs], pool._dedup.seeds[ns])
    out: list[SealResult | None] = []
    mismatched: list[int] = []
    for pos, (rec, handle, want, digest) in enumerate(
        zip(recs, handles, expected, digests, strict=True)
    ):
        if digest != want:
            mismatched.append(pos)
            out.append(None)
        else:
            out.append(seal_page(pool, rec, ns, handle, digest))
    return out, mismatched
