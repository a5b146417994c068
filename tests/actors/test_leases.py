"""The pool's lease table: ids unique across reservations and pins, expiry by the injected
clock, each lease taken out once through the table's own methods, everything handed back on
close."""

from __future__ import annotations

from tessera_ray.actors._leases import LeaseTable


def test_expired_leases_leave_both_tables_and_live_ones_stay() -> None:
    now = [100.0]
    table = LeaseTable(lambda: now[0])
    r1, _ = table.reserve([], 5.0)
    r2, _ = table.reserve([], 50.0)
    p1, pin = table.pin([], 10.0, "ns")
    assert len({r1, r2, p1}) == 3 and pin.namespace == "ns" and pin.expires_at_s == 110.0
    now[0] = 107.0
    assert len(table.expired()) == 1 and set(table.reservations) == {r2} and p1 in table.pins
    now[0] = 110.0  # a deadline reached is expired
    assert len(table.expired()) == 1 and not table.pins
    assert table.expired() == []
    assert len(table.drain()) == 1 and not table.reservations


def test_ids_are_not_sequential() -> None:
    table = LeaseTable(lambda: 0.0)
    ids = [table.reserve([], 1.0)[0] for _ in range(50)]
    assert len(set(ids)) == 50
    assert sorted(ids) != ids and all(i > 0 for i in ids)


def test_a_lease_leaves_its_table_once_through_the_owners_methods() -> None:
    table = LeaseTable(lambda: 0.0)
    rid, reserved = table.reserve([], 5.0)
    pid, pinned = table.pin([], 5.0, "ns")
    assert table.reservation(rid) is reserved and table.pinned(pid) is pinned
    assert table.reservation(pid) is None and table.pinned(rid) is None  # ids keep their kind
    assert table.take_reservation(rid) is reserved and table.take_reservation(rid) is None
    assert table.unpin(pid) is pinned and table.unpin(pid) is None
    assert table.drain() == []
