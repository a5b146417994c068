"""References: how a page's refcount moves it between the free list, the LRU and neither.

One place for these transitions, so the lists and the shared-page counter cannot disagree:
a writable page at refcount 0 is freed (slot scrubbed, generation bumped so old handles go
stale); a sealed page at refcount 0 waits on the LRU, still findable, until it is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tessera_ray.core._bytes import zero_row
from tessera_ray.core._records import FREE, SEALED, WRITABLE, PageRecord
from tessera_ray.core.results import PageHandle
from tessera_ray.errors import PageNotFreeableError, PoolConfigError, PoolExhaustedError

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["need_free", "allocate", "incref", "decref", "release_all", "free_slot"]


def need_free(pool: BlockPool, n: int) -> None:
    """Raise :class:`PoolExhaustedError` unless ``n`` pages are free."""
    if len(pool._free) < n:
        raise PoolExhaustedError(
            f"need {n} free pages, {len(pool._free)} left of {len(pool._records)} "
            f"({len(pool._lru)} evictable); call evict() or release references"
        )


def allocate(pool: BlockPool, n: int) -> list[PageHandle]:
    """``n`` writable pages (refcount 1) off the free list, all or none."""
    if n < 0:
        raise PoolConfigError(f"cannot allocate {n} pages")
    need_free(pool, n)
    out = []
    for _ in range(n):
        rec = pool._free.pop_front()
        assert rec is not None and rec.state == FREE
        rec.state, rec.refcount = WRITABLE, 1
        out.append(pool._handle(rec))
    return out


def incref(pool: BlockPool, rec: PageRecord) -> None:
    if rec.refcount == 0:
        pool._lru.remove(rec)
    rec.refcount += 1
    if rec.refcount == 2:
        pool._shared += 1


def decref(pool: BlockPool, rec: PageRecord) -> None:
    rec.refcount -= 1
    if rec.refcount == 1:
        pool._shared -= 1
    elif rec.refcount == 0:
        if rec.state == SEALED:
            pool._lru.push_back(rec)
        else:
            free_slot(pool, rec)


def release_all(pool: BlockPool, recs: Sequence[PageRecord]) -> None:
    """Drop one reference per entry of ``recs`` (a page may repeat), checked before any drop."""
    counts: dict[int, int] = {}
    for r in recs:
        counts[r.index] = counts.get(r.index, 0) + 1
        if counts[r.index] > r.refcount:
            raise PageNotFreeableError(f"page {r.index} released more often than referenced")
    for r in recs:
        decref(pool, r)


def free_slot(pool: BlockPool, rec: PageRecord) -> None:
    """Return a page (off every list) to the free list; handles to it go stale."""
    rec.state, rec.refcount, rec.namespace, rec.digest = FREE, 0, -1, 0
    rec.generation += 1
    if pool.config.scrub_freed_pages:
        zero_row(pool.data, rec.index)
    pool._free.push_back(rec)
