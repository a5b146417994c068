"""The disk tier's direct reads land in the slots of a pool kept in shared memory (a slab
mapped from /dev/shm) as in private pool memory: page-aligned, no staging copy."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.core.shm import slab_of
from tessera_ray.storage import _direct as D
from tests.core.conftest import tiny_spec

from .conftest import open_disk, page, run

SIZE = 4096


def test_direct_reads_land_in_a_shared_memory_pool_without_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tempfile.mkdtemp(dir="/dev/shm")
    config = PoolConfig(num_pages=8, shared_memory_dir=directory, pin_memory=False)
    pool = BlockPool(tiny_spec(SIZE), config, fingerprint="disk-shm")
    assert slab_of(pool.data) is not None
    flat = pool.data.numpy().reshape(-1).data
    slots = [6, 1, 3, 0, 7]
    outs = [flat[s * SIZE : (s + 1) * SIZE] for s in slots]
    items = [page(i, size=SIZE) for i in range(len(slots))]
    staged = []
    real = D.read_direct

    def spy(*args: Any, **kw: Any) -> Any:
        staged.append(args)
        return real(*args, **kw)

    async def body() -> None:
        async with open_disk(tmp_path / "t") as tier:
            if not tier.direct_io:
                pytest.skip("the test filesystem has no O_DIRECT")
            await tier.put_many(items)
            monkeypatch.setattr(D, "read_direct", spy)
            assert await tier.get_many_into([k for k, _ in items], outs) == [SIZE] * len(items)

    try:
        run(body())
        assert not staged  # straight into the slab's slots
        assert [pool.data[s].numpy().tobytes() for s in slots] == [d for _, d in items]
    finally:
        outs.clear()  # the views keep the slab mapped
        del pool, flat
        gc.collect()
        assert os.listdir(directory) == []
        os.rmdir(directory)
