"""Content hashes computed on the GPU (core/_xxh3.py, core/_xxh3_kernel.py) against the host's
xxhash: a CUDA pool seals, verifies fetched pages and hashes them without copying them to the
host, into the keys a host pool gives the same bytes (skipped without CUDA)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import xxhash

from tessera_ray.core import BlockPool, PoolConfig, content_seed
from tessera_ray.core._storage import kernel_available
from tessera_ray.core._xxh3 import xxh3_128_rows
from tessera_ray.layout import preset_layout
from tessera_ray.transport import (
    FailureReason,
    Transport,
    TransportConfig,
    export_pages,
    fetch_verified,
    make_transport,
)
from tests._marks import GPU_ONLY

pytestmark = GPU_ONLY

LAYOUT = preset_layout("deepseek-v3")
PAGE_BYTES = LAYOUT.groups[0].page.page_bytes
NS = "gpu-hash"


def _pool(n: int, device: str = "cuda") -> BlockPool:
    return BlockPool.for_group(LAYOUT, 0, PoolConfig(num_pages=n, device=device))


def _pages(n: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), dtype=torch.uint8, generator=gen)


def _host(rows: torch.Tensor, seed: int) -> list[int]:
    return [xxhash.xxh3_128_intdigest(r.numpy().tobytes(), seed) for r in rows.cpu()]


def test_a_cuda_pool_hashes_on_the_device_into_the_host_digests() -> None:
    pool = _pool(8)
    assert pool.hash_path == ("triton" if kernel_available() else "torch")
    data = _pages(8, PAGE_BYTES, 0)
    handles = pool.write_many(pool.allocate_many(8), data.cuda())
    slots = [int(pool.slot(h)) for h in handles]
    assert torch.equal(pool.data[slots].cpu(), data)  # written through the word-wide copy
    seed = content_seed(NS, LAYOUT.fingerprint)
    order = slots[::-1]
    want = _host(data.flip(0), seed)
    assert pool.hash_pages(order, seed) == want
    assert xxh3_128_rows(pool.data, order, seed, kernel=False) == want  # the torch form


@pytest.mark.parametrize("length", [248, 1024, 1096, 5128, 73_728])
def test_the_compiled_kernel_equals_xxhash(length: int) -> None:
    if not kernel_available():
        pytest.skip("Triton is not installed")
    data = _pages(6, length, length).cuda()
    order = [5, 0, 3, 3, 1]
    for seed in (0, 1, 2**64 - 1):
        assert xxh3_128_rows(data, order, seed, kernel=True) == _host(data[order], seed)


def test_every_bit_flip_of_a_page_changes_the_compiled_key() -> None:
    page = _pages(1, 2048, 9)[0]
    bits = torch.arange(2048 * 8)
    variants = page.repeat(len(bits), 1)
    variants[bits, bits // 8] ^= (1 << (bits % 8)).to(torch.uint8)
    data = torch.cat([page[None], variants]).cuda()
    keys = xxh3_128_rows(data, list(range(len(data))), 5, kernel=kernel_available())
    assert len(set(keys)) == len(keys)
    assert keys[:64] == _host(data[:64], 5)


def test_an_injected_hash_is_staged_through_the_host() -> None:
    def injected(page: memoryview, seed: int) -> int:
        return xxhash.xxh3_128_intdigest(page, seed) & 0xFFFF  # weak, as collision tests use

    pool = BlockPool.for_group(
        LAYOUT, 0, PoolConfig(num_pages=2, device="cuda"), content_hash=injected
    )
    assert pool.hash_path == "staged"
    data = _pages(2, PAGE_BYTES, 3)
    handles = pool.write_many(pool.allocate_many(2), data.cuda())
    seed = content_seed(NS, LAYOUT.fingerprint)
    slots = [int(pool.slot(h)) for h in handles]
    assert pool.hash_pages(slots, seed) == [h & 0xFFFF for h in _host(data, seed)]


@pytest.fixture
def transports() -> Iterator[tuple[Transport, Transport]]:
    config = TransportConfig(kind="local")
    owner, reader = (
        make_transport(config, name="hash-owner"),
        make_transport(config, name="hash-reader"),
    )
    yield owner, reader
    reader.close()
    owner.close()


def test_seal_and_fetch_between_cuda_pools_key_pages_as_a_host_pool_does(
    transports: tuple[Transport, Transport],
) -> None:
    n = 12
    data = _pages(n, PAGE_BYTES, 4)
    host = _pool(n, device="cpu")
    host_keys = [
        r.content_hash for r in host.seal_many(host.write_many(host.allocate_many(n), data), NS)
    ]
    owner, reader = _pool(n), _pool(n)
    owner_t, reader_t = transports
    reader_t.register([reader])
    reader_t.add_peers([owner_t.register([owner])])
    sealed = owner.seal_many(owner.write_many(owner.allocate_many(n), data.cuda()), NS)
    assert [r.content_hash for r in sealed] == host_keys
    owner.data[int(owner.slot(sealed[5].handle)), PAGE_BYTES - 3] ^= 1  # damaged after its seal
    export = export_pages(owner, [r.handle for r in sealed], namespace=NS, peer=owner_t.name)
    result = fetch_verified(reader_t, export, timeout_s=60)
    assert [(f.position, f.reason) for f in result.failed] == [(5, FailureReason.HASH_MISMATCH)]
    fetched = sorted(result.fetched)
    assert [f.position for f in fetched] == [i for i in range(n) if i != 5]
    assert [f.content_hash for f in fetched] == [k for i, k in enumerate(host_keys) if i != 5]
    got = reader.data[[int(reader.slot(f.handle)) for f in fetched]].cpu()
    assert torch.equal(got, data[[f.position for f in fetched]])
    assert all(reader.verify(f.handle) for f in fetched)
    reader.check_consistency()
