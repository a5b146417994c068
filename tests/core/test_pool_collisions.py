"""A weak (8-bit) content hash must never make a lookup return other bytes, nor mix tenants."""

from __future__ import annotations

import torch

from tessera_ray.core import content_seed, token_key, xxh3_128
from tests.core.conftest import FINGERPRINT, make_pool


def weak_hash(data: memoryview, seed: int) -> int:
    return xxh3_128(data, seed) & 0xFF


def test_8bit_hash_10000_pages_two_tenants() -> None:
    n, page_bytes = 10_000, 64
    pool = make_pool(n, page_bytes=page_bytes, content_hash=weak_hash)
    gen = torch.Generator().manual_seed(1)
    # 1,500 distinct contents shared by both tenants, so the same bytes appear under both
    # namespaces and repeat within each (dedup hits alongside collisions).
    contents = torch.randint(0, 256, (1500, page_bytes), dtype=torch.uint8, generator=gen)
    choice = torch.randint(0, 1500, (n,), generator=gen).tolist()
    tenants = ["alice", "bob"]
    sealed_under: dict[bytes, tuple[str, bytes]] = {}
    distinct: dict[str, set[bytes]] = {t: set() for t in tenants}
    for i in range(n):
        tenant = tenants[i % 2]
        data = contents[choice[i]]
        key = token_key(tenant, FINGERPRINT, None, [i])
        h = pool.write(pool.allocate(), data)
        res = pool.seal_block([h], tenant, key)
        assert res.token_key_registered
        sealed_under[key] = (tenant, data.numpy().tobytes())
        distinct[tenant].add(data.numpy().tobytes())
    for key, (tenant, data) in sealed_under.items():
        got = pool.lookup(tenant, key)
        assert got is not None and pool.read_bytes(got[0]) == data
        other = "bob" if tenant == "alice" else "alice"
        assert pool.lookup(other, key) is None
    # Expected collisions: per tenant, distinct contents minus distinct hash values used.
    expected = 0
    for tenant in tenants:
        seed = content_seed(tenant, FINGERPRINT)
        hashes = {weak_hash(memoryview(d), seed) for d in distinct[tenant]}
        expected += len(distinct[tenant]) - len(hashes)
    stats = pool.stats()
    assert stats.collisions == expected > 0
    assert stats.pages_sealed == sum(len(d) for d in distinct.values())
    pool.check_consistency()


def test_constant_hash_still_separates_every_page_and_tenant() -> None:
    pool = make_pool(64, content_hash=lambda data, seed: 0)
    handles = {}
    for tenant in ("a", "b"):
        for byte in range(8):
            data = torch.full((64,), byte, dtype=torch.uint8)
            res = pool.seal(pool.write(pool.allocate(), data), tenant)
            assert not res.deduplicated
            handles[tenant, byte] = res.handle
    # Re-sealing equal bytes finds the right page in the one shared bucket.
    for (tenant, byte), h in handles.items():
        res = pool.seal(
            pool.write(pool.allocate(), torch.full((64,), byte, dtype=torch.uint8)), tenant
        )
        assert res.deduplicated and res.handle == h
    # 7 collisions per tenant: every page after the first in each tenant's bucket.
    assert pool.stats().collisions == 14 and pool.stats().pages_used == 16
    pool.check_consistency()
