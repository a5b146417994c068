"""Eviction: unreferenced sealed pages leave the pool for the tier below.

The page LRU (``pool._lru``: unreferenced sealed pages, least recently released at the front)
is the one eviction order. Callers that evict by block read that order through
:func:`evictable_blocks` and refresh it through :func:`touch_block`, so evicting pages and
evicting blocks agree on what is old.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera_ray.core._blocks import blocks_of
from tessera_ray.core._records import SEALED, PageRecord
from tessera_ray.core._refs import free_slot
from tessera_ray.core.results import ContentHash, EvictedPage, PageIndex, TokenKey
from tessera_ray.errors import PoolConfigError

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["evict", "evict_unnamed", "evict_block", "evictable_blocks", "touch_block"]


def evict(pool: BlockPool, max_pages: int, copy_data: bool) -> list[EvictedPage]:
    """Pop up to ``max_pages`` pages off the front of the LRU and evict them."""
    if max_pages < 0:
        raise PoolConfigError(f"cannot evict {max_pages} pages")
    out: list[EvictedPage] = []
    while len(out) < max_pages:
        rec = pool._lru.pop_front()
        if rec is None:
            break
        out.append(_evict_page(pool, rec, copy_data))
    return out


def evict_unnamed(pool: BlockPool, max_pages: int) -> int:
    """Evict up to ``max_pages`` LRU pages that belong to no block, oldest first."""
    orphans = [rec for rec in pool._lru if rec.blocks is None][: max(max_pages, 0)]
    for rec in orphans:
        pool._lru.remove(rec)
        _evict_page(pool, rec, copy_data=False)
    return len(orphans)


def evict_block(
    pool: BlockPool, namespace: str, token_key: TokenKey, copy_data: bool
) -> list[EvictedPage] | None:
    """Evict the pages only ``token_key``'s block names and forget the block; ``None`` (and
    no change) when the key names no block or one of its pages is referenced."""
    block = pool._block_index.find(pool._dedup.known(namespace), token_key)
    if block is None or any(r.refcount for r in block.pages):
        return None
    out: list[EvictedPage] = []
    for rec in dict.fromkeys(block.pages):  # a deduplicated page may repeat in a block
        if any(b is not block for b in blocks_of(rec)):
            continue  # another block still names it: it stays for that block
        pool._lru.remove(rec)
        out.append(_evict_page(pool, rec, copy_data))
    pool._block_index.drop_block(block)  # when every page was shared, it is still named
    return out


def evictable_blocks(pool: BlockPool, limit: int) -> list[tuple[str, TokenKey]]:
    """``(namespace, token key)`` of unreferenced blocks in page-LRU order, at most ``limit``.

    A block is as old as its oldest page on the LRU: it is listed when the walk from the front
    first meets one of its pages, and only if none of its pages is referenced (a referenced
    block cannot be evicted).
    """
    if limit < 0:
        raise PoolConfigError(f"cannot list {limit} evictable blocks")
    out: list[tuple[str, TokenKey]] = []
    seen: set[int] = set()  # id() of blocks already met: records compare by identity
    names = pool._dedup.names
    for rec in pool._lru:
        if len(out) >= limit:
            break
        for block in blocks_of(rec):
            if id(block) in seen:
                continue
            seen.add(id(block))
            if any(p.refcount for p in block.pages):
                continue
            out.extend((names[block.namespace], TokenKey(k)) for k in block.token_keys)
    return out[:limit]


def touch_block(pool: BlockPool, namespace: str, token_key: TokenKey) -> bool:
    """Move the block's unreferenced pages to the young end of the LRU, in page order; False
    when the key names no block."""
    block = pool._block_index.find(pool._dedup.known(namespace), token_key)
    if block is None:
        return False
    for rec in dict.fromkeys(block.pages):  # a deduplicated page may repeat in a block
        if rec.refcount == 0:  # only unreferenced sealed pages are on the LRU
            pool._lru.remove(rec)
            pool._lru.push_back(rec)
    return True


def _evict_page(pool: BlockPool, rec: PageRecord, copy_data: bool) -> EvictedPage:
    """Evict one unreferenced sealed page already taken off the LRU."""
    assert rec.state == SEALED and rec.refcount == 0
    data = pool._page_buffer(rec.index).tobytes() if copy_data else None
    evicted = EvictedPage(
        pool._dedup.names[rec.namespace], ContentHash(rec.digest), PageIndex(rec.index), data
    )
    pool._dedup.remove(rec)
    pool._block_index.drop_page(rec)
    pool._sealed -= 1
    free_slot(pool, rec)  # pushes onto the free list; the record is off the LRU already
    pool._evictions += 1
    return evicted
