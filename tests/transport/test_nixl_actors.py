"""NIXL between two Ray actors over real UCX (no mocks): the full verified fetch, the owner
killed before and during a read, and the register-once / one-request-per-fetch rules."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tessera_ray.transport import FailureReason
from tests.conftest import kill_and_wait

from ._node import node_actor
from .conformance import unique

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

MiB = 1 << 20


@pytest.fixture(scope="module")
def reader() -> Any:
    node = node_actor("nixl", unique("nixl-reader-actor"), num_pages=64, page_bytes=MiB // 4)
    yield node
    node.close()


def test_fetch_between_two_actors(reader: Any) -> None:
    owner = node_actor("nixl", unique("nixl-owner-actor"), num_pages=64, page_bytes=MiB // 4)
    reader.add_peers([owner.peer_info()])
    lease, export, data = owner.put(48)
    free0 = reader.stats().pages_free
    res = reader.fetch(export, 10.0)
    assert res.ok and len(res.fetched) == 48
    assert reader.read_pages([f.handle for f in res.fetched]) == data
    assert reader.stats().pages_sealed == 48 and reader.stats().pages_free == free0 - 48
    reader.check()
    owner.unpin(lease)
    assert owner.stats().pages_evictable == 48  # pins dropped: the owner may evict them again
    reader.drop([f.handle for f in res.fetched])  # the module's reader starts the next test empty
    owner.close()


def test_owner_killed_before_read(reader: Any) -> None:
    owner = node_actor("nixl", unique("nixl-doomed-owner"), num_pages=16, page_bytes=MiB // 4)
    reader.add_peers([owner.peer_info()])
    _, export, _ = owner.put(8)
    kill_and_wait(owner.handle)
    before = reader.stats()
    timeout_s = 3.0
    start = time.monotonic()
    res = reader.fetch(export, timeout_s)
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 2.0  # the actor round trip on a busy 2-core machine
    assert not res.fetched and [f.position for f in res.failed] == list(range(8))
    assert {f.reason for f in res.failed} <= {FailureReason.TRANSFER_FAILED, FailureReason.TIMEOUT}
    after = reader.stats()
    assert after.pages_free == before.pages_free and after.pages_sealed == before.pages_sealed
    reader.check()


def test_owner_killed_racing_the_read(reader: Any) -> None:
    """Kill the owner right after the read starts. The fetch is split into chunks (4 MiB), so
    the kill usually lands mid-transfer: the chunks read before it are verified and sealed,
    every later page fails and its slot is free again; no slot leaks, nothing unverified stays."""
    import ray

    owner = node_actor("nixl", unique("nixl-racing-owner"), num_pages=64, page_bytes=MiB // 4)
    reader.add_peers([owner.peer_info()])
    _, export, data = owner.put(64)
    before = reader.stats()
    ref = reader.handle.fetch.remote(export, 3.0)
    ray.kill(owner.handle, no_restart=True)
    res = ray.get(ref, timeout=30)
    after = reader.stats()
    n = len(res.fetched)
    assert [f.position for f in res.fetched] == list(range(n))  # a verified prefix
    assert [f.position for f in res.failed] == list(range(n, 64))
    assert {f.reason for f in res.failed} <= {FailureReason.TRANSFER_FAILED, FailureReason.TIMEOUT}
    assert reader.read_pages([f.handle for f in res.fetched]) == data[:n]
    assert res.bytes_moved >= n * (MiB // 4) and (n == 64) == (res.bytes_moved == 64 * (MiB // 4))
    assert after.pages_sealed == before.pages_sealed + n
    assert after.pages_free == before.pages_free - n
    reader.check()
    if n:
        reader.drop([f.handle for f in res.fetched])
