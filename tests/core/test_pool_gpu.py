"""The pool on a CUDA device and pinned host memory (skipped without a GPU)."""

from __future__ import annotations

import torch

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.layout import preset_layout
from tests._marks import GPU_ONLY

pytestmark = GPU_ONLY


def test_cuda_pool_dedups_and_views() -> None:
    layout = preset_layout("deepseek-v3")
    pool = BlockPool.for_group(layout, 0, PoolConfig(num_pages=4, device="cuda"))
    assert pool.data.is_cuda and pool.flashmla_view().shape == (4, 64, 1, 576)
    page = torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8, device="cuda")
    a = pool.seal(pool.write(pool.allocate(), page), "t")
    b = pool.seal(pool.write(pool.allocate(), page), "t")
    assert b.deduplicated and b.handle == a.handle
    pool.release_many([a.handle, b.handle])
    (gone,) = pool.evict(1)
    assert gone.data == page.cpu().numpy().tobytes()
    pool.check_consistency()


def test_cpu_pool_is_pinned_next_to_a_gpu() -> None:
    pool = BlockPool.for_group(preset_layout("deepseek-v3"), 0, PoolConfig(num_pages=2))
    assert pool.data.is_pinned()


def test_a_shared_memory_pool_is_pinned_for_device_copies() -> None:
    """A host pool in a shared-memory slab is page-locked (cudaHostRegister) like a pinned
    pool, and unregistered when it goes."""
    import gc
    import os
    import tempfile

    from tessera_ray.core.shm import slab_of

    directory = tempfile.mkdtemp(dir="/dev/shm")
    layout = preset_layout("deepseek-v3")
    config = PoolConfig(num_pages=4, pin_memory=True, shared_memory_dir=directory)
    pool = BlockPool.for_group(layout, 0, config)
    assert slab_of(pool.data) is not None and pool.data.is_pinned()
    page = torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8)
    h = pool.write(pool.allocate(), page)
    on_device = pool.data[int(pool.slot(h))].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), page)
    del pool, h
    gc.collect()
    assert os.listdir(directory) == []
    os.rmdir(directory)
