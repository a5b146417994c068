"""The client's decisions without Ray (actors/_client_plan.py): which pool a fetch pulls each
block from, in what order, what an owner's answer changes, and which pool attends over which
blocks."""

from __future__ import annotations

import pytest

from tessera_ray.actors._client_plan import FetchPlan, assign_holders
from tessera_ray.actors.directory import LookupResult, Replica, Tier
from tessera_ray.actors.messages import NOT_HELD, BlockFailure, FetchFailure
from tessera_ray.core.results import BlockHash, TokenKey

INTO = "p-into"


def _key(i: int) -> TokenKey:
    return TokenKey(bytes([i]) * 32)


def _hit(i: int, *replicas: tuple[str, Tier]) -> LookupResult:
    return LookupResult(
        _key(i), BlockHash(i), tuple(Replica(pool, tier, 0, 0) for pool, tier in replicas)
    )


GONE = BlockFailure(FetchFailure.OWNER_UNAVAILABLE, "owner down")


def test_memory_replicas_first_then_our_own_disk_then_other_disks() -> None:
    results = [
        None,
        _hit(1, (INTO, Tier.MEMORY), ("a", Tier.MEMORY)),
        _hit(2, (INTO, Tier.DISK), ("a", Tier.DISK), ("b", Tier.MEMORY)),
    ]
    plan = FetchPlan.of_lookup(INTO, [_key(i) for i in range(3)], results)
    assert plan.missed == [_key(0)] and plan.local == [_key(1)]
    assert plan.pending == {_key(2): ["b", INTO, "a"]}
    assert plan.by_owner() == {"b": [_key(2)]}


def test_a_local_hit_the_pool_no_longer_holds_is_pulled_from_its_disk_first() -> None:
    keys = [_key(1), _key(2), _key(3)]
    results = [
        _hit(1, (INTO, Tier.MEMORY), ("a", Tier.MEMORY)),
        _hit(2, (INTO, Tier.MEMORY), ("a", Tier.MEMORY)),
        _hit(3, (INTO, Tier.MEMORY)),
    ]
    plan = FetchPlan.of_lookup(INTO, keys, results)
    plan.confirm_local([Tier.MEMORY, Tier.DISK, None])
    assert plan.local == [_key(1)]
    assert plan.pending == {_key(2): [INTO, "a"]}
    assert plan.missed == [_key(3)]  # gone from memory, and no other copy known


def test_each_answer_moves_a_key_to_its_next_owner_until_none_is_left() -> None:
    keys = [_key(1), _key(2)]
    results = [
        _hit(1, ("a", Tier.MEMORY), ("b", Tier.DISK)),
        _hit(2, ("a", Tier.MEMORY)),
    ]
    plan = FetchPlan.of_lookup(INTO, keys, results)
    assert plan.by_owner() == {"a": keys}
    answer = [GONE, GONE]
    assert FetchPlan.owner_lost(answer) and not FetchPlan.owner_lost([None, NOT_HELD])
    plan.settle(keys, answer)
    assert plan.by_owner() == {"b": [_key(1)]} and plan.failed == {_key(2): GONE}
    plan.settle([_key(1)], [None])
    assert not plan.pending
    result = plan.result()
    assert result.fetched == (_key(1),) and result.available == {_key(1)}
    assert result.failed == {_key(2): GONE}


def test_attention_spreads_blocks_over_their_holders_and_names_the_absent() -> None:
    results = [_hit(i, ("a", Tier.MEMORY), ("b", Tier.MEMORY), ("c", Tier.DISK)) for i in range(4)]
    assigned = assign_holders(results)
    assert sorted(assigned) == ["a", "b"] and sorted(i for v in assigned.values() for i in v) == [
        0,
        1,
        2,
        3,
    ]
    assert {len(v) for v in assigned.values()} == {2}
    with pytest.raises(LookupError, match=r"blocks \[1\]"):
        assign_holders([results[0], _hit(1, ("c", Tier.DISK))])
