"""BlockPool.evictable_blocks and touch_block: block eviction read from the page LRU."""

from __future__ import annotations

import pytest

from tessera_ray.core import BlockPool, BlockSealResult, TokenKey, token_key
from tessera_ray.errors import PoolConfigError
from tests.core.conftest import FINGERPRINT, make_pool, page_of


def key(i: int, ns: str = "t") -> TokenKey:
    return token_key(ns, FINGERPRINT, None, [i])


def block(
    pool: BlockPool, data: tuple[int, ...], k: TokenKey | None, ns: str = "t"
) -> BlockSealResult:
    """Seal one block whose layer pages hold the bytes ``data`` (one byte value per layer)."""
    hs = [pool.write(pool.allocate(), page_of(b, pool.page_bytes)) for b in data]
    return pool.seal_block(hs, ns, k)


def test_order_follows_release_order() -> None:
    pool = make_pool(16, layers_per_block=2)
    res = [block(pool, (10 * i, 10 * i + 1), key(i)) for i in range(3)]
    assert pool.evictable_blocks(10) == []  # all referenced: nothing to evict
    for i in (1, 2, 0):
        pool.release_many(list(res[i].handles))
    assert pool.evictable_blocks(10) == [("t", key(1)), ("t", key(2)), ("t", key(0))]
    # The same order page eviction follows: the first listed block's pages go first.
    assert [e.data[0] for e in pool.evict(2) if e.data] == [10, 11]
    assert pool.evictable_blocks(10) == [("t", key(2)), ("t", key(0))]
    pool.check_consistency()


def test_namespaces_are_reported_by_name() -> None:
    pool = make_pool(8)
    a = block(pool, (1,), key(1, "alice"), "alice")
    b = block(pool, (1,), key(1, "bob"), "bob")  # equal bytes, other tenant: its own page
    pool.release_many([*b.handles, *a.handles])
    assert pool.evictable_blocks(10) == [("bob", key(1, "bob")), ("alice", key(1, "alice"))]


def test_referenced_block_is_skipped() -> None:
    pool = make_pool(16, layers_per_block=2)
    res = [block(pool, (10 * i, 10 * i + 1), key(i)) for i in range(3)]
    for r in res:
        pool.release_many(list(r.handles))
    got = pool.lookup("t", key(1))  # a reader holds block 1 again
    assert got is not None
    assert pool.evictable_blocks(10) == [("t", key(0)), ("t", key(2))]
    pool.release_many(list(got))
    # Only one layer page of block 0 referenced: its other page is on the LRU, yet the block
    # cannot be evicted, so it is not listed.
    pool.share(res[0].handles[1])
    assert pool.stats().pages_evictable == 5
    assert pool.evictable_blocks(10) == [("t", key(2)), ("t", key(1))]


def test_block_without_token_key_yields_nothing() -> None:
    pool = make_pool(8)
    anon = block(pool, (1,), None)
    named = block(pool, (2,), key(2))
    pool.release_many([*anon.handles, *named.handles])
    assert pool.stats().blocks == 2
    assert pool.evictable_blocks(10) == [("t", key(2))]


def test_touch_makes_a_block_youngest_in_page_order() -> None:
    pool = make_pool(16, layers_per_block=2)
    res = [block(pool, (10 * i, 10 * i + 1), key(i)) for i in range(3)]
    # Release block 0's layers in reverse, so its pages sit on the LRU as [layer 1, layer 0].
    pool.release(res[0].handles[1])
    pool.release(res[0].handles[0])
    for r in res[1:]:
        pool.release_many(list(r.handles))
    assert pool.touch_block("t", key(0)) is True
    assert pool.evictable_blocks(10) == [("t", key(1)), ("t", key(2)), ("t", key(0))]
    # Block 0's pages now leave last, in page (layer) order.
    assert [e.data[0] for e in pool.evict(6) if e.data] == [10, 11, 20, 21, 0, 1]
    pool.check_consistency()


def test_touch_leaves_referenced_pages_off_the_lru() -> None:
    pool = make_pool(16, layers_per_block=2)
    res = [block(pool, (10 * i, 10 * i + 1), key(i)) for i in range(2)]
    pool.release(res[0].handles[0])  # layer 0 of block 0 on the LRU; layer 1 still held
    pool.release_many(list(res[1].handles))
    assert pool.touch_block("t", key(0)) is True
    pool.check_consistency()  # the referenced page was not pushed onto the LRU
    assert pool.refcount(res[0].handles[1]) == 1 and pool.stats().pages_evictable == 3
    assert [e.data[0] for e in pool.evict(3) if e.data] == [10, 11, 0]


def test_touch_reports_unknown_keys_and_changes_nothing() -> None:
    pool = make_pool(8)
    a, b = block(pool, (1,), key(1)), block(pool, (2,), key(2))
    pool.release_many([*a.handles, *b.handles])
    assert pool.touch_block("t", key(99)) is False
    assert pool.touch_block("nobody", key(1)) is False  # a namespace never sealed under
    assert pool.touch_block("t", key(1, "u")) is False  # a key of another namespace
    assert pool.evictable_blocks(10) == [("t", key(1)), ("t", key(2))]


def test_block_with_two_token_keys_yields_both_and_limit_cuts_between_them() -> None:
    pool = make_pool(8)
    res = block(pool, (1,), key(1))
    assert pool.register_block(list(res.handles), "t", key(2))  # a second name, same block
    other = block(pool, (2,), key(3))
    pool.release_many([*res.handles, *other.handles])
    assert pool.stats().blocks == 2 and pool.stats().token_keys == 3
    assert pool.evictable_blocks(10) == [("t", key(1)), ("t", key(2)), ("t", key(3))]
    assert pool.evictable_blocks(1) == [("t", key(1))]
    assert pool.evictable_blocks(2) == [("t", key(1)), ("t", key(2))]


def test_deduplicated_page_shared_by_two_blocks() -> None:
    pool = make_pool(8, layers_per_block=2)
    a = block(pool, (5, 6), key(1))
    b = block(pool, (5, 7), key(2))
    assert b.pages[0].deduplicated  # layer 0 is one page named by both blocks
    pool.release_many(list(a.handles))
    # Block 1's own page is on the LRU, but its layer-0 page is still held through block 2.
    assert pool.stats().pages_evictable == 1
    assert pool.evictable_blocks(10) == []
    pool.release_many(list(b.handles))
    # Each block once, though the shared page links both.
    assert pool.evictable_blocks(10) == [("t", key(1)), ("t", key(2))]
    assert pool.touch_block("t", key(1)) is True  # moves the shared page and its own page
    assert pool.evictable_blocks(10) == [("t", key(2)), ("t", key(1))]
    pool.check_consistency()


def test_limit_is_honoured() -> None:
    pool = make_pool(8)
    res = [block(pool, (i,), key(i)) for i in range(4)]
    pool.release_many([h for r in res for h in r.handles])
    assert pool.evictable_blocks(0) == []
    assert pool.evictable_blocks(2) == [("t", key(0)), ("t", key(1))]
    assert len(pool.evictable_blocks(4)) == 4 and len(pool.evictable_blocks(100)) == 4


def test_negative_limit_raises_and_listing_changes_nothing() -> None:
    pool = make_pool(8)
    res = block(pool, (1,), key(1))
    pool.release_many(list(res.handles))
    before = pool.stats()
    with pytest.raises(PoolConfigError):
        pool.evictable_blocks(-1)
    pool.evictable_blocks(10)
    assert pool.stats() == before
    pool.check_consistency()
