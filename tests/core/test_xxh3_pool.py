"""Which path a pool hashes its pages by (core/_storage.py), and the device path inside a pool:
run here on host tensors with the pool's in-place view taken away (what a CUDA pool lacks),
so sealing, dedup and verification take the device hash's torch form on the CPU. The CUDA
pool itself is in tests/gpu/test_device_hash.py."""

from __future__ import annotations

import sys

import pytest
import torch
import xxhash

from tessera_ray.core import BlockPool, PoolConfig, content_seed, xxh3_128
from tessera_ray.core._bytes import as_words, copy_rows
from tessera_ray.core._storage import device_hash_path, kernel_available
from tessera_ray.layout import preset_layout
from tests._imports import assert_loads_without

LAYOUT = preset_layout("deepseek-v3")
PAGE_BYTES = LAYOUT.groups[0].page.page_bytes
CUDA = torch.device("cuda")


def _injected(page: memoryview, seed: int) -> int:
    return xxhash.xxh3_128_intdigest(page, seed)


def _pool(num: int, *, as_device: bool) -> BlockPool:
    pool = BlockPool.for_group(LAYOUT, 0, PoolConfig(num_pages=num, pin_memory=False))
    if as_device:
        pool._memory.host = None  # what a CUDA pool has: no in-place host view of its pages
    return pool


def _pages(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def test_a_host_pool_hashes_in_place() -> None:
    assert _pool(2, as_device=False).hash_path == "host"


def test_device_pages_are_hashed_on_the_device_only_with_the_default_hash() -> None:
    on_cuda = "triton" if kernel_available() else "torch"
    assert device_hash_path(xxh3_128, PAGE_BYTES, CUDA) == on_cuda
    assert device_hash_path(xxhash.xxh3_128_intdigest, PAGE_BYTES, CUDA) == on_cuda
    # The kernel needs a GPU; a device that is not CUDA takes the torch form.
    assert device_hash_path(xxh3_128, PAGE_BYTES, torch.device("cpu")) == "torch"
    # Any other hash only the host runs; pages off XXH3's long path, or not whole 8-byte
    # words, keep the host's hash too.
    assert device_hash_path(_injected, PAGE_BYTES, CUDA) == "staged"
    for page_bytes in (64, 240, 244, 1001):
        assert device_hash_path(xxh3_128, page_bytes, CUDA) == "staged"


def test_without_triton_the_device_path_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # what an import of a missing package does
    monkeypatch.delitem(sys.modules, "tessera_ray.core._xxh3_kernel", raising=False)
    try:
        assert not kernel_available()
        assert device_hash_path(xxh3_128, PAGE_BYTES, CUDA) == "torch"
    finally:
        kernel_available.cache_clear()


def test_core_loads_without_triton_or_ray() -> None:
    assert_loads_without(("tessera_ray.core",), ("triton", "ray"))


def test_device_pages_seal_dedup_and_verify_like_host_pages() -> None:
    n = 9
    data = _pages(n, 1)
    data[6] = data[2]  # equal bytes: the second must share the first's page
    host, device = _pool(n, as_device=False), _pool(n, as_device=True)
    assert device.hash_path == "torch"
    results = []
    for pool in (host, device):
        sealed = pool.seal_many(pool.write_many(pool.allocate_many(n), data), "t")
        assert sealed[6].deduplicated and sealed[6].handle == sealed[2].handle
        results.append([(r.content_hash, r.deduplicated) for r in sealed])
        pool.check_consistency()
    assert results[0] == results[1]
    seed = content_seed("t", LAYOUT.fingerprint)
    assert [h for h, _ in results[1]] == [
        xxhash.xxh3_128_intdigest(p.numpy().tobytes(), seed) for p in data
    ]
    slots = [7, 0, 3]
    assert device.hash_pages(slots, seed) == host.hash_pages(slots, seed)


def test_one_device_page_seals_and_a_corrupted_one_fails_verification() -> None:
    pool, host = _pool(2, as_device=True), _pool(2, as_device=False)
    page = _pages(1, 2)[0]
    sealed = pool.seal(pool.write(pool.allocate(), page), "t")
    assert sealed.content_hash == host.seal(host.write(host.allocate(), page), "t").content_hash
    assert pool.verify(sealed.handle)
    pool.data[int(pool.slot(sealed.handle)), PAGE_BYTES - 1] ^= 1  # in the last stripe only
    assert not pool.verify(sealed.handle)


def test_fetched_device_pages_verify_on_the_device() -> None:
    n = 4
    owner, reader = _pool(n, as_device=True), _pool(n, as_device=True)
    data = _pages(n, 3)
    sealed = owner.seal_many(owner.write_many(owner.allocate_many(n), data), "t")
    expected = [int(r.content_hash) for r in sealed]
    arrived = data.clone()
    arrived[1, 100] ^= 0x80  # damaged on the way
    local = reader.write_many(reader.allocate_many(n), arrived)
    results, mismatched = reader.seal_verified(local, "t", expected)
    assert mismatched == [1]
    assert [None if r is None else int(r.content_hash) for r in results] == [
        expected[0],
        None,
        expected[2],
        expected[3],
    ]


def test_rows_are_gathered_as_words_only_where_the_layout_allows() -> None:
    data = torch.zeros((4, 1024), dtype=torch.uint8)
    words = as_words(data)
    assert words.dtype == torch.int64 and words.shape == (4, 128)
    words[1, 0] = -1  # a view: the bytes change underneath
    assert data[1, :8].tolist() == [255] * 8 and data[1, 8] == 0
    assert as_words(torch.zeros((4, 1020), dtype=torch.uint8)).dtype == torch.uint8
    assert as_words(data[:, 4:]).dtype == torch.uint8  # rows starting off an 8-byte boundary
    assert as_words(data[:, ::2]).dtype == torch.uint8  # not contiguous within a row
    strided = data.view(-1)[: 3 * 1020].view(3, 1020)[:, :1016]  # rows 1,020 B apart
    assert as_words(strided).dtype == torch.uint8
    assert as_words(data.view(-1)[8 : 8 + 3 * 1000].view(3, 1000)).dtype == torch.int64


def test_copy_rows_still_writes_every_row_from_any_input() -> None:
    dst = torch.zeros((6, 256), dtype=torch.uint8)
    src = _pages(1, 4)[0][: 2 * 512].view(2, 512)[:, ::2]  # not contiguous
    copy_rows(dst, [4, 1], src)
    assert torch.equal(dst[4], src[0]) and torch.equal(dst[1], src[1])
    assert int(dst[[0, 2, 3, 5]].count_nonzero()) == 0


def test_a_kernel_that_fails_to_run_falls_back_to_torch_with_the_same_digest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import tessera_ray.core._storage as storage

    calls: list[bool] = []
    real = storage.xxh3_128_rows

    def kernel_breaks(data: torch.Tensor, slots: list[int], seed: int, *, kernel: bool = False):  # type: ignore[no-untyped-def]
        calls.append(kernel)
        if kernel:
            raise RuntimeError("no compiler for this GPU")
        return real(data, slots, seed)

    monkeypatch.setattr(storage, "xxh3_128_rows", kernel_breaks)
    # As on a CUDA device where Triton imports: the kernel, while it has not failed.
    monkeypatch.setattr(
        storage, "device_hash_path", lambda *a: "torch" if storage._kernel_failure else "triton"
    )
    monkeypatch.setattr(storage, "_kernel_failure", [])
    storage.kernel_available.cache_clear()
    pool, host = _pool(3, as_device=True), _pool(3, as_device=False)
    data = _pages(3, 5)
    with caplog.at_level("WARNING", logger=storage.__name__):
        sealed = pool.seal_many(pool.write_many(pool.allocate_many(3), data), "t")
        again = pool.hash_pages([0, 1, 2], content_seed("t", LAYOUT.fingerprint))
    expected = host.seal_many(host.write_many(host.allocate_many(3), data), "t")
    assert [r.content_hash for r in sealed] == [r.content_hash for r in expected]
    assert again == [int(r.content_hash) for r in expected]
    assert calls == [True, False, False]  # tried once, then torch from then on
    assert storage._kernel_failure and not storage.kernel_available()
    assert sum("Triton device hash failed" in r.message for r in caplog.records) == 1
    storage.kernel_available.cache_clear()
