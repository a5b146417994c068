"""BlockPool lifecycle, dedup, copy-on-write, eviction, blocks, views and stats."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tessera_ray.core import BlockPool, PoolConfig, token_key
from tessera_ray.core._records import BlockRecord, PageRecord
from tessera_ray.core.results import PageHandle, PoolStats, SealResult
from tessera_ray.errors import PageShapeError
from tessera_ray.layout import preset_layout
from tests.core.conftest import FINGERPRINT, make_pool, page_of


def sealed(pool: BlockPool, byte: int, ns: str = "t") -> SealResult:
    h = pool.write(pool.allocate(), page_of(byte, pool.page_bytes))
    return pool.seal(h, ns)


def test_records_are_slotted() -> None:
    # Hot metadata must stay small: no per-record __dict__.
    for cls in (PageRecord, BlockRecord):
        assert "__slots__" in cls.__dict__
        assert not hasattr(cls(**_minimal(cls)), "__dict__")
    assert PageHandle.__slots__ == () and PoolStats.__slots__  # tuples and slotted results


def _minimal(cls: type) -> dict[str, object]:
    if cls is PageRecord:
        return {"index": 0}
    return {"namespace": 0, "block_hash": 0, "pages": (), "token_keys": []}


def test_core_never_imports_ray() -> None:
    code = "import sys, tessera_ray.core; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_write_seal_read(pool: BlockPool) -> None:
    h = pool.allocate()
    assert pool.read(h).sum().item() == 0  # fresh pages are zeroed
    h2 = pool.write(h, torch.arange(10, dtype=torch.uint8), offset=5)
    assert h2 == h  # a writable page is written in place
    res = pool.seal(h, "t")
    assert not res.deduplicated and not res.collision and res.handle == h
    data = pool.read(h)
    assert data[5:15].tolist() == list(range(10)) and data[:5].sum() == 0
    s = pool.stats()
    assert (s.pages_used, s.pages_free, s.pages_sealed) == (1, 15, 1)


def test_verify_tells_a_sealed_page_whose_bytes_rotted(pool: BlockPool) -> None:
    from tessera_ray.errors import PageNotSealedError

    good, bad = sealed(pool, 3), sealed(pool, 4, ns="u")
    assert pool.verify(good.handle) and pool.verify(bad.handle)
    pool.data[pool.slot(bad.handle), 9] ^= 0x01  # bad RAM, a stray write
    assert pool.verify(good.handle) and not pool.verify(bad.handle)
    with pytest.raises(PageNotSealedError):
        pool.verify(pool.allocate())


def test_equal_bytes_share_one_page(pool: BlockPool) -> None:
    a = sealed(pool, 7)
    b = sealed(pool, 7)
    assert b.deduplicated and b.handle == a.handle and b.content_hash == a.content_hash
    assert pool.refcount(a.handle) == 2
    s = pool.stats()
    assert s.pages_used == 1 and s.pages_shared == 1 and s.dedup_hits == 1
    assert s.bytes_saved_by_dedup == pool.page_bytes


def test_tenants_never_share_even_equal_bytes(pool: BlockPool) -> None:
    a = sealed(pool, 7, "alice")
    b = sealed(pool, 7, "bob")
    assert not b.deduplicated and b.handle != a.handle
    assert a.content_hash != b.content_hash  # keyed by namespace
    assert pool.stats().pages_used == 2


def test_dedup_candidate_handle_goes_stale(pool: BlockPool) -> None:
    sealed(pool, 1)
    cand = pool.write(pool.allocate(), page_of(1))
    res = pool.seal(cand, "t")
    assert res.deduplicated
    with pytest.raises(Exception, match="freed"):
        pool.read(cand)


def test_copy_on_write_leaves_other_holders_untouched(pool: BlockPool) -> None:
    a = sealed(pool, 3).handle
    other = pool.share(a)
    forked = pool.write(a, torch.tensor([9, 9], dtype=torch.uint8))
    assert forked != a and not pool.is_sealed(forked)
    assert pool.read(other).tolist() == [3] * 64
    assert pool.read(forked).tolist() == [9, 9] + [3] * 62
    assert pool.refcount(other) == 1  # the writer's reference moved to the fork
    # Even an unshared sealed page is immutable: writing forks it too.
    f2 = pool.write(other, torch.tensor([1], dtype=torch.uint8))
    assert f2 != other and pool.refcount(other) == 0
    pool.check_consistency()


def test_fork_copies_without_touching_source(pool: BlockPool) -> None:
    a = sealed(pool, 4).handle
    f = pool.fork(a)
    assert pool.refcount(a) == 1 and pool.read(f).tolist() == [4] * 64
    pool.write(f, torch.tensor([0], dtype=torch.uint8))
    assert pool.read(a).tolist() == [4] * 64


def test_release_writable_frees_and_sealed_goes_to_lru(pool: BlockPool) -> None:
    w = pool.allocate()
    pool.release(w)
    assert pool.stats().pages_free == 16
    s = sealed(pool, 5).handle
    pool.release(s)
    st = pool.stats()
    assert st.pages_evictable == 1 and st.pages_used == 1
    # Still findable: sealing equal bytes revives it from the LRU.
    again = sealed(pool, 5)
    assert again.deduplicated and again.handle == s and pool.stats().pages_evictable == 0


def test_evict_lru_order_and_never_referenced(pool: BlockPool) -> None:
    hs = [sealed(pool, b).handle for b in (1, 2, 3, 4)]
    pool.release(hs[2])
    pool.release(hs[0])
    pool.release(hs[3])
    pool.share(hs[0])  # taken back: no longer evictable
    out = pool.evict(10)
    assert [bytes(e.data or b"")[0] for e in out] == [3, 4]
    assert all(e.namespace == "t" and e.data == bytes([e.data[0]]) * 64 for e in out)
    assert pool.read(hs[0]).tolist() == [1] * 64 and pool.read(hs[1]).tolist() == [2] * 64
    st = pool.stats()
    assert st.evictions == 2 and st.pages_used == 2 and st.pages_evictable == 0
    with pytest.raises(Exception, match="freed"):
        pool.read(hs[2])
    assert pool.evict(5) == []
    pool.check_consistency()


def test_evicted_slot_is_scrubbed_before_reuse() -> None:
    pool = make_pool(1)
    h = sealed(pool, 0xAB).handle
    pool.release(h)
    pool.evict(1, copy_data=False)
    assert pool.read(pool.allocate()).sum().item() == 0


def test_blocks_and_token_keys() -> None:
    pool = make_pool(16, layers_per_block=3)
    k1 = token_key("t", FINGERPRINT, None, [1, 2, 3, 4])
    k2 = token_key("t", FINGERPRINT, k1, [5, 6, 7, 8])
    hs = [pool.write(pool.allocate(), page_of(b)) for b in (1, 2, 3)]
    res = pool.seal_block(hs, "t", k1)
    assert res.token_key_registered and pool.stats().blocks == 1
    # Same bytes under a second key: pages dedup, one block, two keys.
    hs2 = [pool.write(pool.allocate(), page_of(b)) for b in (1, 2, 3)]
    res2 = pool.seal_block(hs2, "t", k2)
    assert all(p.deduplicated for p in res2.pages) and res2.block_hash == res.block_hash
    assert pool.stats().blocks == 1 and pool.stats().token_keys == 2
    got = pool.lookup("t", k2)
    assert got == res.handles and [pool.read(h)[0].item() for h in got] == [1, 2, 3]
    assert pool.lookup("other-tenant", k1) is None
    assert pool.block_hash_of("t", k1) == res.block_hash
    # Evicting any page of the block drops the block and its keys.
    pool.release_many(list(got) + list(res.handles) + list(res2.handles))
    assert len(pool.evict(1)) == 1
    assert pool.lookup("t", k1) is None and pool.stats().token_keys == 0
    pool.check_consistency()


def test_first_token_key_registration_wins() -> None:
    pool = make_pool(8)
    k = token_key("t", FINGERPRINT, None, [1])
    a = pool.seal_block([pool.write(pool.allocate(), page_of(1))], "t", k)
    b = pool.seal_block([pool.write(pool.allocate(), page_of(2))], "t", k)
    assert a.token_key_registered and not b.token_key_registered
    got = pool.lookup("t", k)
    assert got is not None and pool.read(got[0]).tolist() == [1] * 64


def test_sixteen_agents_share_one_prefix() -> None:
    # 16 agents seal the same 512-page prefix: 512 pages of memory, not 8,192.
    pool = make_pool(600, page_bytes=64)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (512, 64), dtype=torch.uint8, generator=gen)
    parent = None
    keys = []
    for i in range(512):
        parent = token_key("team", FINGERPRINT, parent, [i])
        keys.append(parent)
    for _agent in range(16):
        for i in range(512):
            h = pool.write(pool.allocate(), prefix[i])
            pool.seal_block([h], "team", keys[i])
    s = pool.stats()
    assert s.pages_used == 512 and s.pages_sealed == 512
    assert s.dedup_hits == 15 * 512 and s.bytes_saved_by_dedup == 15 * 512 * 64
    assert s.pages_shared == 512 and s.blocks == 512 and s.token_keys == 512
    pool.check_consistency()


def test_region_views_are_typed_and_zero_copy() -> None:
    layout = preset_layout("deepseek-v3", format="fp8_ds_mla")
    pool = BlockPool.for_group(layout, 0, PoolConfig(num_pages=2))
    assert pool.layers_per_block == 61 and pool.page_bytes == 64 * 656
    c_kv, scale, rope = (pool.region_view(n) for n in ("c_kv", "scale", "k_rope"))
    assert (c_kv.dtype, tuple(c_kv.shape)) == (torch.float8_e4m3fn, (2, 64, 512))
    assert (scale.dtype, tuple(scale.shape)) == (torch.float32, (2, 64, 4))
    assert (rope.dtype, tuple(rope.shape)) == (torch.bfloat16, (2, 64, 64))
    h = pool.allocate()
    h = pool.write_region(h, "scale", torch.full((64, 4), 2.5), start_entry=0)
    # Bytes of entry 0's scales: at offset 512 of the page, fp32 little-endian.
    raw = pool.read(h)[512:528].view(torch.float32)
    assert raw.tolist() == [2.5] * 4 and rope.data_ptr() - pool.data.data_ptr() == 528


def test_flashmla_view_over_mla_bf16() -> None:
    layout = preset_layout("deepseek-v3")
    pool = BlockPool.for_group(layout, 0, PoolConfig(num_pages=3))
    view = pool.flashmla_view()
    assert (view.dtype, tuple(view.shape)) == (torch.bfloat16, (3, 64, 1, 576))
    h = pool.allocate()
    values = torch.randn(64, 64).to(torch.bfloat16)
    pool.write_region(h, "k_rope", values)
    assert torch.equal(view[pool.slot(h), :, 0, 512:], values)


def test_v4_model1_regions() -> None:
    layout = preset_layout("deepseek-v4-flash")
    group = next(g for g in layout.groups if "v4-model1" in g.page.cache.label())
    pool = BlockPool.for_group(layout, group, PoolConfig(num_pages=1))
    scale = pool.region_view("scale")
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape[-1] == 7
    with pytest.raises(ValueError, match="FlashMLA"):
        pool.flashmla_view()


def test_stats_is_a_frozen_snapshot(pool: BlockPool) -> None:
    s = pool.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.pages_free = 0  # type: ignore[misc]
    pool.allocate()
    assert s.pages_free == 16 and pool.stats().pages_free == 15


def test_page_in_two_blocks_survives_eviction_of_the_other_block() -> None:
    # Layer-0 pages often match across different contexts: one page, several blocks.
    pool = make_pool(8, layers_per_block=2)
    ka = token_key("t", FINGERPRINT, None, [1])
    kb = token_key("t", FINGERPRINT, None, [2])
    a = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (1, 2)], "t", ka)
    b = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (1, 3)], "t", kb)
    assert b.pages[0].deduplicated and b.handles[0] == a.handles[0]
    assert pool.stats().blocks == 2
    pool.check_consistency()
    pool.release(a.handles[1])  # only the page holding 2 becomes evictable
    (gone,) = pool.evict(8)
    assert gone.data == bytes([2]) * 64
    assert pool.lookup("t", ka) is None
    got = pool.lookup("t", kb)
    assert got is not None and [pool.read(h)[0].item() for h in got] == [1, 3]
    assert pool.stats().blocks == 1
    pool.check_consistency()


def test_block_whose_layers_share_one_page() -> None:
    # Two layers with equal bytes dedup to one page inside one block; eviction still works.
    pool = make_pool(4, layers_per_block=2)
    k = token_key("t", FINGERPRINT, None, [1])
    res = pool.seal_block([pool.write(pool.allocate(), page_of(5)) for _ in range(2)], "t", k)
    assert res.handles[0] == res.handles[1] and pool.refcount(res.handles[0]) == 2
    pool.check_consistency()
    pool.release_many(list(res.handles))
    assert len(pool.evict(4)) == 1 and pool.lookup("t", k) is None
    assert pool.stats().blocks == 0
    pool.check_consistency()


def test_evict_block_takes_exactly_that_block_and_only_when_unreferenced() -> None:
    pool = make_pool(16, layers_per_block=2)
    keys = [token_key("t", FINGERPRINT, None, [i]) for i in range(3)]
    sealed = []
    for i, k in enumerate(keys):
        hs = [pool.write(pool.allocate(), page_of(10 * i + layer)) for layer in range(2)]
        sealed.append(pool.seal_block(hs, "t", k))
    # Referenced: refused, nothing changes.
    assert pool.evict_block("t", keys[1]) is None
    assert pool.evict_block("t", token_key("t", FINGERPRINT, None, [99])) is None
    assert pool.evict_block("other", keys[1]) is None
    for res in sealed:
        pool.release_many(list(res.handles))
    before = pool.stats()
    # Out of LRU order: the middle block goes, its bytes come back for the tier below.
    out = pool.evict_block("t", keys[1])
    assert out is not None and [e.data[0] for e in out if e.data] == [10, 11]
    assert [e.content_hash for e in out] == [p.content_hash for p in sealed[1].pages]
    assert pool.lookup("t", keys[1]) is None
    for k in (keys[0], keys[2]):
        got = pool.lookup("t", k)
        assert got is not None
        pool.release_many(list(got))
    after = pool.stats()
    assert after.pages_free == before.pages_free + 2 and after.evictions == before.evictions + 2
    pool.check_consistency()


def test_seal_verified_hashes_once_and_seals_only_matching_pages() -> None:
    pool = make_pool(8)
    source = make_pool(8)
    pages = [page_of(b) for b in (1, 2, 3)]
    expected = [source.seal(source.write(source.allocate(), p), "t").content_hash for p in pages]
    hs = [pool.write(pool.allocate(), p) for p in pages]
    hs[1] = pool.write(hs[1], page_of(9))  # corrupted in flight
    before = pool.stats()
    results, mismatched = pool.seal_verified(hs, "t", expected)
    assert mismatched == [1] and results[1] is None
    assert [r.content_hash for r in results if r] == [expected[0], expected[2]]
    assert pool.is_sealed(hs[0]) and not pool.is_sealed(hs[1]) and pool.is_sealed(hs[2])
    assert pool.stats().pages_sealed == before.pages_sealed + 2
    pool.release(hs[1])  # the caller gives the mismatching page back
    assert pool.stats().pages_free == before.pages_free + 1
    with pytest.raises(PageShapeError, match="2 expected hashes for 3 pages"):
        pool.seal_verified(hs, "t", expected[:2])
    pool.check_consistency()


def test_evict_unnamed_frees_only_pages_no_key_reaches() -> None:
    pool = make_pool(8)
    named = pool.seal_block(
        [pool.write(pool.allocate(), page_of(1))], "t", token_key("t", FINGERPRINT, None, [1])
    )
    orphan = pool.seal(pool.write(pool.allocate(), page_of(2)), "t")
    pool.release_many([*named.handles, orphan.handle])
    before = pool.stats()
    assert pool.evict_unnamed(8) == 1
    assert pool.stats().pages_free == before.pages_free + 1
    got = pool.lookup("t", token_key("t", FINGERPRINT, None, [1]))
    assert got is not None and pool.read(got[0]).tolist() == [1] * 64
    pool.check_consistency()


def test_evict_block_keeps_pages_another_block_still_names() -> None:
    """Two blocks share a deduplicated page (the same layer-0 bytes under two prefixes):
    evicting one block frees only its own pages; the other block stays whole."""
    pool = make_pool(8, layers_per_block=2)
    k1 = token_key("t", FINGERPRINT, None, [1])
    k2 = token_key("t", FINGERPRINT, None, [2])
    a = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (5, 6)], "t", k1)
    b = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (5, 7)], "t", k2)
    assert b.pages[0].deduplicated  # layer 0 is one shared page
    pool.release_many([*a.handles, *b.handles])
    before = pool.stats()
    out = pool.evict_block("t", k1)
    assert out is not None and [e.data[0] for e in out if e.data] == [6]  # only its own page
    assert pool.lookup("t", k1) is None
    got = pool.lookup("t", k2)
    assert got is not None and [pool.read(h)[0].item() for h in got] == [5, 7]
    assert pool.stats().pages_free == before.pages_free + 1
    pool.release_many(list(got))
    pool.check_consistency()


def test_a_block_two_keys_name_stays_for_one_when_the_other_is_evicted() -> None:
    """The same bytes stored under two keys are one block named twice (a V4 record chunk's
    zero tail in one layer group): evicting one name frees nothing and leaves the block whole
    for the other, referenced or not; the last name takes the pages."""
    pool = make_pool(8, layers_per_block=2)
    k1, k2 = (token_key("t", FINGERPRINT, None, [i]) for i in (1, 2))
    a = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (5, 6)], "t", k1)
    b = pool.seal_block([pool.write(pool.allocate(), page_of(b)) for b in (5, 6)], "t", k2)
    assert b.block_hash == a.block_hash and b.token_key_registered
    assert pool.block_names("t", k1) == ((k1, k2), True)  # both sealers still hold references
    pool.release_many([*a.handles, *b.handles])
    held = pool.lookup("t", k2)  # a reader holds k2: k1's name may still go
    assert held is not None
    before = pool.stats()
    assert pool.evict_block("t", k1) == []
    assert pool.lookup("t", k1) is None and pool.block_names("t", k1) is None
    assert pool.block_names("t", k2) == ((k2,), True)
    assert pool.stats().pages_free == before.pages_free
    assert pool.evict_block("t", k2) is None  # the last name, referenced: refused
    pool.release_many(list(held))
    out = pool.evict_block("t", k2)
    assert out is not None and [e.data[0] for e in out if e.data] == [5, 6]
    assert pool.lookup("t", k2) is None and pool.stats().pages_free == before.pages_free + 2
    pool.check_consistency()
