"""A pool holding the same bytes under several keys, without Ray: in one layer group (V4's
resume record chunks end in the same zero padding) or in every group (the same block stored
under two keys). Evicting one key's block never takes another key's with it, and the pool's
and the directory's view of what is in memory stay exact.

Found by the V4 engine test over a tier smaller than its working set: evicting one record's
last chunk dropped the shared zero page's block with every record's last chunk named on it,
while the pool and the directory still listed those chunks, so loads failed and hits were lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.core import token_key
from tessera_ray.layout import ModelLayout, build_layout
from tessera_ray.layout.hf import config_from_hf
from tessera_ray.models.hf_tiny import TINY_V4_CONFIG
from tests.actors._pools import LAYOUT, NS, Clock, payloads, rot, run

V4 = build_layout(config_from_hf(dict(TINY_V4_CONFIG), name="tiny-v4"))


def _keys(layout: ModelLayout, n: int, start: int) -> list[bytes]:
    out, parent = [], None
    for i in range(start, start + n):
        parent = token_key(NS, layout.fingerprint, parent, [i] * 16)
        out.append(parent)
    return out


def _pool(
    layout: ModelLayout, num_blocks: int, directory: LocalDirectory, disk: Path | None = None
) -> PoolService:
    cfg = PoolServiceConfig(
        num_blocks=num_blocks, lease_s=10.0, disk_root=disk, shared_memory_dir=None
    )
    return PoolService("p", layout, cfg, directory=directory, clock=Clock())


def _consistent(pool: PoolService) -> None:
    for p in pool.pools:
        p.check_consistency()


def test_evicting_a_block_keeps_the_layer_group_page_it_shares_for_the_others() -> None:
    assert len(V4.groups) == 3
    d = LocalDirectory(2)
    pool = _pool(V4, 4, d)
    rows = payloads(3, 11, pool.block_bytes)
    rows[:, -V4.groups[-1].block_bytes :] = 0  # the last group's page: the same in all three
    ka, kb, kc = _keys(V4, 1, 0), _keys(V4, 1, 10), _keys(V4, 1, 20)
    for k, row in zip((ka, kb, kc), rows, strict=True):
        run(pool.store(NS, k, row[None]))
    assert pool.status().dedup_hits == 2
    report = run(pool.evict(1))  # the oldest, ka
    assert [r.token_key for r in report.lost] == ka
    assert pool.status().blocks_in_memory == 2
    for k, row in ((kb, rows[1]), (kc, rows[2])):
        assert pool.contains(NS, k) == [Tier.MEMORY]
        found = run(d.lookup(NS, k))[0]
        assert found is not None and [(r.pool, r.tier) for r in found.replicas] == [
            ("p", Tier.MEMORY)
        ]
        read = run(pool.read_blocks(NS, k))[0]
        assert read is not None and np.array_equal(read.payload, row)
    assert run(d.lookup(NS, ka)) == [None] and pool.contains(NS, ka) == [None]
    # The shared page leaves with its last block, not before.
    free = pool.status().blocks_free
    run(pool.evict(2))
    assert pool.status().blocks_in_memory == 0 and pool.status().blocks_free == free + 2
    assert run(d.lookup(NS, [*kb, *kc])) == [None, None]
    _consistent(pool)


def test_the_same_bytes_under_two_keys_leave_memory_together_and_both_reach_disk(
    tmp_path: Path,
) -> None:
    """The directory holds a pool's replicas by block hash: one key left in memory would keep
    the other listed there, so both go, each spilled under its own key and read back exact."""
    d = LocalDirectory(2)
    pool = _pool(LAYOUT, 4, d, disk=tmp_path)
    row = payloads(1, 12, pool.block_bytes)
    k1, k2, k3 = _keys(LAYOUT, 1, 0), _keys(LAYOUT, 1, 10), _keys(LAYOUT, 1, 20)
    run(pool.store(NS, k1, row))
    run(pool.store(NS, k2, row))
    run(pool.store(NS, k3, payloads(1, 13, pool.block_bytes)))
    assert pool.status().blocks_in_memory == 3
    report = run(pool.evict(1))
    assert {r.token_key for r in report.spilled} == {*k1, *k2} and not report.lost
    assert pool.contains(NS, [*k1, *k2, *k3]) == [Tier.DISK, Tier.DISK, Tier.MEMORY]
    for k in (k1, k2):
        found = run(d.lookup(NS, k))[0]
        assert found is not None and [r.tier for r in found.replicas] == [Tier.DISK]
    got = run(pool.read_blocks(NS, [*k1, *k2]))
    assert all(g is not None and np.array_equal(g.payload, row[0]) for g in got)
    _consistent(pool)


def test_a_rotten_block_under_two_keys_is_dropped_under_both() -> None:
    from tessera_ray.actors.messages import BlockCheck

    d = LocalDirectory(1)
    pool = _pool(LAYOUT, 4, d)
    row = payloads(1, 14, pool.block_bytes)
    k1, k2 = _keys(LAYOUT, 1, 0), _keys(LAYOUT, 1, 10)
    run(pool.store(NS, k1, row))
    run(pool.store(NS, k2, row))
    rot(pool, k1[0])
    assert run(pool.check_blocks(NS, k1)) == [BlockCheck.DROPPED]
    assert pool.contains(NS, [*k1, *k2]) == [None, None]
    assert run(d.lookup(NS, [*k1, *k2])) == [None, None]
    assert pool.status().rotten_blocks == 2
    _consistent(pool)


def test_eviction_counts_the_room_it_frees_not_the_keys_that_leave() -> None:
    """Three keys naming one block free one block's room when they leave: evicting for two
    blocks goes on to the next block."""
    d = LocalDirectory(1)
    pool = _pool(LAYOUT, 4, d)
    same = payloads(1, 15, pool.block_bytes)
    shared = [k for i in range(3) for k in _keys(LAYOUT, 1, 10 * i)]
    for k in shared:
        run(pool.store(NS, [k], same))
    others = _keys(LAYOUT, 3, 100)
    run(pool.store(NS, others, payloads(3, 16, pool.block_bytes)))
    assert pool.status().blocks_free == 0
    report = run(pool.evict(2))
    assert {r.token_key for r in report.lost} == {*shared, others[0]}
    assert pool.status().blocks_free == 2
    assert pool.contains(NS, [*shared, *others]) == [None] * 4 + [Tier.MEMORY] * 2
    _consistent(pool)


def test_a_resident_pin_names_every_groups_pages_and_their_seals() -> None:
    """pin_resident reads each page's slot and content hash off the block's records: they
    must be what the held handles resolve to, in every layer group, a shared page included,
    and its references must be exactly the ticket's (released in full by the unpin)."""
    pool = _pool(V4, 4, LocalDirectory(2))
    rows = payloads(3, 5, pool.block_bytes)
    rows[:, -V4.groups[-1].block_bytes :] = 0  # the last group's page shared by all three
    ks = [*_keys(V4, 1, 0), *_keys(V4, 1, 10), *_keys(V4, 1, 20)]
    for k, row in zip(ks, rows, strict=True):
        run(pool.store(NS, [k], row[None]))
    missing = _keys(V4, 1, 30)
    ticket = pool.pin_resident(NS, [*ks, *missing])
    assert ticket is not None and ticket.blocks[3] is None
    lease = pool.leases.pins[ticket.id]
    assert len(lease.handles) == 3
    for key, block, held in zip(ks, ticket.blocks, lease.handles, strict=False):
        assert block == pool.groups.pinned(NS, key, held)
        assert len(block.slots) == len(V4.groups) == len(block.content_hashes)
    assert len({b.slots[-1] for b in ticket.blocks[:3]}) == 1  # one shared page
    assert np.array_equal(pool.read_pinned(ticket.id), rows)
    free = pool.status().blocks_free
    assert pool.unpin(ticket.id)
    run(pool.evict(3))  # nothing is held any more: every block can leave
    assert pool.status().blocks_in_memory == 0 and pool.status().blocks_free == free + 3
    _consistent(pool)
