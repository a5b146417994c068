"""Device pages of a pool with an injected content hash are hashed in chunks through two staging
buffers (core/_staging.py). The path runs here on host tensors with the pool's in-place view
taken away, so its indexing, chunking and ordering are checked on CPU; tests/core/test_pool_gpu.py
runs it on a GPU. The injected hash computes the default's digests under another function
object, which is what sends a pool down this path (the default is hashed on the device:
tests/core/test_xxh3_pool.py)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from tessera_ray.core import BlockPool, PoolConfig, content_seed
from tessera_ray.core._staging import CHUNK_PAGES, DeviceHasher
from tessera_ray.layout import preset_layout

LAYOUT = preset_layout("deepseek-v3")
NUM = 2 * CHUNK_PAGES + 7  # two full chunks, a partial one, both buffers reused


def _injected(page: memoryview, seed: int) -> int:
    return xxhash.xxh3_128_intdigest(page, seed)


def _pool(as_device: bool) -> BlockPool:
    config = PoolConfig(num_pages=NUM, pin_memory=False)
    pool = BlockPool.for_group(LAYOUT, 0, config, content_hash=_injected)
    if as_device:
        pool._memory.host = None  # what a CUDA pool has: no in-place host view of its pages
        assert pool.hash_path == "staged"
    return pool


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (n, LAYOUT.groups[0].page.page_bytes), dtype=torch.uint8, generator=gen
    )


def test_chunked_hashes_equal_in_place_hashes_in_any_slot_order() -> None:
    host, device = _pool(False), _pool(True)
    data = _pages(NUM)
    for pool in (host, device):
        pool.write_many(pool.allocate_many(NUM), data)
    seed = content_seed("t", LAYOUT.fingerprint)
    slots = list(range(NUM))[::-1]  # reversed: each chunk gathers scattered rows
    assert device.hash_pages(slots, seed) == host.hash_pages(slots, seed)
    assert len(set(host.hash_pages(slots, seed))) == NUM
    assert device.hash_pages([], seed) == []


def test_device_pages_seal_and_dedup_as_host_pages() -> None:
    data = _pages(NUM, seed=1)
    data[5] = data[3]  # equal content: the second must share the first's page
    results = []
    for pool in (_pool(False), _pool(True)):
        sealed = pool.seal_many(pool.write_many(pool.allocate_many(NUM), data), "t")
        results.append([(r.content_hash, r.deduplicated) for r in sealed])
        assert sealed[5].deduplicated and sealed[5].handle == sealed[3].handle
        pool.check_consistency()
    assert results[0] == results[1]


def test_a_corrupted_device_page_fails_verification() -> None:
    pool = _pool(True)
    (handle,) = pool.seal_many(pool.write_many(pool.allocate_many(1), _pages(1, 2)), "t")
    assert pool.verify(handle.handle)
    pool.data[handle.handle.offset // handle.handle.length, 9] ^= 1
    assert not pool.verify(handle.handle)


@pytest.mark.parametrize("rows", [1, CHUNK_PAGES, CHUNK_PAGES + 1])
def test_the_hasher_returns_one_hash_per_row_in_order(rows: int) -> None:
    data = _pages(rows, seed=rows)
    calls: list[bytes] = []

    def record(page: memoryview, seed: int) -> int:
        calls.append(bytes(page))
        return len(calls)

    assert DeviceHasher(data, record).hash_rows(list(range(rows)), 0) == list(range(1, rows + 1))
    assert calls == [data[i].numpy().tobytes() for i in range(rows)]
