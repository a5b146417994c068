"""The same-node path between device pools (CUDA IPC), skipped without a GPU: in one process
(the share is the tensor itself) and between two processes (the handle opened in the reader),
every fetched page verified and equal to the owner's."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.layout import preset_layout
from tessera_ray.transport import (
    DeviceShare,
    TransportConfig,
    export_pages,
    fetch_verified,
    make_transport,
)
from tests._marks import GPU_ONLY

pytestmark = GPU_ONLY

LAYOUT = preset_layout("deepseek-v3")
NODE = "gpu-node"
NS = "tenant-gpu"


def _pool(pages: int) -> BlockPool:
    return BlockPool.for_group(LAYOUT, 0, PoolConfig(num_pages=pages, device="cuda"))


def _fill(pool: BlockPool, n: int) -> tuple[list[Any], torch.Tensor]:
    data = torch.randint(0, 256, (n, pool.page_bytes), dtype=torch.uint8, device="cuda")
    sealed = pool.seal_many(pool.write_many(pool.allocate_many(n), data), NS)
    return [r.handle for r in sealed], data


def test_device_pools_of_one_process_read_through_the_share() -> None:
    owner_pool, reader_pool = _pool(16), _pool(16)
    owner = make_transport(TransportConfig(kind="nixl"), name="gpu-owner", node=NODE)
    reader = make_transport(TransportConfig(kind="nixl"), name="gpu-reader", node=NODE)
    info = owner.register(owner_pool)
    reader.register(reader_pool)
    assert isinstance(info.mappings[0], DeviceShare)
    reader.add_peers([info])
    assert reader.carrier("gpu-owner") == "mapped"
    handles, data = _fill(owner_pool, 12)
    export = export_pages(owner_pool, handles, namespace=NS, peer="gpu-owner")
    res = fetch_verified(reader, export, timeout_s=30)
    assert res.ok and len(res.fetched) == 12
    got = torch.stack([reader_pool.read(f.handle) for f in res.fetched])
    assert torch.equal(got, data) and reader.mapped_bytes == 12 * owner_pool.page_bytes
    reader.close()
    owner.close()


def _owner_process(conn: Any) -> None:
    pool = _pool(16)
    transport = make_transport(TransportConfig(kind="nixl"), name="gpu-ipc-owner", node=NODE)
    info = transport.register(pool)
    handles, data = _fill(pool, 10)
    torch.cuda.synchronize()
    export = export_pages(pool, handles, namespace=NS, peer="gpu-ipc-owner")
    conn.send((info, export, data.cpu()))
    conn.recv()  # keep the pool alive until the reader is done
    transport.close()


def test_device_pools_of_two_processes_read_through_cuda_ipc() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_owner_process, args=(there,))
    proc.start()
    try:
        info, export, data = here.recv()
        reader_pool = _pool(16)
        reader = make_transport(TransportConfig(kind="nixl"), name="gpu-ipc-reader", node=NODE)
        reader.register(reader_pool)
        reader.add_peers([info])
        assert reader.carrier("gpu-ipc-owner") == "mapped"
        res = fetch_verified(reader, export, timeout_s=30)
        assert res.ok and len(res.fetched) == 10
        got = torch.stack([reader_pool.read(f.handle).cpu() for f in res.fetched])
        assert torch.equal(got, data)
        reader.close()
    finally:
        here.send("done")
        proc.join(60)
