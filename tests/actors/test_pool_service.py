"""PoolService without Ray: two-phase store, leases, pins, verified install, replica-aware
eviction with disk spill, restart from disk."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.messages import FetchFailure
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.errors import LeaseError, PageShapeError, PoolExhaustedError
from tests.actors._pools import LAYOUT, NS, Clock, keys, payloads, rot, run


def make(
    name: str = "p0",
    *,
    num_blocks: int = 8,
    directory: LocalDirectory | None = None,
    disk: Path | None = None,
    clock: Clock | None = None,
) -> PoolService:
    cfg = PoolServiceConfig(num_blocks=num_blocks, disk_root=disk, lease_s=10.0)
    return PoolService(name, LAYOUT, cfg, directory=directory, clock=clock or Clock())


def test_store_pin_read_round_trip() -> None:
    d = LocalDirectory(2)
    pool = make(directory=d)
    ks, data = keys(3), payloads(3, 0, pool.block_bytes)
    stored = run(pool.store(NS, ks, data))
    assert [s.token_key for s in stored] == ks and all(s.registered for s in stored)
    assert pool.contains(NS, ks) == [Tier.MEMORY] * 3
    ticket = run(pool.pin(NS, ks))
    assert all(b is not None for b in ticket.blocks)
    assert np.array_equal(pool.read_pinned(ticket.id), data)
    assert pool.unpin(ticket.id) and not pool.unpin(ticket.id)
    got = run(pool.read(NS, [*ks, keys(1, start=9)[0]]))
    assert [np.array_equal(g, row) for g, row in zip(got[:3], data, strict=True)] == [True] * 3
    assert got[3] is None and pool.status().pins == 0
    found = run(d.lookup(NS, ks))
    assert [r.block_hash for r in found if r] == [s.block_hash for s in stored]
    assert run(d.lookup("tenant-b", ks)) == [None] * 3


def test_reservation_expires_and_returns_slots() -> None:
    clock = Clock()
    pool = make(clock=clock)
    free = pool.status().blocks_free
    res = run(pool.reserve(3))
    assert pool.status().blocks_free == free - 3
    clock.now += 11
    assert pool.reap() == 1
    assert pool.status().blocks_free == free and pool.status().reservations == 0
    with pytest.raises(LeaseError, match="unknown or expired"):
        run(pool.commit(res.id, NS, keys(1), payloads(1, 0, pool.block_bytes)))


def test_commit_uses_part_of_a_reservation_and_returns_the_rest() -> None:
    pool = make()
    res = run(pool.reserve(4))
    run(pool.commit(res.id, NS, keys(2), payloads(2, 1, pool.block_bytes)))
    s = pool.status()
    assert s.reservations == 0 and s.blocks_in_memory == 2 and s.blocks_free == 6


def test_bad_input_changes_nothing() -> None:
    pool = make()
    res = run(pool.reserve(2))
    with pytest.raises(PageShapeError, match=r"payloads must be \[2, "):
        run(pool.commit(res.id, NS, keys(2), payloads(1, 0, pool.block_bytes)))
    with pytest.raises(PageShapeError, match="token key is 32 bytes"):
        run(pool.commit(res.id, NS, [b"short"], payloads(1, 0, pool.block_bytes)))
    with pytest.raises(PageShapeError, match="payloads must be a uint8 array"):
        run(pool.commit(res.id, NS, keys(1), payloads(1, 0, pool.block_bytes).astype(np.int16)))
    # The reservation survived every refused commit.
    run(pool.commit(res.id, NS, keys(2), payloads(2, 0, pool.block_bytes)))
    with pytest.raises(PoolExhaustedError, match="split the request"):
        run(pool.reserve(9))
    with pytest.raises(LeaseError, match="lease_s must be"):
        run(pool.reserve(1, lease_s=10_000))


def test_pinned_blocks_are_never_evicted_and_pins_expire() -> None:
    clock = Clock()
    pool = make(num_blocks=2, clock=clock)
    ks = keys(2)
    run(pool.store(NS, ks, payloads(2, 2, pool.block_bytes)))
    ticket = run(pool.pin(NS, ks))
    with pytest.raises(PoolExhaustedError, match="after eviction"):
        run(pool.reserve(1))
    clock.now += 11
    res = run(pool.reserve(1))  # the pin expired: its blocks became evictable
    assert res.num_blocks == 1 and pool.status().pins == 0
    assert ticket.id not in pool.leases.pins


def test_a_resident_pin_needs_no_await_and_a_spilled_block_takes_the_full_pin(
    tmp_path: Path,
) -> None:
    """pin_resident answers for blocks in memory or nowhere; with a block only on disk it
    holds nothing and says so (None), and pin() restores that block."""
    pool = make(num_blocks=4, directory=LocalDirectory(1), disk=tmp_path)
    ks, data = keys(3), payloads(3, 9, pool.block_bytes)
    run(pool.store(NS, ks[:2], data[:2]))
    ticket = pool.pin_resident(NS, ks)  # two resident, one never stored: a miss
    assert ticket is not None and [b is not None for b in ticket.blocks] == [True, True, False]
    assert np.array_equal(pool.read_pinned(ticket.id), data[:2])
    assert pool.status().pins == 1 and pool.unpin(ticket.id)
    run(pool.store(NS, ks[2:], data[2:]))
    run(pool.evict(1))  # the oldest block (ks[0]) goes to disk
    assert pool.contains(NS, ks[:1]) == [Tier.DISK]
    assert pool.pin_resident(NS, ks) is None
    assert pool.status().pins == 0
    run(pool.evict(2))  # nothing kept held: both resident blocks can go to disk too
    assert pool.contains(NS, ks) == [Tier.DISK] * 3
    ticket = run(pool.pin(NS, ks))  # the full pin restores them
    assert all(b is not None for b in ticket.blocks)
    assert np.array_equal(pool.read_pinned(ticket.id), data)
    with pytest.raises(PageShapeError, match="token key is 32 bytes"):
        pool.pin_resident(NS, [b"short"])


def test_resident_hashes_answer_a_lookup_for_blocks_in_memory_only(tmp_path: Path) -> None:
    """The node-local lookup: the block hash each block was sealed under while it is in this
    pool's memory (as the directory would report it), nothing for a block spilled to disk or
    never stored, and nothing across namespaces."""
    directory = LocalDirectory(1)
    pool = make(num_blocks=4, directory=directory, disk=tmp_path)
    ks, data = keys(3), payloads(3, 4, pool.block_bytes)
    stored = run(pool.store(NS, ks[:2], data[:2]))
    sealed = [b.block_hash for b in stored]
    assert pool.resident_hashes(NS, ks) == [*sealed, None]
    assert [r.block_hash for r in run(directory.lookup(NS, ks[:2]))] == sealed  # type: ignore[union-attr]
    assert pool.resident_hashes("tenant-b", ks[:2]) == [None, None]
    run(pool.evict(1))  # the oldest block goes to disk: the directory, not the pool, finds it
    assert pool.resident_hashes(NS, ks[:2]) == [None, sealed[1]]
    with pytest.raises(PageShapeError, match="token key is 32 bytes"):
        pool.resident_hashes(NS, [b"short"])


def test_install_verifies_every_page_against_the_owner() -> None:
    owner, reader = make("owner"), make("reader")
    ks = keys(2)
    data = payloads(2, 3, owner.block_bytes)
    run(owner.store(NS, ks, data))
    ticket = run(owner.pin(NS, ks))
    moved = owner.read_pinned(ticket.id).copy()
    moved[1, 100] ^= 0xFF  # corrupted in flight
    result = run(reader.install(NS, list(ticket.blocks), moved))
    assert result.installed[0] is not None and result.errors[0] is None
    assert result.installed[1] is None and result.errors[1] is not None
    assert result.errors[1].reason is FetchFailure.HASH_MISMATCH
    assert "does not match" in result.errors[1].detail
    assert reader.contains(NS, ks) == [Tier.MEMORY, None]
    got = run(reader.pin(NS, ks[:1]))
    assert np.array_equal(reader.read_pinned(got.id), data[:1])


def test_dedup_sixteen_agents_one_copy() -> None:
    pool = make(num_blocks=8)
    ks = keys(4)
    data = payloads(4, 4, pool.block_bytes)
    for _ in range(16):
        run(pool.store(NS, ks, data))
    s = pool.status()
    assert s.blocks_in_memory == 4 and s.blocks_free == 4
    assert s.dedup_hits == 15 * 4 * LAYOUT.num_layers


def test_eviction_drops_durably_replicated_blocks_first_and_spills_last_copies(
    tmp_path: Path,
) -> None:
    d = LocalDirectory(2)
    a = make("a", num_blocks=4, directory=d, disk=tmp_path / "a")
    b = make("b", num_blocks=4, directory=d, disk=tmp_path / "b")
    ks = keys(4)
    data = payloads(4, 5, a.block_bytes)
    run(a.store(NS, ks, data))
    run(b.store(NS, ks[1:], data[1:]))  # blocks 1-3 have a replica in b's memory
    run(b.evict(1))  # b's oldest (block 1) now has a durable copy: on b's disk
    report = run(a.evict(3))
    # Block 1 (durable elsewhere) is dropped; blocks 2 and 3 are preferred (another pool holds
    # them) but only in memory there, so they are spilled, never just dropped.
    assert {r.token_key for r in report.dropped} == {ks[1]}
    assert {r.token_key for r in report.spilled} == set(ks[2:])
    assert report.lost == ()
    assert a.contains(NS, ks) == [Tier.MEMORY, None, Tier.DISK, Tier.DISK]
    found = run(d.lookup(NS, ks))
    assert {(r.pool, r.tier) for r in found[1].replicas} == {("b", Tier.DISK)}
    assert {(r.pool, r.tier) for r in found[2].replicas} == {("a", Tier.DISK), ("b", Tier.MEMORY)}
    run(a.evict(1))
    assert [(r.pool, r.tier) for r in run(d.lookup(NS, ks[:1]))[0].replicas] == [("a", Tier.DISK)]
    # A pin brings the disk copy back, byte-exact.
    ticket = run(a.pin(NS, ks[:1]))
    assert np.array_equal(a.read_pinned(ticket.id), data[:1])
    assert a.status().restores == 1


def test_without_disk_the_last_copy_is_counted_lost() -> None:
    pool = make(num_blocks=2)
    run(pool.store(NS, keys(2), payloads(2, 6, pool.block_bytes)))
    report = run(pool.evict(1))
    assert len(report.lost) == 1 and pool.status().lost_blocks == 1


def test_restart_reopens_disk_and_reannounces(tmp_path: Path) -> None:
    d = LocalDirectory(1)
    first = make("a", num_blocks=2, directory=d, disk=tmp_path)
    ks = keys(2)
    data = payloads(2, 7, first.block_bytes)
    run(first.store(NS, ks, data))
    run(first.evict(2))
    run(first.close())
    d2 = LocalDirectory(1)
    again = make("a", num_blocks=2, directory=d2, disk=tmp_path)
    assert run(again.reopen_disk()) == 2
    assert [r.replicas[0].tier for r in run(d2.lookup(NS, ks)) if r] == [Tier.DISK, Tier.DISK]
    ticket = run(again.pin(NS, ks))
    assert np.array_equal(again.read_pinned(ticket.id), data)
    run(again.close())


def test_concurrent_reserves_evict_enough_for_both(tmp_path: Path) -> None:
    """Eviction awaits the directory, so two reservations interleave; both must still get
    their slots (from stored blocks, spilled to disk) while nothing is referenced."""
    pool = make(num_blocks=4, directory=LocalDirectory(2), disk=tmp_path)
    run(pool.store(NS, keys(4), payloads(4, 8, pool.block_bytes)))

    async def both() -> list[int]:
        a, b = await asyncio.gather(pool.reserve(2), pool.reserve(2))
        return [a.num_blocks, b.num_blocks]

    assert run(both()) == [2, 2]
    assert pool.status().blocks_free == 0 and pool.status().blocks_on_disk == 4


def test_a_touched_hit_is_evicted_after_older_blocks() -> None:
    pool = make(num_blocks=4)
    ks = keys(3)
    run(pool.store(NS, ks, payloads(3, 9, pool.block_bytes)))
    assert pool.contains(NS, ks[:1], touch=True) == [Tier.MEMORY]  # the oldest is used again
    report = run(pool.evict(1))
    assert [r.token_key for r in report.lost] == [ks[1]]
    assert pool.contains(NS, ks) == [Tier.MEMORY, None, Tier.MEMORY]


def test_a_read_makes_a_block_the_youngest_and_a_held_block_is_no_candidate() -> None:
    """One eviction order, the page LRU: pinning takes a block off it, unpinning puts it back
    at the young end; eviction only ever weighs unreferenced blocks."""
    pool = make(num_blocks=4)
    ks = keys(3)
    run(pool.store(NS, ks, payloads(3, 5, pool.block_bytes)))
    assert pool.groups.oldest(8) == [(NS, k) for k in ks]
    ticket = run(pool.pin(NS, ks[:1]))
    assert pool.groups.oldest(8) == [(NS, k) for k in ks[1:]]
    pool.unpin(ticket.id)
    assert pool.groups.oldest(8) == [(NS, k) for k in (*ks[1:], ks[0])]
    report = run(pool.evict(2))
    assert [r.token_key for r in report.lost] == ks[1:]
    assert pool.contains(NS, ks) == [Tier.MEMORY, None, None]


def test_check_blocks_drops_what_rotted_in_memory_and_nothing_else() -> None:
    from tessera_ray.actors.messages import BlockCheck

    d = LocalDirectory(2)
    pool = make(directory=d)
    ks, data = keys(3), payloads(3, 5, pool.block_bytes)
    run(pool.store(NS, ks, data))
    missing = keys(1, start=50)[0]
    rot(pool, ks[1])

    ticket = run(pool.pin(NS, [ks[1]]))  # a reader holds the rotten block: it cannot leave yet
    checks = run(pool.check_blocks(NS, [*ks, missing]))
    assert checks == [BlockCheck.INTACT, BlockCheck.IN_USE, BlockCheck.INTACT, BlockCheck.ABSENT]
    assert pool.contains(NS, [ks[1]]) == [Tier.MEMORY]
    pool.unpin(ticket.id)

    assert run(pool.check_blocks(NS, [ks[1]])) == [BlockCheck.DROPPED]
    assert pool.contains(NS, ks) == [Tier.MEMORY, None, Tier.MEMORY]
    assert run(d.lookup(NS, [ks[1]])) == [None]  # the directory forgot the replica
    assert pool.status().rotten_blocks == 1
    read = run(pool.read_blocks(NS, ks))
    assert read[1] is None
    assert all(np.array_equal(r.payload, w) for r, w in zip(read[::2], data[::2], strict=True) if r)
    # The next store of the key installs the good bytes afresh.
    run(pool.store(NS, [ks[1]], data[1:2]))
    again = run(pool.read_blocks(NS, [ks[1]]))[0]
    assert again is not None and np.array_equal(again.payload, data[1])
    assert run(pool.check_blocks(NS, ks)) == [BlockCheck.INTACT] * 3
    for p in pool.pools:
        p.check_consistency()
