"""DirectoryShard: namespaced token keys, replicas, purges, rebuilds; all without Ray."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tessera_ray.actors.directory import (
    DirectoryShard,
    LookupAnswer,
    LookupResult,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.actors.tenancy import MAX_BATCH_KEYS
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import BadRequestError, DirectoryError


def key(i: int) -> TokenKey:
    return TokenKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


def reg(ns: str, i: int, block: int, pool: str = "p0", tier: Tier = Tier.MEMORY) -> Registration:
    return Registration(ns, key(i), BlockHash(block), Replica(pool, tier, slot=i, generation=0))


def test_register_and_lookup_batched() -> None:
    d = DirectoryShard()
    assert d.register([reg("a", i, 1000 + i) for i in range(10)]) == 10
    results = d.lookup("a", [key(i) for i in range(12)])
    assert [r.block_hash if r else None for r in results] == [1000 + i for i in range(10)] + [
        None,
        None,
    ]
    hit = results[3]
    assert hit is not None and hit.replicas == (Replica("p0", Tier.MEMORY, 3, 0),)
    s = d.stats()
    assert (s.lookups, s.hits, s.misses, s.token_keys, s.blocks) == (12, 10, 2, 10, 10)


def test_namespaces_are_isolated_even_with_the_same_key() -> None:
    d = DirectoryShard()
    d.register([reg("tenant-a", 1, 111)])
    assert d.lookup("tenant-b", [key(1)]) == [None]
    d.register([reg("tenant-b", 1, 222)])
    (a,) = d.lookup("tenant-a", [key(1)])
    (b,) = d.lookup("tenant-b", [key(1)])
    assert a is not None and b is not None and (a.block_hash, b.block_hash) == (111, 222)


def test_replicas_accumulate_per_pool_and_tier() -> None:
    d = DirectoryShard()
    d.register([reg("a", 1, 7, pool="p0"), reg("a", 1, 7, pool="p1")])
    d.register([reg("a", 1, 7, pool="p1", tier=Tier.DISK)])
    (r,) = d.lookup("a", [key(1)])
    assert r is not None and {(x.pool, x.tier) for x in r.replicas} == {
        ("p0", Tier.MEMORY),
        ("p1", Tier.MEMORY),
        ("p1", Tier.DISK),
    }
    # Re-registering the same pool and tier replaces the slot instead of adding a replica.
    assert (
        d.register([Registration("a", key(1), BlockHash(7), Replica("p0", Tier.MEMORY, 99, 3))])
        == 0
    )
    (r,) = d.lookup("a", [key(1)])
    assert r is not None and Replica("p0", Tier.MEMORY, 99, 3) in r.replicas


def test_a_live_key_is_never_redirected() -> None:
    d = DirectoryShard()
    d.register([reg("a", 1, 7)])
    d.register([reg("a", 1, 8, pool="p1")])
    (r,) = d.lookup("a", [key(1)])
    assert r is not None and r.block_hash == 7


def test_drop_and_purge() -> None:
    d = DirectoryShard()
    d.register([reg("a", i, i, pool=f"p{i % 2}") for i in range(6)])
    d.register([reg("a", 0, 0, pool="p1")])
    assert d.drop_replicas("p0", [("a", BlockHash(0))]) == 1
    (r,) = d.lookup("a", [key(0)])
    assert r is not None and [x.pool for x in r.replicas] == ["p1"]
    assert d.purge_pool("p1") == 4  # blocks 0, 1, 3, 5
    assert [x is not None for x in d.lookup("a", [key(i) for i in range(6)])] == [
        False,
        False,
        True,
        False,
        True,
        False,
    ]
    # Keys of blocks with no replica left are forgotten on lookup.
    assert d.stats().token_keys == 2
    assert d.purge_pool("never-seen") == 0


def test_a_block_registered_again_revives_only_the_keys_it_is_registered_under() -> None:
    """Keys 1 and 2 name the same bytes (block 7) on p0; the block loses its last replica and
    p0 stores it again under key 1 only. Key 2 stays gone: p0 holds nothing under it, and a
    lookup that listed it there would send a reader to a miss. A dead key named again, under
    any block, is live again."""
    d = DirectoryShard()
    d.register([reg("a", 1, 7), reg("a", 2, 7)])
    assert d.drop_replicas("p0", [("a", BlockHash(7))]) == 1
    d.register([reg("a", 1, 7)])
    one, two = d.lookup("a", [key(1), key(2)])
    assert one is not None and one.block_hash == 7 and two is None
    d.drop_replicas("p0", [("a", BlockHash(7))])
    d.register([reg("a", 2, 9)])  # dead, so not held to its first block
    (two,) = d.lookup("a", [key(2)])
    assert two is not None and two.block_hash == 9
    assert d.lookup("a", [key(1)]) == [None]


def test_rebuild_takes_only_this_shards_keys() -> None:
    shards = [DirectoryShard(i, 4) for i in range(4)]
    inventory = [reg("a", i, i) for i in range(64)]
    assert sum(s.rebuild_from(inventory) for s in shards) == 64
    for i in range(64):
        owner = shards[shard_of(key(i), 4)]
        (r,) = owner.lookup("a", [key(i)])
        assert r is not None and r.block_hash == i


def test_bad_input_changes_nothing() -> None:
    d = DirectoryShard(0, 2)
    mine = next(i for i in range(100) if shard_of(key(i), 2) == 0)
    other = next(i for i in range(100) if shard_of(key(i), 2) == 1)
    with pytest.raises(DirectoryError, match="belongs to shard 1"):
        d.register([reg("a", mine, 1), reg("a", other, 2)])
    assert d.stats().token_keys == 0
    with pytest.raises(DirectoryError, match="32 bytes"):
        d.lookup("a", [TokenKey(b"short")])
    with pytest.raises(DirectoryError, match="namespace must be a non-empty str"):
        d.register(
            [
                reg("a", mine, 1),
                Registration("", key(mine), BlockHash(1), Replica("p", Tier.MEMORY, 0, 0)),
            ]
        )
    with pytest.raises(DirectoryError, match="bad replica"):
        d.register(
            [
                reg("a", mine, 1),
                Registration("a", key(mine), BlockHash(1), Replica("", Tier.MEMORY, 0, 0)),
            ]
        )
    assert d.stats().token_keys == 0 and d.stats().replicas == 0
    with pytest.raises(DirectoryError, match="out of range"):
        DirectoryShard(2, 2)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (Registration("a", key(0), BlockHash(-1), Replica("p", Tier.MEMORY, 0, 0)), "block hash"),
        (
            Registration("a", key(0), BlockHash(2**128), Replica("p", Tier.MEMORY, 0, 0)),
            "block hash",
        ),
        (Registration("a", key(0), BlockHash(1), Replica("p", Tier.MEMORY, 2**32, 0)), "below 2"),
        (Registration("a", key(0), BlockHash(1), Replica("p", Tier.MEMORY, 0, 2**63)), "64 bits"),
        (Registration("a", key(0), BlockHash(1), Replica("p", 2, 0, 0)), "tier"),  # type: ignore[arg-type]
    ],
)
def test_values_the_tables_cannot_hold_are_refused_whole(bad: Registration, match: str) -> None:
    """Block hashes are 128-bit, slots 32-bit, generations 64-bit, tiers one of ``Tier``:
    anything else is refused, and nothing of its batch is applied."""
    d = DirectoryShard()
    with pytest.raises(DirectoryError, match=match):
        d.register([reg("a", 1, 7), bad])
    s = d.stats()
    assert (s.token_keys, s.blocks, s.replicas, s.pools) == (0, 0, 0, 0)


def test_the_widest_values_round_trip() -> None:
    d = DirectoryShard()
    widest = Replica("p", Tier.DISK, 2**32 - 1, -(2**63))
    d.register([Registration("a", key(1), BlockHash(2**128 - 1), widest)])
    (r,) = d.lookup("a", [key(1)])
    assert r == LookupResult(key(1), BlockHash(2**128 - 1), (widest,))
    assert type(r.block_hash) is int and type(r.replicas[0].tier) is Tier


def test_numpy_ints_are_taken_as_ints() -> None:
    d = DirectoryShard()
    rep = Replica("p", Tier.MEMORY, np.int64(3), np.uint32(4))  # type: ignore[arg-type]
    assert d.register([Registration("a", key(1), BlockHash(np.uint64(9)), rep)]) == 1  # type: ignore[arg-type]
    (r,) = d.lookup("a", [key(1)])
    assert r is not None and r.replicas == (Replica("p", Tier.MEMORY, 3, 4),)


def test_a_rebuild_is_not_held_to_the_request_batch_limit() -> None:
    """A pool's inventory can hold more blocks than one request may carry."""
    d = DirectoryShard()
    n = MAX_BATCH_KEYS + 10
    inventory = [reg("a", i, i) for i in range(n)]
    with pytest.raises(BadRequestError):
        d.register(inventory)
    assert d.rebuild_from(inventory) == n and d.stats().blocks == n


def test_the_answer_is_a_sequence_equal_to_its_list() -> None:
    d = DirectoryShard()
    d.register([reg("a", 1, 7)])
    answer = d.lookup("a", [key(1), key(2)])
    assert isinstance(answer, LookupAnswer) and len(answer) == 2
    assert answer == [answer[0], None] and [answer[0], None] == answer
    assert answer[1:] == [None] and list(reversed(answer)) == [None, answer[0]]
    assert answer != [None, None] and answer != (answer[0], None)
