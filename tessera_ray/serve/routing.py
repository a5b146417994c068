"""Which engine replica should serve a request: the tier-aware routing choice, in plain Python
(no Ray, no Serve), so that the rule is tested on its own and a Serve request router only feeds
it facts.

The facts: per replica, the pool on its node (where its engine's tier reads land) and its queue
length; per request, the directory's answer for the request's leading tier blocks (one batched
lookup). A replica whose pool holds a longer leading run of those blocks computes fewer tokens:
the run is loaded from local memory, the rest is fetched from another pool or computed.

The rule:

- Only replicas whose queue is at most ``max_queue_gap`` longer than the shortest queue are
  candidates, so one hot prefix cannot pin every request on the replica that holds it: once its
  queue is deeper than the bound the next request goes elsewhere, loads the prefix there through
  the tier, and from then on both replicas hold it.
- Among candidates, the longest run of leading blocks in the replica's own pool wins; ties go to
  the shorter queue, then to a random pick (seeded by the caller).
- When the tier did not answer (down, or slower than the router's bound), the choice is
  power-of-two: two random replicas, the shorter queue.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tessera_ray.actors.directory import LookupResult, Tier

__all__ = ["ReplicaState", "RouteReason", "RouteChoice", "leading_blocks_by_pool", "choose_replica"]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the router knows of one replica when a request arrives."""

    replica_id: str
    pool: str | None
    """The tier pool on the replica's node; ``None``: the node has no pool."""
    queue_len: int


class RouteReason(StrEnum):
    TIER = "tier"
    """The chosen replica's pool holds the longest leading run of the request's blocks."""
    BALANCED = "balanced"
    """No candidate's pool holds any leading block: the shortest queue won."""
    FALLBACK = "fallback"
    """The tier did not answer: power-of-two choices."""


@dataclass(frozen=True, slots=True)
class RouteChoice:
    replica_id: str
    local_blocks: int
    """Leading blocks of the request held in the chosen replica's pool (0 on a fallback)."""
    reason: RouteReason


def leading_blocks_by_pool(results: Sequence[LookupResult | None]) -> dict[str, int]:
    """Per pool, how many of the request's leading blocks it holds in memory: a run, ended by
    the first block the pool lacks (a block after a gap cannot be used, keys are chained)."""
    held: dict[str, int] = {}
    alive: set[str] | None = None  # pools whose run has not ended yet
    for i, result in enumerate(results):
        here = (
            {r.pool for r in result.replicas if r.tier == Tier.MEMORY}
            if result is not None
            else set()
        )
        alive = here if alive is None else alive & here
        if not alive:
            break
        for pool in alive:
            held[pool] = i + 1
    return held


def choose_replica(
    replicas: Sequence[ReplicaState],
    held_by_pool: Mapping[str, int] | None,
    *,
    max_queue_gap: int,
    rng: random.Random,
) -> RouteChoice:
    """The replica for one request (see the module docstring); ``held_by_pool`` is
    :func:`leading_blocks_by_pool` of the directory's answer, ``None`` when it did not answer."""
    if not replicas:
        raise ValueError("no replica to route to")
    if max_queue_gap < 0:
        raise ValueError(f"max_queue_gap must be >= 0, got {max_queue_gap}")
    if held_by_pool is None:
        pair = rng.sample(list(replicas), min(2, len(replicas)))
        pick = min(pair, key=lambda r: r.queue_len)
        return RouteChoice(pick.replica_id, 0, RouteReason.FALLBACK)
    shortest = min(r.queue_len for r in replicas)
    candidates = [r for r in replicas if r.queue_len <= shortest + max_queue_gap]

    def held(r: ReplicaState) -> int:
        return held_by_pool.get(r.pool, 0) if r.pool is not None else 0

    order = list(candidates)
    rng.shuffle(order)  # random among equals; max() keeps the first of equal keys
    best = max(order, key=lambda r: (held(r), -r.queue_len))
    blocks = held(best)
    return RouteChoice(
        best.replica_id, blocks, RouteReason.TIER if blocks else RouteReason.BALANCED
    )
