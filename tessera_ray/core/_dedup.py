"""The dedup index: sealed pages by (namespace, content hash), tenant namespaces as ids, and the
sealing decision that uses them.

Scoped by namespace on purpose: two tenants never share a page, even with equal bytes, so a
hash collision (accidental or crafted) cannot cross tenants. A bucket holds every sealed page
of a namespace with one hash value (a record, or a list once pages collide). Pages are shared
only after their bytes compare equal; a matching content hash is a candidate, never proof.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera_ray.core._bytes import equal_bytes
from tessera_ray.core._pages import PageTable
from tessera_ray.core._records import SEALED, PageRecord
from tessera_ray.core._storage import PageMemory
from tessera_ray.core.hashing import content_seed
from tessera_ray.core.results import ContentHash, PageHandle, SealResult
from tessera_ray.errors import PoolConfigError

__all__ = ["DedupIndex"]

_Bucket = PageRecord | list[PageRecord]


class DedupIndex:
    """Namespaces (name, id, content-hash seed) and, per namespace, ``digest -> bucket``.

    Seals pages through the page table it is given (which owns their state and references),
    hashing and comparing their bytes in the pool's memory; counts dedup hits and collisions.
    """

    __slots__ = (
        "_buckets",
        "_collisions",
        "_fingerprint",
        "_hits",
        "_ids",
        "_memory",
        "_names",
        "_pages",
        "_seeds",
    )

    def __init__(self, fingerprint: str, pages: PageTable, memory: PageMemory) -> None:
        self._fingerprint = fingerprint
        self._pages = pages
        self._memory = memory
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._seeds: list[int] = []
        """Content-hash seed of each namespace (keyed by namespace and layout fingerprint)."""
        self._buckets: list[dict[int, _Bucket]] = []
        self._hits = 0
        self._collisions = 0

    # ----------------------------------------------------------------- namespaces

    def namespace(self, name: str) -> int:
        """The id of namespace ``name``, registering it on first use."""
        ns = self._ids.get(name)
        if ns is None:
            if not isinstance(name, str) or not name:
                raise PoolConfigError(f"namespace must be a non-empty str, got {name!r}")
            ns = len(self._names)
            self._ids[name] = ns
            self._names.append(name)
            self._seeds.append(content_seed(name, self._fingerprint))
            self._buckets.append({})
        return ns

    def known(self, name: str) -> int:
        """The id of ``name``, or -1 when nothing was ever sealed under it."""
        return self._ids.get(name, -1)

    def seed(self, ns: int) -> int:
        """The content-hash seed of namespace id ``ns``."""
        return self._seeds[ns]

    @property
    def names(self) -> Sequence[str]:
        """Every namespace's name, by id (read-only: for walks that name many pages)."""
        return self._names

    # ----------------------------------------------------------------- sealing

    def seal(self, rec: PageRecord, ns: int, handle: PageHandle, digest: int) -> SealResult:
        """Seal writable ``rec`` (named by ``handle``, content hash ``digest`` under namespace
        id ``ns``), sharing an equal stored page if any.

        For every stored page of the namespace with that hash compare the bytes. Equal: take a
        reference on the stored page and drop the candidate's. None equal: index the candidate,
        counting a collision if the hash had matched. Runs once per sealed page, so it stays
        lean.
        """
        index = self._buckets[ns]
        if digest not in index:
            # Fresh content, the common case: one dict probe, no candidate to compare. Kept lean
            # because sealing must run near raw xxh3 speed (bench_pool's seal_fresh_pages target).
            index[digest] = rec
            self._pages.seal(rec, ns, digest)
            return SealResult(handle, ContentHash(digest), False, False)
        bucket = index[digest]
        for cand in bucket if isinstance(bucket, list) else (bucket,):
            if equal_bytes(self._memory.data, cand.index, rec.index):
                self._pages.incref(cand)
                self._pages.decref(rec)
                self._hits += 1
                return SealResult(self._pages.handle(cand), ContentHash(digest), True, False)
        self._collisions += 1
        if isinstance(bucket, list):
            bucket.append(rec)
        else:
            index[digest] = [bucket, rec]
        self._pages.seal(rec, ns, digest)
        return SealResult(handle, ContentHash(digest), False, True)

    def seal_page(self, rec: PageRecord, namespace: str, handle: PageHandle) -> SealResult:
        """Hash writable ``rec`` and :meth:`seal` it under ``namespace``."""
        ns = self.namespace(namespace)
        return self.seal(rec, ns, handle, self._memory.hash_row(rec.index, self._seeds[ns]))

    def seal_many(
        self, recs: Sequence[PageRecord], handles: Sequence[PageHandle], namespace: str
    ) -> list[SealResult]:
        """:meth:`seal` each of the checked writable pages ``recs`` under ``namespace``."""
        ns = self.namespace(namespace)
        seal, seed, mem = self.seal, self._seeds[ns], self._memory
        fn, host, pb = mem.hash, mem.host, mem.page_bytes
        if host is None:  # device pages: hashed in one batch (on the device for the default hash)
            digests = mem.hash_rows([r.index for r in recs], seed)
            return [seal(r, ns, h, d) for r, h, d in zip(recs, handles, digests, strict=True)]
        # Host pages: each hashed in place just before its seal, so a dedup hit compares bytes
        # the hash has just pulled into the CPU's cache.
        return [
            seal(r, ns, h, fn(host[r.index * pb : (r.index + 1) * pb], seed))
            for r, h in zip(recs, handles, strict=True)
        ]

    def seal_verified(
        self,
        recs: Sequence[PageRecord],
        handles: Sequence[PageHandle],
        namespace: str,
        expected: Sequence[int],
        digests: Sequence[int] | None,
    ) -> tuple[list[SealResult | None], list[int]]:
        """Seal the checked writable pages ``recs`` whose content hash equals ``expected[i]``
        (``expected`` and ``digests`` as long as ``recs``), hashing each once unless ``digests``
        has their hashes already (see ``BlockPool.seal_verified``); returns per page its result
        or ``None``, and the positions that did not match."""
        ns = self.namespace(namespace)
        if digests is None:
            digests = self._memory.hash_rows([r.index for r in recs], self._seeds[ns])
        out: list[SealResult | None] = []
        mismatched: list[int] = []
        for pos, (rec, handle, want, digest) in enumerate(
            zip(recs, handles, expected, digests, strict=True)
        ):
            if digest != want:
                mismatched.append(pos)
                out.append(None)
            else:
                out.append(self.seal(rec, ns, handle, digest))
        return out, mismatched

    def verify(self, rec: PageRecord) -> bool:
        """Whether sealed ``rec``'s bytes still hash to the digest it was sealed with."""
        return self._memory.hash_row(rec.index, self._seeds[rec.namespace]) == rec.digest

    def remove(self, rec: PageRecord) -> str:
        """Forget sealed ``rec`` (it is being evicted); returns its namespace's name."""
        index = self._buckets[rec.namespace]
        bucket = index[rec.digest]
        if isinstance(bucket, list):
            bucket.remove(rec)
            if len(bucket) == 1:
                index[rec.digest] = bucket[0]
        else:
            assert bucket is rec
            del index[rec.digest]
        return self._names[rec.namespace]

    # ----------------------------------------------------------------- counts and checks

    @property
    def hits(self) -> int:
        """Seals that shared an equal stored page instead of keeping their own."""
        return self._hits

    @property
    def collisions(self) -> int:
        """Seals whose hash matched a stored page with different bytes."""
        return self._collisions

    def check(self, sealed: Sequence[PageRecord]) -> None:
        """Raise ``AssertionError`` unless the index holds exactly the pages ``sealed``, each
        under its own namespace and digest."""
        indexed = 0
        for ns, index in enumerate(self._buckets):
            for digest, bucket in index.items():
                members = bucket if isinstance(bucket, list) else [bucket]
                assert not isinstance(bucket, list) or len(bucket) >= 2, "degenerate bucket"
                for m in members:
                    assert m.state == SEALED and m.namespace == ns and m.digest == digest
                indexed += len(members)
        for rec in sealed:
            bucket = self._buckets[rec.namespace][rec.digest]
            members = bucket if isinstance(bucket, list) else [bucket]
            assert any(m is rec for m in members), f"sealed page {rec.index} not indexed"
        assert indexed == len(sealed), "index holds pages that are not sealed"
