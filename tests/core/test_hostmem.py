"""Host memory for pool pages: page-aligned, zeroed, writable, so direct disk reads can land
pages straight in pool slots."""

from __future__ import annotations

import pytest

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.core.hostmem import aligned_host_bytes, buffer_address

from .conftest import tiny_spec

PAGE = 4096


def test_pool_slots_are_block_aligned() -> None:
    """The disk tier reads straight into host pool slots only if they are aligned: the pool
    puts its first byte on a page boundary (torch alone gives 64 B)."""
    for num_pages in (1, 3, 64):
        pool = BlockPool(
            tiny_spec(PAGE), PoolConfig(num_pages=num_pages), fingerprint="aligned-test"
        )
        assert pool.data.data_ptr() % 4096 == 0
        assert pool.data.shape == (num_pages, PAGE)
        assert bool((pool.data == 0).all())
        row = pool.data[num_pages - 1].numpy().data
        assert row.nbytes == PAGE and not row.readonly


def test_aligned_host_bytes_zeroed_aligned_and_validated() -> None:
    view = aligned_host_bytes(3 * PAGE + 5)
    assert view.nbytes == 3 * PAGE + 5 and not view.readonly
    assert buffer_address(view) % 4096 == 0
    assert bytes(view[-64:]) == bytes(64)
    view[PAGE : PAGE + 2] = b"ok"
    assert bytes(view[PAGE : PAGE + 2]) == b"ok"
    with pytest.raises(ValueError, match="at least one byte"):
        aligned_host_bytes(0)
