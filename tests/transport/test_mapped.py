"""The same-node path without Ray: two NIXL transports in one process that say which node they
run on. Same node and shared pool memory: reads are copies out of the mapped slab; another node:
NIXL. A slot freed and reused under a stale mapping fails verification; a gone owner is a typed
failure; a new owner under the same name is mapped again; a mapping that cannot be made falls
back to NIXL, logged and counted, or is refused under ``same_node="mapped"``."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera_ray.core.shm import SlabInfo
from tessera_ray.errors import TransportConfigError, TransportError
from tessera_ray.transport import (
    FailureReason,
    NixlTransport,
    TransportConfig,
    fallback_counts,
    make_transport,
)
from tessera_ray.transport._mapped import MappedPeer
from tessera_ray.transport._mapped_reads import MIN_COPY_BYTES

from ._node import Node
from .conformance import unique


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = Path("/dev/shm") / f"tessera-mapped-test-{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir()
    yield str(path)
    gc.collect()  # pools of the test unlink their slabs when collected
    for p in path.iterdir():
        p.unlink()
    path.rmdir()


def _owner(shm_dir: str, node: str, name: str | None = None, **kw: object) -> Node:
    return Node("nixl", name or unique("owner"), node=node, shared_memory_dir=shm_dir, **kw)  # type: ignore[arg-type]


def _fetch_ok(owner: Node, reader: Node, n: int) -> None:
    lease, export, data = owner.put(n)
    res = reader.fetch(export, 10.0)
    assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
    owner.unpin(lease)
    reader.drop([f.handle for f in res.fetched])


def test_same_node_reads_are_copies_out_of_the_mapping_other_nodes_use_nixl(
    shm_dir: str,
) -> None:
    owner = _owner(shm_dir, "node-a")
    near = Node("nixl", unique("near"), node="node-a")
    # NIXL registers a shared-memory pool like any other: the far reader lands its reads in
    # one (and reads the owner's out of one).
    far = Node("nixl", unique("far"), node="node-b", shared_memory_dir=shm_dir)
    unknown = Node("nixl", unique("unplaced"))  # no node given: never maps
    info = owner.peer_info()
    assert info.node == "node-a" and isinstance(info.mappings[0], SlabInfo)
    for reader in (near, far, unknown):
        reader.add_peers([info])
    assert near.carrier(info.name) == "mapped"
    assert far.carrier(info.name) == "nixl" == unknown.carrier(info.name)
    with pytest.raises(TransportError, match="unknown peer"):
        near.carrier("nobody")
    for reader in (near, far, unknown):
        _fetch_ok(owner, reader, 12)
    assert near.mapped_counts() == (1, 12 * 4096)
    assert far.mapped_counts() == (0, 0) == unknown.mapped_counts()
    for node in (near, far, unknown, owner):
        node.close()


def test_an_on_demand_reader_runs_no_agent_until_a_peer_needs_one(shm_dir: str) -> None:
    """What an engine worker's reader does: its node's pool is read through the mapping, with
    no NIXL agent (no progress thread) in the reader's process; a peer it cannot map starts
    the agent then, and is read over NIXL."""
    owner = _owner(shm_dir, "node-a")
    far_owner = _owner(shm_dir, "node-b")
    reader = Node("nixl", unique("reader"), node="node-a", nixl_agent_on_demand=True)
    transport = reader.transport
    assert isinstance(transport, NixlTransport) and not transport.agent_started
    assert reader.peer_info().metadata == b""  # nothing to publish: no agent yet
    reader.add_peers([owner.peer_info()])
    _fetch_ok(owner, reader, 6)
    assert reader.carrier(owner.info.name) == "mapped" and not transport.agent_started
    reader.add_peers([far_owner.peer_info()])
    assert transport.agent_started and reader.carrier(far_owner.info.name) == "nixl"
    _fetch_ok(far_owner, reader, 5)
    _fetch_ok(owner, reader, 3)  # the mapped peer stays mapped
    assert reader.mapped_counts() == (2, 9 * 4096)
    assert transport.peer_info().metadata  # the agent runs now, and is published
    for node in (reader, owner, far_owner):
        node.close()


def test_a_reader_without_an_agent_cannot_be_read_from(shm_dir: str) -> None:
    reader = Node("nixl", unique("reader"), node="node-a", nixl_agent_on_demand=True)
    other = Node("nixl", unique("other"), node="node-b")
    with pytest.raises(TransportConfigError, match="publishes no NIXL agent"):
        other.add_peers([reader.peer_info()])
    assert not other.transport.peers
    for node in (reader, other):
        node.close()


def test_a_read_of_many_chunks_lands_every_page_in_order(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies of at least MIN_COPY_BYTES each (smaller ones take a slow memmove on some
    CPUs), each chunk hashed where it landed: every byte arrives, and the digests line up with
    the export's pages."""
    owner = _owner(shm_dir, "node-a", num_pages=800)
    near = Node("nixl", unique("near"), node="node-a", num_pages=800)
    near.add_peers([owner.peer_info()])
    copies: list[int] = []
    copy = MappedPeer.copy

    def counted(peer: MappedPeer, group: int, remote: list[int], *rest: object) -> None:
        copies.append(len(remote))
        copy(peer, group, remote, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(MappedPeer, "copy", counted)
    _fetch_ok(owner, near, 700)
    per_chunk = MIN_COPY_BYTES // 4096
    assert copies == [per_chunk, per_chunk, 700 - 2 * per_chunk]
    for node in (near, owner):
        node.close()


def test_backend_mode_never_maps(shm_dir: str) -> None:
    owner = _owner(shm_dir, "node-a")
    reader = Node("nixl", unique("reader"), node="node-a", same_node="backend")
    reader.add_peers([owner.peer_info()])
    assert reader.carrier(owner.peer_info().name) == "nixl"
    _fetch_ok(owner, reader, 4)
    assert reader.mapped_counts() == (0, 0)
    reader.close()
    owner.close()


def test_a_slot_freed_and_reused_under_a_stale_mapping_fails_verification(
    shm_dir: str,
) -> None:
    """The export names slots the owner no longer holds for those pages (its pin was dropped,
    the pages evicted, the slots refilled): the copy reads the new bytes, and nothing of them
    is sealed."""
    owner = _owner(shm_dir, "node-a", num_pages=8)
    reader = Node("nixl", unique("reader"), node="node-a")
    reader.add_peers([owner.peer_info()])
    lease, stale, _ = owner.put(8)
    owner.unpin(lease)
    owner.pool.evict(8, copy_data=False)
    lease2, fresh, _ = owner.put(8)
    assert set(fresh.slots) == set(stale.slots)  # the same slots, other pages
    before = reader.stats()
    res = reader.fetch(stale, 10.0)
    assert not res.fetched and len(res.failed) == 8
    assert {f.reason for f in res.failed} == {FailureReason.HASH_MISMATCH}
    after = reader.stats()
    assert after.pages_sealed == before.pages_sealed and after.pages_free == before.pages_free
    assert reader.mapped_counts()[0] == 1  # it was the mapped path that read them
    reader.check()
    owner.unpin(lease2)
    reader.close()
    owner.close()


def test_a_gone_owner_is_a_typed_failure_and_its_mapping_is_dropped(shm_dir: str) -> None:
    owner = _owner(shm_dir, "node-a")
    reader = Node("nixl", unique("reader"), node="node-a")
    name = owner.peer_info().name
    reader.add_peers([owner.peer_info()])
    _, export, _ = owner.put(6)
    owner.close()
    del owner  # the owner's pools go: its slab is unlinked and its lock released
    gc.collect()
    assert os.listdir(shm_dir) == []
    before = reader.stats()
    res = reader.fetch(export, 10.0)
    assert not res.fetched and len(res.failed) == 6
    assert {f.reason for f in res.failed} == {FailureReason.TRANSFER_FAILED}
    assert "owner process is gone" in res.failed[0].detail
    after = reader.stats()
    assert after.pages_free == before.pages_free and after.pages_sealed == before.pages_sealed
    again = reader.fetch(export, 10.0)  # the closed mapping keeps failing, never serves
    assert {f.reason for f in again.failed} == {FailureReason.TRANSFER_FAILED}
    assert reader.carrier(name) == "mapped" and reader.mapped_counts() == (0, 0)
    reader.check()
    reader.close()


def test_a_restarted_owner_is_mapped_again(shm_dir: str) -> None:
    """A new process under the same pool name publishes a new slab: adding its info replaces
    the old mapping."""
    first = _owner(shm_dir, "node-a", name="pool-x")
    reader = Node("nixl", unique("reader"), node="node-a")
    reader.add_peers([first.peer_info()])
    _fetch_ok(first, reader, 3)
    old_info = first.peer_info()
    first.close()
    del first
    gc.collect()
    second = _owner(shm_dir, "node-a", name="pool-x")
    new_info = second.peer_info()
    assert new_info.mappings != old_info.mappings
    reader.add_peers([new_info])
    assert reader.carrier("pool-x") == "mapped"
    _fetch_ok(second, reader, 5)
    assert reader.mapped_counts() == (2, 8 * 4096)
    reader.close()
    second.close()


def test_an_unmappable_peer_falls_back_to_nixl_logged_and_counted(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer's slab is not here (another container sharing the node id, say)."""
    owner = _owner(shm_dir, "node-a")
    info = owner.peer_info()
    slab = info.mappings[0]
    assert isinstance(slab, SlabInfo)
    elsewhere = dataclasses.replace(slab, path=slab.path.replace(shm_dir, "/nonexistent-dir"))
    peer = dataclasses.replace(info, mappings=(elsewhere,))
    key = ("mapped", "nixl", "FileNotFoundError")
    before = fallback_counts().get(key, 0)
    reader = Node("nixl", unique("reader"), node="node-a")
    with caplog.at_level(logging.WARNING, logger="tessera_ray.transport"):
        reader.add_peers([peer])
    assert fallback_counts()[key] == before + 1
    lines = [r for r in caplog.records if "not mappable" in r.getMessage()]
    assert len(lines) == 1 and info.name in lines[0].getMessage()
    assert reader.carrier(info.name) == "nixl"
    _fetch_ok(owner, reader, 4)  # NIXL still carries it
    # A same-node peer whose pools are private memory: NIXL too, counted under its reason.
    private = Node("nixl", unique("private"), node="node-a")
    reader.add_peers([private.peer_info()])
    assert reader.carrier(private.peer_info().name) == "nixl"
    assert fallback_counts()[("mapped", "nixl", "PeerMappingError")] >= 1
    for node in (reader, private, owner):
        node.close()


def test_forcing_mapped_refuses_other_nodes_and_unmappable_peers(shm_dir: str) -> None:
    with pytest.raises(TransportConfigError, match="needs the Ray node"):
        NixlTransport(TransportConfig(same_node="mapped"), name=unique("t"))
    with pytest.raises(TransportConfigError, match="same_node must be one of"):
        TransportConfig(same_node="shm")  # type: ignore[arg-type]
    owner = _owner(shm_dir, "node-a")
    private = Node("nixl", unique("private"), node="node-a")
    reader = Node("nixl", unique("reader"), node="node-b", same_node="mapped")
    with pytest.raises(TransportConfigError, match="node 'node-a', not on this node 'node-b'"):
        reader.add_peers([owner.peer_info()])
    assert reader.transport.peers == ()  # nothing half-added
    near = Node("nixl", unique("near"), node="node-a", same_node="mapped")
    with pytest.raises(TransportConfigError, match="cannot be mapped"):
        near.add_peers([private.peer_info()])
    near.add_peers([owner.peer_info()])
    assert near.transport.peers == (owner.peer_info().name,)
    _fetch_ok(owner, near, 2)
    for node in (near, reader, private, owner):
        node.close()


def test_make_transport_passes_the_node() -> None:
    t = make_transport(TransportConfig(kind="nixl"), node="node-z")
    assert t.node == "node-z"
    t.close()
    with pytest.raises(TransportConfigError, match="node must be"):
        make_transport(TransportConfig(kind="nixl"), node="")


def test_a_split_fetch_runs_its_parts_back_to_back_on_the_transport_thread(
    shm_dir: str,
) -> None:
    """A fetch split into parts (``fetch_chunk_bytes``) hands them to the transport's own
    thread, one after the other, while the caller verifies the parts already landed."""
    owner = _owner(shm_dir, "node-a")
    reader = Node("nixl", unique("reader"), node="node-a", fetch_chunk_bytes=3 * 4096)
    reader.add_peers([owner.peer_info()])
    _fetch_ok(owner, reader, 10)  # parts of 3, 3, 3 and 1 pages
    assert reader.mapped_counts() == (4, 10 * 4096)
    # Parts started together settle each on its own wait or abort.
    lease, export, data = owner.put(6)
    local = reader.pool.allocate_many(6)
    slots = [int(reader.pool.slot(h)) for h in local]
    remote = list(export.slots)
    parts = [(remote[:2], slots[:2]), (remote[2:4], slots[2:4]), (remote[4:], slots[4:])]
    tickets = reader.transport.read_many(export.peer, parts)
    assert all(t.mapped for t in tickets)
    assert reader.transport.abort(tickets[2]) is True
    with pytest.raises(TransportError, match="settled"):
        reader.transport.wait(tickets[2], timeout_s=5)
    for t in tickets[:2]:
        assert reader.transport.wait(t, timeout_s=5) is None  # not asked to hash
    assert reader.read_pages(local[:4]) == data[:4]
    reader.pool.release_many(local)
    owner.unpin(lease)
    reader.close()
    owner.close()
