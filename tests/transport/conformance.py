"""One conformance class every transport passes.

Subclasses supply ``make_owner`` (in-process :class:`Node` or an actor proxy) and ``KIND``; the
reader is always an in-process :class:`Node`, so its pool can be inspected directly.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from tessera_ray.core import content_seed, xxh3_128
from tessera_ray.errors import TransportConfigError, TransportError
from tessera_ray.transport import (
    FailureReason,
    PageExport,
    PeerInfo,
    PoolRegion,
    TransferState,
    fetch_verified,
    fetch_verified_many,
)

from ._node import NAMESPACE, Node

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{time.monotonic_ns() % 10**9}"


def _reserved(owner: Any, reader: Any, n: int) -> tuple[Any, ...]:
    """``n`` pages pinned on ``owner`` and as many slots reserved on ``reader``: the lease,
    export and bytes, the reader's handles, their slots, and the owner's slots."""
    lease, export, data = owner.put(n)
    local = reader.pool.allocate_many(n)
    slots = [int(reader.pool.slot(h)) for h in local]
    return lease, export, data, local, slots, list(export.slots)


class TransportConformance:
    KIND = ""

    @classmethod
    def make_owner(cls, **kw: Any) -> Any:
        return Node(cls.KIND, unique(f"{cls.KIND}-owner"), **kw)

    @pytest.fixture
    def pair(self, owner: Any) -> Any:
        reader = Node(self.KIND, unique(f"{self.KIND}-reader"))
        reader.add_peers([owner.peer_info()])
        yield owner, reader
        reader.close()

    # ---------------------------------------------------------------- set-up

    def test_register_once_returns_peer_info(self, pair: Any) -> None:
        _owner, reader = pair
        info = reader.peer_info()
        assert isinstance(info, PeerInfo) and info.kind == self.KIND
        assert [(r.num_pages, r.page_bytes) for r in info.regions] == [(32, 4096)]
        assert info.regions[0].base_addr == reader.pool.data.data_ptr()
        assert info.name == reader.transport.name
        with pytest.raises(TransportError, match="already registered"):
            reader.transport.register(reader.pool)

    def test_peer_of_another_kind_is_refused(self, pair: Any) -> None:
        _, reader = pair
        other = "local" if self.KIND != "local" else "nixl"
        info = PeerInfo(kind=other, name="x", fingerprint="f", regions=(PoolRegion(1, 4096, 0),))
        with pytest.raises(TransportConfigError, match="transport"):
            reader.add_peers([info])

    # ---------------------------------------------------------------- raw reads

    def test_read_many_slots_in_one_ticket(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, data = owner.put(8)
        local = reader.pool.allocate_many(8)
        slots = [int(reader.pool.slot(h)) for h in local]
        # Reverse the mapping so a read that ignored the index lists would be caught.
        ticket = reader.transport.read(export.peer, list(export.slots), slots[::-1])
        assert ticket.num_pages == 8 and ticket.nbytes == 8 * 4096
        reader.transport.wait(ticket, timeout_s=10)
        got = reader.read_pages(local[::-1])
        assert got == data
        owner.unpin(lease)

    def test_read_many_queues_parts_in_order(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, data, local, slots, remote = _reserved(owner, reader, 7)
        parts = [(remote[:3], slots[:3]), (remote[3:4], slots[3:4]), (remote[4:], slots[4:])]
        tickets = reader.transport.read_many(export.peer, parts)
        assert [t.num_pages for t in tickets] == [3, 1, 3]
        assert len({t.id for t in tickets}) == 3
        for t in tickets:
            reader.transport.wait(t, timeout_s=10)
        assert reader.read_pages(local) == data
        owner.unpin(lease)

    def test_a_hashing_read_returns_the_landed_pages_digests(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _, local, slots, remote = _reserved(owner, reader, 6)
        seed = content_seed(export.namespace, reader.pool.fingerprint)
        parts = [(remote[:4], slots[:4][::-1]), (remote[4:], slots[4:])]
        tickets = reader.transport.read_many(export.peer, parts, hash_seed=seed)
        got = [reader.transport.wait(t, timeout_s=10) for t in tickets]
        # In the order of the local slots named (remote page i landed in the i-th), each equal
        # to the hash the owner sealed that page with.
        assert got[0] == tuple(export.content_hashes[:4])
        assert got[1] == tuple(export.content_hashes[4:])
        assert got[0] == tuple(
            xxh3_128(memoryview(p), seed) for p in reader.read_pages(local[:4][::-1])
        )
        plain = reader.transport.read(export.peer, remote[:1], slots[:1])
        assert reader.transport.wait(plain, timeout_s=10) is None  # not asked to hash
        with pytest.raises(TransportConfigError, match="hash_seed"):
            reader.transport.read(export.peer, remote[:1], slots[:1], hash_seed=-1)
        owner.unpin(lease)

    def test_read_many_checks_every_part_before_starting_any(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, data, local, slots, remote = _reserved(owner, reader, 4)
        before = reader.read_pages(local)
        with pytest.raises(TransportConfigError, match="twice"):
            reader.transport.read_many(
                export.peer, [(remote[:2], slots[:2]), (remote[2:], slots[:2])]
            )
        with pytest.raises(TransportConfigError, match="remote slot 32"):
            reader.transport.read_many(export.peer, [(remote[:2], slots[:2]), ([32], [slots[2]])])
        with pytest.raises(TransportConfigError, match="local slot True"):
            reader.transport.read_many(export.peer, [(remote[:1], [True])])
        assert reader.read_pages(local) == before != data  # no part of a refused call ran
        # numpy integers are slots too
        np = pytest.importorskip("numpy")
        (ticket,) = reader.transport.read_many(export.peer, [(np.array(remote), np.array(slots))])
        reader.transport.wait(ticket, timeout_s=10)
        assert reader.read_pages(local) == data
        owner.unpin(lease)

    def test_poll_reports_done_then_wait_settles(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, data = owner.put(3)
        local = reader.pool.allocate_many(3)
        ticket = reader.transport.read(
            export.peer, list(export.slots), [int(reader.pool.slot(h)) for h in local]
        )
        deadline = time.monotonic() + 10
        state = reader.transport.poll(ticket)
        while state is TransferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
            state = reader.transport.poll(ticket)
        assert state is TransferState.DONE
        reader.transport.wait(ticket, timeout_s=10)
        assert reader.read_pages(local) == data
        with pytest.raises(TransportError, match="settled"):
            reader.transport.wait(ticket, timeout_s=1)
        owner.unpin(lease)

    def test_abort_settles_the_ticket(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _ = owner.put(2)
        local = reader.pool.allocate_many(2)
        ticket = reader.transport.read(
            export.peer, list(export.slots), [int(reader.pool.slot(h)) for h in local]
        )
        assert reader.transport.abort(ticket) is True
        with pytest.raises(TransportError):
            reader.transport.wait(ticket, timeout_s=1)
        owner.unpin(lease)

    def test_unknown_peer_and_bad_slots_are_refused(self, pair: Any) -> None:
        owner, reader = pair
        with pytest.raises(TransportError, match="unknown peer"):
            reader.transport.read("nobody", [0], [0])
        peer = owner.peer_info().name
        with pytest.raises(TransportConfigError, match="remote slots but"):
            reader.transport.read(peer, [0, 1], [0])
        with pytest.raises(TransportConfigError, match="remote slot 32"):
            reader.transport.read(peer, [32], [0])
        with pytest.raises(TransportConfigError, match="local slot -1"):
            reader.transport.read(peer, [0], [-1])
        with pytest.raises(TransportConfigError, match="twice"):
            reader.transport.read(peer, [0, 1], [3, 3])

    # ---------------------------------------------------------------- verified fetch

    def test_fetch_refuses_bad_reserved_pages_and_changes_nothing(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _ = owner.put(2)
        sealed = fetch_verified(reader.transport, export, timeout_s=10).fetched[0].handle
        mine = reader.pool.allocate_many(1)
        before = reader.stats()
        for bad in ([mine[0], sealed], [mine[0], mine[0]]):
            with pytest.raises(TransportConfigError, match="distinct and writable"):
                fetch_verified(reader.transport, export, local=bad, timeout_s=10)
        assert reader.stats() == before  # nothing read, sealed or freed
        reader.pool.release_many(mine)
        reader.drop([sealed])
        owner.unpin(lease)

    def test_fetch_verifies_seals_and_dedups(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, data = owner.put(6)
        free0 = reader.stats().pages_free
        res = fetch_verified(reader.transport, export, timeout_s=10)
        assert res.ok and [f.position for f in res.fetched] == list(range(6))
        assert [f.content_hash for f in res.fetched] == list(export.content_hashes)
        assert all(reader.pool.is_sealed(f.handle) for f in res.fetched)
        assert reader.read_pages([f.handle for f in res.fetched]) == data
        assert res.bytes_moved == 6 * 4096
        s = reader.stats()
        assert s.pages_free == free0 - 6 and s.pages_sealed == 6
        # The same pages again: read, verified, then deduplicated onto the first copies.
        again = fetch_verified(reader.transport, export, timeout_s=10)
        assert again.ok and all(f.deduplicated for f in again.fetched)
        assert [f.handle for f in again.fetched] == [f.handle for f in res.fetched]
        assert reader.stats().pages_free == free0 - 6
        reader.check()
        owner.unpin(lease)

    def test_fetch_into_caller_reserved_slots(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _data = owner.put(4)
        local = reader.pool.allocate_many(4)
        res = fetch_verified(reader.transport, export, local=local, timeout_s=10)
        assert res.ok
        assert [reader.pool.slot(f.handle) for f in res.fetched] == [
            reader.pool.slot(h) for h in local
        ]
        owner.unpin(lease)

    def test_wrong_expected_hash_is_not_installed(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _data = owner.put(4)
        hashes = list(export.content_hashes)
        hashes[2] ^= 1
        tampered = PageExport(**{**export.__dict__, "content_hashes": tuple(hashes)})
        free0 = reader.stats().pages_free
        res = fetch_verified(reader.transport, tampered, timeout_s=10)
        assert [f.position for f in res.fetched] == [0, 1, 3]
        assert [(f.position, f.reason) for f in res.failed] == [(2, FailureReason.HASH_MISMATCH)]
        assert "page 2" in res.failed[0].detail
        s = reader.stats()
        assert s.pages_sealed == 3 and s.pages_free == free0 - 3
        reader.check()
        owner.unpin(lease)

    def test_layout_mismatch_fetches_nothing(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _ = owner.put(2)
        other = PageExport(**{**export.__dict__, "fingerprint": "another-layout"})
        free0 = reader.stats().pages_free
        res = fetch_verified(reader.transport, other, timeout_s=10)
        assert not res.fetched and {f.reason for f in res.failed} == {FailureReason.LAYOUT_MISMATCH}
        assert reader.stats().pages_free == free0
        owner.unpin(lease)

    def test_failed_transfer_returns_slots(self, pair: Any) -> None:
        owner, reader = pair
        lease, export, _ = owner.put(2)
        ghost = PageExport(**{**export.__dict__, "peer": "gone-peer"})
        free0 = reader.stats().pages_free
        res = fetch_verified(reader.transport, ghost, timeout_s=10)
        assert not res.fetched and len(res.failed) == 2
        assert {f.reason for f in res.failed} == {FailureReason.TRANSFER_FAILED}
        assert "gone-peer" in res.failed[0].detail
        assert reader.stats().pages_free == free0 and reader.stats().pages_sealed == 0
        with pytest.raises(TransportError):
            res.raise_for_failures()
        owner.unpin(lease)

    def test_empty_fetch(self, pair: Any) -> None:
        _, reader = pair
        export = PageExport(
            peer="x",
            namespace=NAMESPACE,
            fingerprint=reader.pool.fingerprint,
            page_bytes=4096,
            slots=(),
            content_hashes=(),
        )
        res = fetch_verified(reader.transport, export)
        assert res.ok and not res.fetched

    # ---------------------------------------------------------------- layer groups

    def test_one_transport_serves_every_layer_group(self, owner: Any) -> None:
        """A pool actor registers all its groups on one transport; a read names its group and
        lands only in that group's pool."""
        sizes = (4096, 2048)
        reader = Node(self.KIND, unique(f"{self.KIND}-groups-reader"), page_bytes=sizes)
        try:
            reader.add_peers([owner.peer_info()])
            assert [r.page_bytes for r in owner.peer_info().regions] == [4096, 2048]
            lease0, export0, data0 = owner.put(3, group=0)
            lease1, export1, data1 = owner.put(5, group=1)
            res0, res1 = fetch_verified_many(reader.transport, [export0, export1], timeout_s=10)
            assert res0.ok and res1.ok
            assert reader.read_pages([f.handle for f in res0.fetched], 0) == data0
            assert reader.read_pages([f.handle for f in res1.fetched], 1) == data1
            assert (reader.stats(0).pages_sealed, reader.stats(1).pages_sealed) == (3, 5)
            with pytest.raises(TransportConfigError, match="group 2"):
                reader.transport.read(export0.peer, [0], [0], group=2)
            # A group-1 export read as group 0 is refused before anything moves (page sizes).
            wrong = PageExport(**{**export1.__dict__, "group": 0})
            free0 = reader.stats(0).pages_free
            res = fetch_verified(reader.transport, wrong, timeout_s=10)
            assert {f.reason for f in res.failed} == {FailureReason.LAYOUT_MISMATCH}
            assert reader.stats(0).pages_free == free0
            owner.unpin(lease0)
            owner.unpin(lease1)
            reader.check()
        finally:
            reader.close()
