"""The tier-aware routing rule on its own: the replica whose pool holds the longest leading run
of a request's blocks wins, within a queue-length bound; power-of-two when the tier is silent."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tessera_ray.actors.directory import LookupResult, Replica, Tier
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.serve.routing import (
    OutstandingTokens,
    ReplicaState,
    RoutedBlocks,
    RouteReason,
    choose_replica,
    leading_blocks_by_pool,
)


def _result(i: int, *where: tuple[str, Tier]) -> LookupResult:
    replicas = tuple(Replica(pool, tier, i, 1) for pool, tier in where)
    return LookupResult(TokenKey(bytes([i]) * 32), BlockHash(i), replicas)


M, D = Tier.MEMORY, Tier.DISK


def test_a_pools_run_ends_at_the_first_block_it_lacks_and_disk_copies_do_not_count() -> None:
    answer = [
        _result(0, ("a", M), ("b", M)),
        _result(1, ("a", M), ("b", D)),
        _result(2, ("a", M), ("b", M)),  # b has it again, but after a gap: useless to b
        None,
        _result(4, ("a", M)),
    ]
    assert leading_blocks_by_pool(answer) == {"a": 3, "b": 1}
    assert leading_blocks_by_pool([None, _result(1, ("a", M))]) == {}
    assert leading_blocks_by_pool([]) == {}


def test_blocks_routed_to_a_pool_extend_its_run_until_they_expire() -> None:
    now = [100.0]
    routed = RoutedBlocks(ttl_s=5.0, clock=lambda: now[0])
    keys = [TokenKey(bytes([i]) * 32) for i in range(4)]
    routed.note(keys[:3], "b")
    answer = [_result(0, ("a", M)), _result(1, ("a", M)), None, None]
    assert leading_blocks_by_pool(answer) == {"a": 2}
    assert leading_blocks_by_pool(answer, routed.pools(keys)) == {"a": 2, "b": 3}
    now[0] += 3.0
    routed.note(keys[:1], "a")  # a second pool for block 0; block 0's memory renewed
    assert routed.pools(keys[:1]) == [frozenset({"a", "b"})]
    now[0] += 2.5  # b's blocks 1 and 2 expired; block 0 is remembered for a only
    assert routed.pools(keys) == [frozenset({"a"}), frozenset(), frozenset(), frozenset()]
    assert len(routed) == 1
    now[0] += 5.0
    assert routed.pools(keys) == [frozenset()] * 4 and len(routed) == 0


def test_routed_memory_is_bounded_and_can_be_off() -> None:
    keys = [TokenKey(bytes([i]) * 32) for i in range(10)]
    small = RoutedBlocks(ttl_s=60.0, max_blocks=4)
    small.note(keys, "p")
    assert len(small) == 4
    assert small.pools(keys) == [frozenset()] * 6 + [frozenset({"p"})] * 4  # oldest forgotten
    off = RoutedBlocks(ttl_s=0.0)
    off.note(keys, "p")
    assert len(off) == 0
    with pytest.raises(ValueError, match="ttl_s"):
        RoutedBlocks(ttl_s=-1.0)


def test_a_run_that_is_partly_only_routed_is_a_routed_choice() -> None:
    replicas = _replicas(0, 0)
    stored = {"p0": 2}
    held = {"p0": 2, "p1": 4}
    choice = choose_replica(
        replicas, held, max_queue_gap=1, rng=random.Random(0), stored_by_pool=stored
    )
    assert (choice.replica_id, choice.local_blocks, choice.reason) == ("r1", 4, RouteReason.ROUTED)
    choice = choose_replica(
        replicas, stored, max_queue_gap=1, rng=random.Random(0), stored_by_pool=stored
    )
    assert (choice.replica_id, choice.reason) == ("r0", RouteReason.TIER)


def _replicas(*queues: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", f"p{i}", q) for i, q in enumerate(queues)]


def test_the_replica_whose_pool_holds_the_longest_run_wins() -> None:
    choice = choose_replica(
        _replicas(0, 1, 0), {"p1": 5, "p2": 2}, max_queue_gap=2, rng=random.Random(0)
    )
    assert (choice.replica_id, choice.local_blocks, choice.reason) == ("r1", 5, RouteReason.TIER)


def test_a_hot_prefix_spreads_once_its_holders_queue_passes_the_bound() -> None:
    """r0 holds the prefix; its queue grows with every request routed to it, until it is more
    than the bound deeper than the others: then requests go to the shortest queue."""
    queues = [0, 0, 0]
    picks = []
    for _ in range(12):
        replicas = [ReplicaState(f"r{i}", f"p{i}", q) for i, q in enumerate(queues)]
        choice = choose_replica(replicas, {"p0": 8}, max_queue_gap=3, rng=random.Random(1))
        picks.append(choice.replica_id)
        queues[int(choice.replica_id[1:])] += 1
    assert picks[:4] == ["r0"] * 4  # within the bound the holder takes it
    assert {"r1", "r2"} <= set(picks[4:])
    assert max(queues) - min(queues) <= 4


def test_without_local_blocks_the_shortest_queue_wins_and_ties_are_random() -> None:
    choice = choose_replica(_replicas(3, 1, 2), {}, max_queue_gap=5, rng=random.Random(0))
    assert (choice.replica_id, choice.reason) == ("r1", RouteReason.BALANCED)
    seen = Counter(
        choose_replica(_replicas(0, 0), {}, max_queue_gap=0, rng=random.Random(s)).replica_id
        for s in range(40)
    )
    assert set(seen) == {"r0", "r1"}


def test_a_replica_on_a_node_without_a_pool_holds_nothing() -> None:
    replicas = [ReplicaState("r0", None, 0), ReplicaState("r1", "p1", 0)]
    choice = choose_replica(replicas, {"p1": 1}, max_queue_gap=0, rng=random.Random(0))
    assert choice.replica_id == "r1"


def test_a_silent_tier_falls_back_to_power_of_two_choices() -> None:
    """Two random replicas, the shorter queue: the longest queue never wins, and every other
    replica does sometimes."""
    replicas = _replicas(9, 1, 2, 3)
    picks = Counter(
        choose_replica(replicas, None, max_queue_gap=0, rng=random.Random(s)).replica_id
        for s in range(200)
    )
    assert "r0" not in picks and set(picks) == {"r1", "r2", "r3"}
    one = choose_replica(replicas[:1], None, max_queue_gap=0, rng=random.Random(0))
    assert (one.replica_id, one.local_blocks, one.reason) == ("r0", 0, RouteReason.FALLBACK)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no replica"):
        choose_replica([], {}, max_queue_gap=0, rng=random.Random(0))
    with pytest.raises(ValueError, match="max_queue_gap must be >= 0"):
        choose_replica(_replicas(0), {}, max_queue_gap=-1, rng=random.Random(0))


def test_a_silent_directory_still_follows_the_blocks_the_router_sent() -> None:
    replicas = _replicas(1, 0, 0)
    routed = {"p0": 3}
    for seed in range(20):
        choice = choose_replica(
            replicas, routed, max_queue_gap=2, rng=random.Random(seed), answered=False
        )
        assert (choice.replica_id, choice.local_blocks) == ("r0", 0)
        assert choice.reason is RouteReason.FALLBACK
    # Nothing routed either: power-of-two, never the longest queue of three.
    picks = {
        choose_replica(
            _replicas(9, 1, 2), {}, max_queue_gap=2, rng=random.Random(s), answered=False
        ).replica_id
        for s in range(40)
    }
    assert picks == {"r1", "r2"}


def test_replicas_sharing_a_pool_are_told_apart_by_where_the_run_was_routed() -> None:
    """r0 and r1 share pool A, which holds the run; r1's own cache was sent the first 3 blocks,
    so it wins over r0 although its queue is longer (within the bound) - and only a tie on
    the pool's run is broken this way."""
    states = [ReplicaState("r0", "A", 0), ReplicaState("r1", "A", 2), ReplicaState("r2", "B", 0)]
    for seed in range(20):
        rng = random.Random(seed)
        got = choose_replica(
            states, {"A": 4}, max_queue_gap=2, rng=rng, routed_by_replica={"r1": 3, "r0": 1}
        )
        assert got.replica_id == "r1" and got.local_blocks == 4
        # Pool B's longer run beats a replica's own memory of a shorter one.
        got = choose_replica(
            states, {"A": 4, "B": 5}, max_queue_gap=2, rng=rng, routed_by_replica={"r1": 4}
        )
        assert got.replica_id == "r2"


def test_outstanding_tokens_follow_requests_until_they_complete_or_expire() -> None:
    now = [0.0]
    ledger = OutstandingTokens(ttl_s=100.0, clock=lambda: now[0])
    ledger.add("a", "r0", 300)
    ledger.add("b", "r0", 200)
    ledger.add("c", "r1", 50)
    assert (ledger.of("r0"), ledger.of("r1"), ledger.of("r2")) == (500, 50, 0)
    ledger.moved("b", "r2")  # Serve sent it to the next replica after all
    assert (ledger.of("r0"), ledger.of("r2")) == (300, 200)
    ledger.done("a")
    ledger.done("a")  # a second report changes nothing
    ledger.done("never-seen")
    assert (ledger.of("r0"), len(ledger)) == (0, 2)
    ledger.add("c", "r1", 70)  # the same id again replaces, not adds
    assert ledger.of("r1") == 70
    now[0] = 100.0  # never completed: forgotten after the ttl
    assert (ledger.of("r1"), ledger.of("r2"), len(ledger)) == (0, 0, 0)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        ledger.add("d", "r0", -1)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        OutstandingTokens(ttl_s=0)
