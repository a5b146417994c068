"""The same-node path between processes on the shared test cluster: owners in Ray actors, the
reader in this process (on the head node). An owner on the reader's node is read through its
mapped slab; one on another simulated node goes over NIXL, although its slab is a file this
process could open (the simulated nodes share /dev/shm: the choice is by Ray node id). An owner
killed mid-read or before the read is a typed failure with nothing unverified kept; its
restart under the same name sweeps the dead slab and is mapped again."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.core.shm import SlabInfo, SlabMapping
from tessera_ray.transport import FailureReason
from tests.conftest import SimCluster, kill_and_wait

from ._node import Node, node_actor
from .conformance import unique

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

PAGE = 256 << 10


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    path = Path("/dev/shm") / f"tessera-mapped-actors-{os.getpid()}"
    path.mkdir(exist_ok=True)
    yield str(path)
    for p in path.iterdir():
        p.unlink()
    path.rmdir()


@pytest.fixture(scope="module")
def reader(tessera_cluster: SimCluster) -> Iterator[Node]:
    node = Node("nixl", unique("mapped-reader"), num_pages=64, page_bytes=PAGE)
    node.transport.node = tessera_cluster.node_ids[0]  # this process runs on the head
    yield node
    node.close()


def _owner(shm_dir: str, on_node: str, name: str | None = None, num_pages: int = 64) -> Any:
    return node_actor(
        "nixl",
        name or unique("mapped-owner"),
        on_node=on_node,
        ray_node=True,
        shared_memory_dir=shm_dir,
        num_pages=num_pages,
        page_bytes=PAGE,
    )


def _slab(info: Any) -> SlabInfo:
    slab = info.mappings[0]
    assert isinstance(slab, SlabInfo)
    return slab


def _until_released(slab: SlabInfo, timeout_s: float = 10.0) -> None:
    """Wait until the dead owner's last thread let go of its slab: ``kill_and_wait`` returns
    once the process's main thread is a zombie, while its other threads, which share its open
    files, may still be exiting (a read until then still finds the owner alive, and verifies)."""
    probe = SlabMapping(slab)
    deadline = time.monotonic() + timeout_s
    while probe.owner_alive():
        assert time.monotonic() < deadline, "the killed owner's slab is still held"
        time.sleep(0.01)
    probe.close()


def test_same_node_through_the_mapping_other_nodes_over_nixl(
    reader: Node, shm_dir: str, tessera_cluster: SimCluster
) -> None:
    head, other = tessera_cluster.node_ids[:2]
    near, far = _owner(shm_dir, head), _owner(shm_dir, other)
    near_info, far_info = near.peer_info(), far.peer_info()
    assert (near_info.node, far_info.node) == (head, other)
    assert os.path.exists(_slab(far_info).path)  # openable here, yet on another Ray node
    reader.add_peers([near_info, far_info])
    assert reader.carrier(near_info.name) == "mapped"
    assert reader.carrier(far_info.name) == "nixl"
    before = reader.mapped_counts()
    for owner, n in ((near, 40), (far, 24)):
        lease, export, data = owner.put(n)
        res = reader.fetch(export, 10.0)
        assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
        owner.unpin(lease)
        reader.drop([f.handle for f in res.fetched])
    reads, nbytes = reader.mapped_counts()
    assert reads > before[0] and nbytes - before[1] == 40 * PAGE  # the near owner's pages only
    reader.check()
    reader.transport.remove_peers([near_info.name, far_info.name])
    for owner in (near, far):
        owner.close()
        kill_and_wait(owner.handle)


def test_owner_killed_racing_the_mapped_read(
    reader: Node, shm_dir: str, tessera_cluster: SimCluster
) -> None:
    """The kill lands before, during or after the copy: whatever reached the reader verified,
    every other page is a typed failure and its slot is free again."""
    import threading

    owner = _owner(shm_dir, tessera_cluster.node_ids[0])
    info = owner.peer_info()
    reader.add_peers([info])
    _, export, data = owner.put(64)
    before = reader.stats()
    results: list[Any] = []
    fetching = threading.Thread(target=lambda: results.append(reader.fetch(export, 5.0)))
    fetching.start()
    kill_and_wait(owner.handle)
    fetching.join(30)
    (res,) = results
    n = len(res.fetched)
    assert [f.position for f in res.fetched] == list(range(n))
    assert [f.position for f in res.failed] == list(range(n, 64))
    assert {f.reason for f in res.failed} <= {FailureReason.TRANSFER_FAILED}
    assert reader.read_pages([f.handle for f in res.fetched]) == data[:n]
    after = reader.stats()
    assert after.pages_sealed == before.pages_sealed + n
    assert after.pages_free == before.pages_free - n
    reader.check()
    reader.drop([f.handle for f in res.fetched])
    reader.transport.remove_peers([info.name])


def test_owner_killed_then_restarted_is_remapped(
    reader: Node, shm_dir: str, tessera_cluster: SimCluster
) -> None:
    head = tessera_cluster.node_ids[0]
    name = unique("restarting-owner")
    first = _owner(shm_dir, head, name)
    reader.add_peers([first.peer_info()])
    dead_slab = _slab(first.peer_info())
    _, export, _ = first.put(16)
    kill_and_wait(first.handle)
    assert os.path.exists(dead_slab.path)  # killed: it could not unlink its slab
    _until_released(dead_slab)
    before = reader.stats()
    res = reader.fetch(export, 5.0)
    assert not res.fetched and {f.reason for f in res.failed} == {FailureReason.TRANSFER_FAILED}
    assert "owner process is gone" in res.failed[0].detail
    after = reader.stats()
    assert after.pages_free == before.pages_free and after.pages_sealed == before.pages_sealed
    # The new process under the same name: it sweeps the dead slab, publishes a new one, and
    # the reader maps that instead.
    second = _owner(shm_dir, head, name)
    info = second.peer_info()
    assert not os.path.exists(dead_slab.path) and _slab(info).path != dead_slab.path
    reader.add_peers([info])
    assert reader.carrier(name) == "mapped"
    reads = reader.mapped_counts()[0]
    lease, export, data = second.put(16)
    res = reader.fetch(export, 10.0)
    assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
    assert reader.mapped_counts()[0] > reads
    second.unpin(lease)
    reader.drop([f.handle for f in res.fetched])
    reader.transport.remove_peers([name])
    second.close()
    kill_and_wait(second.handle)
