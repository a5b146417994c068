"""The eviction choice on its own: durable copies leave first and without a write, then blocks
another pool holds in memory, then the rest; least recently used first within each."""

from __future__ import annotations

from tessera_ray.actors._eviction import eviction_plan
from tessera_ray.actors.directory import Replica, Tier

MEM = [Replica("other", Tier.MEMORY, 0, 1)]
DISK = [Replica("other", Tier.DISK, 0, 0)]


def test_the_order_is_durable_then_replicated_then_the_rest_lru_within_each() -> None:
    lru = ["a", "b", "c", "d", "e", "f"]  # least recently used first
    elsewhere = {"b": MEM, "c": DISK, "e": MEM + DISK, "f": MEM}
    order, durable = eviction_plan(lru, {"d"}, elsewhere, has_disk=True)
    # Among durable blocks, one also held in memory elsewhere goes first.
    assert order == ["e", "c", "d", "b", "f", "a"]
    assert durable == {"c", "d", "e"}  # a copy in another pool's memory is not durable


def test_without_a_disk_a_copy_in_another_pools_memory_is_the_best_there_is() -> None:
    order, durable = eviction_plan(["a", "b", "c"], set(), {"c": MEM}, has_disk=False)
    assert order == ["c", "a", "b"] and durable == {"c"}


def test_nothing_known_keeps_the_lru_order_and_spills_everything() -> None:
    order, durable = eviction_plan(["x", "y"], set(), {}, has_disk=True)
    assert order == ["x", "y"] and durable == set()
