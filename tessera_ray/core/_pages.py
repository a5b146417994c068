"""The page table: every page's record, the free list, the LRU, and the references that move a
page between them.

One owner for all of these, so the lists, the refcounts and the counters cannot disagree: a
writable page at refcount 0 is freed (slot scrubbed, generation bumped so old handles go stale);
a sealed page at refcount 0 waits on the LRU, still findable, until it is evicted. Handles are
issued and resolved here too, because a handle is a slot plus the generation this table keeps.

The table knows nothing of content or names: the dedup index decides what a page shares and
the block index which keys name it; both change a page's life only through these methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from tessera_ray.core._bytes import zero_row
from tessera_ray.core._records import FREE, SEALED, WRITABLE, PageList, PageRecord
from tessera_ray.core._validate import check_handle
from tessera_ray.core.results import PageHandle
from tessera_ray.errors import (
    PageNotFreeableError,
    PageSealedError,
    PageShapeError,
    PoolConfigError,
    PoolExhaustedError,
)

__all__ = ["PageTable"]


class PageTable:
    """Records of the ``num_pages`` rows of ``data``, their two lists and their counters.

    Holds the page memory only to scrub a freed row and to copy a page it forks; what a page
    holds is the pool's business.
    """

    __slots__ = (
        "_data",
        "_evictions",
        "_free",
        "_lru",
        "_num_pages",
        "_page_bytes",
        "_records",
        "_region",
        "_scrub",
        "_sealed",
        "_shared",
    )

    def __init__(self, data: torch.Tensor, region: int, *, scrub: bool) -> None:
        self._data = data
        self._region = region
        self._num_pages, self._page_bytes = int(data.shape[0]), int(data.shape[1])
        self._scrub = scrub
        self._records = [PageRecord(index=i) for i in range(self._num_pages)]
        self._free = PageList()
        """Free pages, scrubbed; allocation takes from the front."""
        self._lru = PageList()
        """Unreferenced sealed pages, least recently released at the front: the one eviction
        order (block eviction reads it too, so pages and blocks agree on what is old)."""
        for rec in self._records:
            self._free.push_back(rec)
        self._sealed = 0
        self._shared = 0
        self._evictions = 0

    # ----------------------------------------------------------------- handles

    def handle(self, rec: PageRecord) -> PageHandle:
        pb = self._page_bytes
        return PageHandle(self._region, rec.index * pb, pb, rec.generation)

    def resolve(self, handle: PageHandle) -> PageRecord:
        """O(1): check every field of ``handle`` against the slot table."""
        # Fast path for a valid handle; anything unusual goes to the checks that say why.
        if type(handle) is PageHandle and handle.region == self._region:
            index, rem = divmod(handle.offset, self._page_bytes)
            if not rem and 0 <= index < self._num_pages and handle.length == self._page_bytes:
                rec = self._records[index]
                if rec.generation == handle.generation and rec.state != FREE:
                    return rec
        return check_handle(handle, self._region, self._page_bytes, self._records)

    def distinct(self, handles: Sequence[PageHandle]) -> list[PageRecord]:
        """The records of ``handles``, which must name distinct pages."""
        recs = [self.resolve(h) for h in handles]
        if len({r.index for r in recs}) != len(recs):
            raise PageShapeError("the same page is named twice in one call")
        return recs

    def unsealed(self, handles: Sequence[PageHandle]) -> list[PageRecord]:
        """The records of distinct pages ``handles``, none of them sealed yet (what sealing
        takes)."""
        recs = self.distinct(handles)
        for r in recs:
            if r.state == SEALED:
                raise PageSealedError(f"page {r.index} is already sealed")
        return recs

    # ----------------------------------------------------------------- allocation and copies

    def need_free(self, n: int) -> None:
        """Raise :class:`PoolExhaustedError` unless ``n`` pages are free."""
        if len(self._free) < n:
            raise PoolExhaustedError(
                f"need {n} free pages, {len(self._free)} left of {self._num_pages} "
                f"({len(self._lru)} evictable); call evict() or release references"
            )

    def allocate(self, n: int) -> list[PageHandle]:
        """``n`` writable pages (refcount 1) off the free list, all or none."""
        if n < 0:
            raise PoolConfigError(f"cannot allocate {n} pages")
        self.need_free(n)
        out = []
        for _ in range(n):
            rec = self._free.pop_front()
            assert rec is not None and rec.state == FREE
            rec.state, rec.refcount = WRITABLE, 1
            out.append(self.handle(rec))
        return out

    def fork(self, src: PageRecord) -> PageRecord:
        """A fresh writable page (refcount 1) holding ``src``'s bytes; the caller checked that
        a page is free (:meth:`need_free`)."""
        rec = self._free.pop_front()
        assert rec is not None
        rec.state, rec.refcount = WRITABLE, 1
        self._data[rec.index].copy_(self._data[src.index])
        return rec

    def writable(self, rec: PageRecord) -> PageRecord:
        """``rec`` itself when writable, else a private copy that takes over one reference
        (copy-on-write: every other holder of a sealed page keeps its bytes)."""
        if rec.state == WRITABLE:
            return rec
        if rec.refcount == 0:
            raise PageNotFreeableError(
                f"page {rec.index} holds no reference to write through; share() it first"
            )
        self.need_free(1)
        copy = self.fork(rec)
        self.decref(rec)
        return copy

    def writable_many(self, recs: Sequence[PageRecord]) -> list[PageRecord]:
        """:meth:`writable` for distinct pages, with every check (a reference to write
        through, a free page per fork) made before any page forks."""
        for r in recs:
            if r.state == SEALED and r.refcount == 0:
                raise PageNotFreeableError(f"page {r.index} holds no reference to write through")
        self.need_free(sum(r.state == SEALED for r in recs))
        return [self.writable(r) for r in recs]

    # ----------------------------------------------------------------- references

    def incref(self, rec: PageRecord) -> None:
        if rec.refcount == 0:
            self._lru.remove(rec)
        rec.refcount += 1
        if rec.refcount == 2:
            self._shared += 1

    def decref(self, rec: PageRecord) -> None:
        rec.refcount -= 1
        if rec.refcount == 1:
            self._shared -= 1
        elif rec.refcount == 0:
            if rec.state == SEALED:
                self._lru.push_back(rec)
            else:
                self._free_slot(rec)

    def share(self, recs: Sequence[PageRecord]) -> tuple[PageHandle, ...]:
        """One more reference on each of the sealed pages ``recs``, and their handles."""
        for r in recs:
            assert r.state == SEALED
            self.incref(r)
        return tuple(self.handle(r) for r in recs)

    def release_all(self, recs: Sequence[PageRecord]) -> None:
        """Drop one reference per entry of ``recs`` (a page may repeat), checked before any drop."""
        counts: dict[int, int] = {}
        for r in recs:
            counts[r.index] = counts.get(r.index, 0) + 1
            if counts[r.index] > r.refcount:
                raise PageNotFreeableError(f"page {r.index} released more often than referenced")
        for r in recs:
            self.decref(r)

    def seal(self, rec: PageRecord, ns: int, digest: int) -> None:
        """Mark writable ``rec`` sealed under namespace id ``ns`` with content hash ``digest``
        (the dedup index indexed it)."""
        rec.state, rec.namespace, rec.digest = SEALED, ns, digest
        self._sealed += 1

    # ----------------------------------------------------------------- the LRU and eviction

    def evictable(self) -> Iterator[PageRecord]:
        """Unreferenced sealed pages, oldest first."""
        return iter(self._lru)

    def pop_oldest(self, n: int) -> list[PageRecord]:
        """Up to ``n`` pages off the front of the LRU, to be evicted (:meth:`free_evicted`)."""
        out: list[PageRecord] = []
        while len(out) < n:
            rec = self._lru.pop_front()
            if rec is None:
                break
            out.append(rec)
        return out

    def take_from_lru(self, recs: Sequence[PageRecord]) -> None:
        """Take the unreferenced sealed pages ``recs`` off the LRU, to be evicted."""
        for rec in recs:
            self._lru.remove(rec)

    def free_evicted(self, rec: PageRecord) -> None:
        """Free an unreferenced sealed page already taken off the LRU (the indexes forgot it)."""
        assert rec.state == SEALED and rec.refcount == 0
        self._sealed -= 1
        self._free_slot(rec)
        self._evictions += 1

    def touch(self, recs: Sequence[PageRecord]) -> None:
        """Move the unreferenced pages of ``recs`` to the young end of the LRU, in order."""
        for rec in dict.fromkeys(recs):  # a deduplicated page may repeat in a block
            if rec.refcount == 0:  # only unreferenced sealed pages are on the LRU
                self._lru.remove(rec)
                self._lru.push_back(rec)

    def _free_slot(self, rec: PageRecord) -> None:
        """Return a page (off every list) to the free list; handles to it go stale."""
        rec.state, rec.refcount, rec.namespace, rec.digest = FREE, 0, -1, 0
        rec.generation += 1
        if self._scrub:
            zero_row(self._data, rec.index)
        self._free.push_back(rec)

    # ----------------------------------------------------------------- counts and checks

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def sealed(self) -> int:
        return self._sealed

    @property
    def shared(self) -> int:
        """Pages with two or more references."""
        return self._shared

    @property
    def evictions(self) -> int:
        return self._evictions

    def __iter__(self) -> Iterator[PageRecord]:
        """Every page's record, in slot order (for checks that walk the whole pool)."""
        return iter(self._records)

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the lists, the page
        states and the counters."""
        free, lru = list(self._free), list(self._lru)
        assert len(free) == len(self._free), "free list length counter is wrong"
        assert len(lru) == len(self._lru), "LRU length counter is wrong"
        assert all(r.state == FREE and r.refcount == 0 for r in free), "non-free page on free list"
        assert all(r.state == SEALED and r.refcount == 0 for r in lru), "bad page on the LRU"
        on_lists = {id(r) for r in free} | {id(r) for r in lru}
        assert len(on_lists) == len(free) + len(lru), "a page is on a list twice"
        sealed = shared = 0
        for rec in self._records:
            listed = id(rec) in on_lists
            if rec.state == FREE:
                assert listed, f"free page {rec.index} off the free list"
            elif rec.state == WRITABLE:
                assert rec.refcount == 1 and not listed, f"writable page {rec.index} misfiled"
            else:
                sealed += 1
                shared += rec.refcount >= 2
                assert listed == (rec.refcount == 0), f"sealed page {rec.index} LRU mismatch"
        assert sealed == self._sealed, "sealed counter is wrong"
        assert shared == self._shared, "shared counter is wrong"
