"""The pool's offline consistency check (``BlockPool.check_consistency``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera_ray.core._blocks import blocks_of
from tessera_ray.core._records import FREE, SEALED, WRITABLE

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["check_pool"]


def check_pool(pool: BlockPool) -> None:
    """Raise ``AssertionError`` naming the first broken invariant."""
    records = pool._records
    free = list(pool._free)
    lru = list(pool._lru)
    assert len(free) == len(pool._free), "free list length counter is wrong"
    assert len(lru) == len(pool._lru), "LRU length counter is wrong"
    assert all(r.state == FREE and r.refcount == 0 for r in free), "non-free page on free list"
    assert all(r.state == SEALED and r.refcount == 0 for r in lru), "bad page on the LRU"
    on_lists = {id(r) for r in free} | {id(r) for r in lru}
    assert len(on_lists) == len(free) + len(lru), "a page is on a list twice"
    sealed = shared = 0
    for rec in records:
        assert not isinstance(rec.blocks, list) or len(rec.blocks) >= 2, "degenerate block list"
        listed = id(rec) in on_lists
        if rec.state == FREE:
            assert listed and rec.blocks is None, f"free page {rec.index} off the free list"
        elif rec.state == WRITABLE:
            assert rec.refcount == 1 and not listed, f"writable page {rec.index} misfiled"
        else:
            sealed += 1
            shared += rec.refcount >= 2
            assert listed == (rec.refcount == 0), f"sealed page {rec.index} LRU mismatch"
            bucket = pool._dedup.buckets[rec.namespace][rec.digest]
            members = bucket if isinstance(bucket, list) else [bucket]
            assert any(m is rec for m in members), f"sealed page {rec.index} not indexed"
    assert sealed == pool._sealed, "sealed counter is wrong"
    assert shared == pool._shared, "shared counter is wrong"
    indexed = 0
    for ns, index in enumerate(pool._dedup.buckets):
        for digest, bucket in index.items():
            members = bucket if isinstance(bucket, list) else [bucket]
            assert not isinstance(bucket, list) or len(bucket) >= 2, "degenerate bucket"
            for m in members:
                assert m.state == SEALED and m.namespace == ns and m.digest == digest
            indexed += len(members)
    assert indexed == sealed, "index holds pages that are not sealed"
    for key, block in pool._block_index.blocks.items():
        assert key == tuple(r.index for r in block.pages)
        for r in block.pages:
            assert r.state == SEALED and r.namespace == block.namespace
            assert any(b is block for b in blocks_of(r))
    for token, block in pool._block_index.token_keys.items():
        assert pool._block_index.blocks.get(tuple(r.index for r in block.pages)) is block
        assert token in block.token_keys
