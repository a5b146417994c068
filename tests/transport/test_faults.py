"""Faults, each from a test-only subclass (no hook in production code): bytes corrupted as the
READ lands them, a NIXL transfer that never completes, a Ray owner too slow to answer. Plus the
rule that a fetch registers nothing and makes one request per ``hash_chunk_bytes`` however many
pages it reads."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tessera_ray.errors import TransferTimeoutError, TransportError, VerificationError
from tessera_ray.transport import (
    FailureReason,
    LocalTransport,
    NixlTransport,
    PeerInfo,
    TransferState,
    TransferTicket,
    fetch_verified,
)

from ._node import Node
from .conformance import unique


class CorruptingNixlTransport(NixlTransport):
    """Flips one byte of the first page of every read as its first request lands, like a bad
    link: before anything (the transport's own hashing included) reads the bytes."""

    def _start_many(
        self,
        tickets: list[TransferTicket],
        info: PeerInfo,
        lists: list[tuple[list[int], list[int]]],
    ) -> None:
        first = {t.id: local[0] for t, (_, local) in zip(tickets, lists, strict=True)}
        self._first_slot = {**getattr(self, "_first_slot", {}), **first}
        super()._start_many(tickets, info, lists)

    def _run_one(self, ticket: TransferTicket, *args: Any) -> tuple[TransferState, bool]:
        state, released = super()._run_one(ticket, *args)
        slot = self._first_slot.pop(ticket.id, None)
        if slot is not None:
            self.pool.data[slot, 1234] ^= 0x40
        return state, released


class CorruptingLocalTransport(LocalTransport):
    """Flips a byte of the first page of every copy before the copy's pages are hashed."""

    def _hash_landed(self, ticket: TransferTicket, local: Sequence[int]) -> tuple[int, ...] | None:
        self.pool.data[local[0], 7] ^= 0x01
        return super()._hash_landed(ticket, local)


class StuckNixlTransport(NixlTransport):
    """Reports every transfer as still in progress, as a wedged connection would."""

    released = 0

    def _state(self, handle: Any, posted: str | None = None) -> TransferState:
        return TransferState.PENDING

    def _settle(self, ticket_id: int) -> bool:
        StuckNixlTransport.released += 1
        return super()._settle(ticket_id)


class UncancellableNixlTransport(StuckNixlTransport):
    """A stuck transfer that NIXL also fails to cancel: its slots may still be written."""

    def _settle(self, ticket_id: int) -> bool:
        super()._settle(ticket_id)  # really release it, so the test leaks nothing
        return False


class SlowRayNode(Node):
    """An owner whose Ray endpoint answers long after any reasonable timeout."""

    def transport_serve(self, group: int, slots: list[int]) -> Any:
        time.sleep(8)
        return super().transport_serve(group, slots)


@pytest.fixture
def nixl_owner() -> Iterator[Node]:
    node = Node("nixl", unique("fault-owner"))
    yield node
    node.close()


@pytest.mark.parametrize(
    "kind,cls", [("nixl", CorruptingNixlTransport), ("local", CorruptingLocalTransport)]
)
def test_corrupted_bytes_are_caught_and_not_installed(kind: str, cls: type) -> None:
    owner = Node(kind, unique("corrupt-owner"))
    reader = Node(kind, unique("corrupt-reader"), transport_cls=cls)
    reader.add_peers([owner.peer_info()])
    lease, export, data = owner.put(5)
    free0 = reader.stats().pages_free
    res = fetch_verified(reader.transport, export, timeout_s=10)
    assert [(f.position, f.reason) for f in res.failed] == [(0, FailureReason.HASH_MISMATCH)]
    assert "page 0" in res.failed[0].detail and "not installed" in res.failed[0].detail
    assert [f.position for f in res.fetched] == [1, 2, 3, 4]
    assert reader.read_pages([f.handle for f in res.fetched]) == data[1:]
    s = reader.stats()
    assert s.pages_sealed == 4 and s.pages_free == free0 - 4
    # The corrupted bytes were scrubbed with the freed slot: nothing of them stays findable.
    with pytest.raises(VerificationError, match="1 of 5 pages"):
        res.raise_for_failures()
    reader.check()
    owner.unpin(lease)
    reader.close()
    owner.close()


def test_stuck_nixl_transfer_times_out_and_returns_slots(nixl_owner: Node) -> None:
    reader = Node("nixl", unique("stuck-reader"), transport_cls=StuckNixlTransport)
    reader.add_peers([nixl_owner.peer_info()])
    lease, export, _ = nixl_owner.put(4)
    free0 = reader.stats().pages_free
    released0 = StuckNixlTransport.released
    timeout_s = 0.5
    start = time.monotonic()
    res = fetch_verified(reader.transport, export, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert timeout_s <= elapsed < timeout_s + 1.0
    assert {f.reason for f in res.failed} == {FailureReason.TIMEOUT} and not res.fetched
    assert StuckNixlTransport.released == released0 + 1  # the request was released (aborted)
    assert reader.stats().pages_free == free0 and reader.stats().pages_sealed == 0
    with pytest.raises(TransferTimeoutError):
        res.raise_for_failures()
    nixl_owner.unpin(lease)
    reader.close()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_slow_ray_owner_times_out_and_returns_slots() -> None:
    import ray

    actor: Any = (
        ray.remote(SlowRayNode).options(num_cpus=0).remote("ray", unique("slow"), in_actor=True)
    )
    reader = Node("ray", unique("slow-reader"))
    from ._node import ActorProxy

    owner = ActorProxy(actor)
    reader.add_peers([owner.peer_info()])
    _, export, _ = owner.put(3)
    free0 = reader.stats().pages_free
    start = time.monotonic()
    res = fetch_verified(reader.transport, export, timeout_s=1.0)
    assert time.monotonic() - start < 2.0
    assert {f.reason for f in res.failed} == {FailureReason.TIMEOUT} and not res.fetched
    assert reader.stats().pages_free == free0 and reader.stats().pages_sealed == 0
    ray.kill(actor)


class _Counting:
    """Wraps the NIXL agent to count the calls that must not happen per transfer."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **kw)

        return counted


def _counting_reader(owner: Node, **kw: Any) -> tuple[Node, _Counting]:
    """A NIXL reader of ``owner`` whose agent calls are counted."""
    reader = Node("nixl", unique("counting-reader"), **kw)
    reader.add_peers([owner.peer_info()])
    counting = _Counting(reader.transport._agent)  # type: ignore[attr-defined]
    reader.transport._agent = counting  # type: ignore[attr-defined]
    return reader, counting


def test_fetch_registers_nothing_and_makes_one_request(nixl_owner: Node) -> None:
    reader, counting = _counting_reader(nixl_owner)
    for n in (1, 7, 16):
        lease, export, data = nixl_owner.put(n)
        res = fetch_verified(reader.transport, export, timeout_s=10)
        assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
        reader.drop([f.handle for f in res.fetched])
        nixl_owner.unpin(lease)
    calls = counting.calls
    assert calls.get("make_prepped_xfer") == 3  # one request per fetch, whatever its size
    assert calls.get("release_xfer_handle") == 3
    for never in ("register_memory", "prep_xfer_dlist", "initialize_xfer", "add_remote_agent"):
        assert never not in calls, f"{never} called during transfers"
    reader.close()


def test_a_hashing_read_is_one_request_per_hash_chunk(nixl_owner: Node) -> None:
    """A read that hashes is posted in requests of about hash_chunk_bytes (each hashed as it
    completes); with hash_chunk_bytes=0 it is one request again."""
    for hash_chunk, requests in ((2 * 4096, 4), (0, 1)):  # 7 pages: 2 + 2 + 2 + 1, or all
        reader, counting = _counting_reader(nixl_owner, hash_chunk_bytes=hash_chunk)
        lease, export, data = nixl_owner.put(7)
        res = fetch_verified(reader.transport, export, timeout_s=10)
        assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
        assert counting.calls.get("make_prepped_xfer") == requests
        assert counting.calls.get("release_xfer_handle") == requests
        nixl_owner.unpin(lease)
        reader.close()


def test_corruption_in_a_later_hash_chunk_is_caught(nixl_owner: Node) -> None:
    """A byte flipped as the third request of a read lands fails that page only."""

    class CorruptThirdRequest(NixlTransport):
        seen = 0

        def _run_one(self, ticket: TransferTicket, *args: Any) -> tuple[TransferState, bool]:
            state, released = super()._run_one(ticket, *args)
            CorruptThirdRequest.seen += 1
            if CorruptThirdRequest.seen == 3:
                slot = args[0][0]  # the request's first local descriptor: group 0, its slot
                self.pool.data[slot, 99] ^= 0x10
            return state, released

    reader = Node(
        "nixl",
        unique("late-corrupt"),
        hash_chunk_bytes=2 * 4096,
        transport_cls=CorruptThirdRequest,
    )
    reader.add_peers([nixl_owner.peer_info()])
    lease, export, data = nixl_owner.put(7)
    res = fetch_verified(reader.transport, export, timeout_s=10)
    assert [(f.position, f.reason) for f in res.failed] == [(4, FailureReason.HASH_MISMATCH)]
    assert [f.position for f in res.fetched] == [0, 1, 2, 3, 5, 6]
    kept = [data[i] for i in (0, 1, 2, 3, 5, 6)]
    assert reader.read_pages([f.handle for f in res.fetched]) == kept
    nixl_owner.unpin(lease)
    reader.close()


def test_uncancellable_transfer_withholds_its_slots(nixl_owner: Node) -> None:
    """Slots a late write could still reach are neither freed nor sealed, and counted."""
    reader = Node("nixl", unique("uncancellable-reader"), transport_cls=UncancellableNixlTransport)
    reader.add_peers([nixl_owner.peer_info()])
    lease, export, _ = nixl_owner.put(3)
    free0 = reader.stats().pages_free
    res = fetch_verified(reader.transport, export, timeout_s=0.2)
    assert not res.fetched and {f.reason for f in res.failed} == {FailureReason.TIMEOUT}
    assert res.withheld_slots == 3
    s = reader.stats()
    assert s.pages_free == free0 - 3 and s.pages_sealed == 0
    nixl_owner.unpin(lease)
    reader.close()


def test_register_takes_every_group_in_one_registration() -> None:
    from tessera_ray.transport import TransportConfig

    from ._node import make_pool

    t = NixlTransport(TransportConfig(kind="nixl"), name=unique("register-once"))
    counting = _Counting(t._agent)
    t._agent = counting
    pools = [make_pool(8, 4096), make_pool(4, 2048)]
    info = t.register(pools)
    assert counting.calls == {"register_memory": 1, "prep_xfer_dlist": 1, "get_agent_metadata": 1}
    assert [(r.num_pages, r.page_bytes) for r in info.regions] == [(8, 4096), (4, 2048)]
    with pytest.raises(TransportError, match="already registered"):
        t.register(pools)
    t.close()


class FailSecondReadNixlTransport(NixlTransport):
    """The second read of each fetch fails, as if the owner died between two chunks."""

    def _start_many(
        self,
        tickets: list[TransferTicket],
        info: PeerInfo,
        lists: list[tuple[list[int], list[int]]],
    ) -> None:
        self._doomed = tickets[1].id if len(tickets) > 1 else None
        super()._start_many(tickets, info, lists)

    def _run(
        self, ticket: TransferTicket, *args: Any
    ) -> tuple[TransferState, bool, tuple[int, ...] | None]:
        if ticket.id == self._doomed:
            return TransferState.FAILED, True, None
        return super()._run(ticket, *args)


CHUNK = 3 * 4096  # three pages per read


def test_chunked_fetch_is_one_request_per_chunk(nixl_owner: Node) -> None:
    reader, counting = _counting_reader(nixl_owner, fetch_chunk_bytes=CHUNK)
    lease, export, data = nixl_owner.put(8)
    res = fetch_verified(reader.transport, export, timeout_s=10)
    assert res.ok and reader.read_pages([f.handle for f in res.fetched]) == data
    assert counting.calls.get("make_prepped_xfer") == 3  # 3 + 3 + 2 pages
    nixl_owner.unpin(lease)
    reader.close()


def test_corruption_is_caught_per_chunk(nixl_owner: Node) -> None:
    reader = Node(
        "nixl",
        unique("chunk-corrupt"),
        fetch_chunk_bytes=CHUNK,
        transport_cls=CorruptingNixlTransport,
    )
    reader.add_peers([nixl_owner.peer_info()])
    lease, export, data = nixl_owner.put(8)
    res = fetch_verified(reader.transport, export, timeout_s=10)
    assert [f.position for f in res.failed] == [0, 3, 6]  # the first page of every read
    assert [f.position for f in res.fetched] == [1, 2, 4, 5, 7]
    assert reader.read_pages([f.handle for f in res.fetched]) == [data[i] for i in (1, 2, 4, 5, 7)]
    assert reader.stats().pages_sealed == 5 and reader.stats().pages_free == 32 - 5
    nixl_owner.unpin(lease)
    reader.close()


def test_failure_between_chunks_keeps_verified_pages_and_returns_the_rest(
    nixl_owner: Node,
) -> None:
    reader = Node(
        "nixl",
        unique("chunk-fail"),
        fetch_chunk_bytes=CHUNK,
        transport_cls=FailSecondReadNixlTransport,
    )
    reader.add_peers([nixl_owner.peer_info()])
    lease, export, data = nixl_owner.put(8)
    res = fetch_verified(reader.transport, export, timeout_s=10)
    assert [f.position for f in res.fetched] == [0, 1, 2]
    assert reader.read_pages([f.handle for f in res.fetched]) == data[:3]
    assert [f.position for f in res.failed] == [3, 4, 5, 6, 7]
    assert {f.reason for f in res.failed} == {FailureReason.TRANSFER_FAILED}
    s = reader.stats()
    assert s.pages_sealed == 3 and s.pages_free == 32 - 3
    reader.check()
    nixl_owner.unpin(lease)
    reader.close()
