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
- Among candidates, the longest run of leading blocks in the replica's own pool wins; ties
  (the replicas of one node share its pool) go to the replica the longest run was recently
  routed to, whose own engine cache holds it or soon will, then to the shorter queue, then to a
  random pick (seeded by the caller).
- A queue is whatever the caller measures load in, ``max_queue_gap`` in the same unit: requests
  waiting or running, or (better, :class:`OutstandingTokens`) the prompt tokens of the requests
  routed to the replica and not finished, which weighs a 100K-token prompt as the seconds of
  prefill it holds a replica for.
- When the tier did not answer (down, or slower than the router's bound), the choice is a
  fallback: on the blocks the router itself recently routed (below) where they name a pool,
  else power-of-two (two random replicas, the shorter queue).

The directory only knows what is stored, and a prompt's blocks are stored after its prefill.
Requests that share a prefix often arrive together, before the first of them has stored
anything; the router would then see no holder and spread them, and every replica would compute
the prefix. So the router also remembers, for a short while, which pool it sent each block to
(:class:`RoutedBlocks`): a block routed to a pool counts as held there until the memory
expires. It only steers routing; what is loaded is always what the directory and the pool say.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tessera_ray.actors.directory import LookupResult, Tier
from tessera_ray.core.results import TokenKey

__all__ = [
    "ReplicaState",
    "RouteReason",
    "RouteChoice",
    "RoutedBlocks",
    "OutstandingTokens",
    "BALANCE_ON",
    "leading_blocks_by_pool",
    "choose_replica",
]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the router knows of one replica when a request arrives."""

    replica_id: str
    pool: str | None
    """The tier pool on the replica's node; ``None``: the node has no pool."""
    queue_len: int
    """The replica's load, in the unit of ``max_queue_gap`` (requests, or outstanding tokens)."""


class RouteReason(StrEnum):
    TIER = "tier"
    """The chosen replica's pool holds the longest leading run of the request's blocks."""
    ROUTED = "routed"
    """As ``TIER``, but part of the run was only routed to the pool, not yet stored there as
    far as the directory knows (:class:`RoutedBlocks`)."""
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


class RoutedBlocks:
    """Which pool each recently routed block was sent to, for ``ttl_s`` seconds, at most
    ``max_blocks`` blocks (the oldest forgotten first). Not thread-safe: one per router, used
    from its event loop."""

    def __init__(
        self,
        ttl_s: float,
        max_blocks: int = 1 << 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or max_blocks < 1:
            raise ValueError(
                f"RoutedBlocks: ttl_s >= 0 and max_blocks >= 1, got {ttl_s}, {max_blocks}"
            )
        self._ttl_s = ttl_s
        self._max = max_blocks
        self._clock = clock
        # key -> {pool: expiry}; insertion order is expiry order (every note moves to the end).
        self._routed: OrderedDict[TokenKey, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routed)

    def note(self, keys: Sequence[TokenKey], pool: str) -> None:
        """``keys`` were routed to ``pool``'s replica just now."""
        if self._ttl_s == 0:
            return
        expiry = self._clock() + self._ttl_s
        for key in keys:
            pools = self._routed.pop(key, {})
            pools[pool] = expiry
            self._routed[key] = pools
        self._expire()

    def pools(self, keys: Sequence[TokenKey]) -> list[frozenset[str]]:
        """Per key, the pools it was routed to and whose memory has not expired."""
        self._expire()
        now = self._clock()
        return [
            frozenset(p for p, until in self._routed.get(k, {}).items() if until > now)
            for k in keys
        ]

    def _expire(self) -> None:
        now = self._clock()
        while self._routed:
            key, pools = next(iter(self._routed.items()))
            if len(self._routed) <= self._max and max(pools.values()) > now:
                break
            del self._routed[key]


BALANCE_ON = ("prompt_tokens", "requests")
"""What a router measures a replica's load in: :class:`OutstandingTokens`, or queue lengths."""


class OutstandingTokens:
    """Per replica, the prompt tokens of the requests routed to it and not finished: the load a
    router can count itself (it sees every request it routes and hears when each completes),
    where a queue length counts a 100-token prompt and a 100K-token one alike.

    A request that never reports completion (dropped before it was sent) is forgotten after
    ``ttl_s``, so the ledger cannot grow without bound. Not thread-safe: one per router.
    """

    def __init__(self, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"OutstandingTokens: ttl_s must be > 0, got {ttl_s}")
        self._ttl_s = ttl_s
        self._clock = clock
        # request id -> (replica id, tokens, expiry); insertion order is expiry order.
        self._requests: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._by_replica: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, replica_id: str, tokens: int) -> None:
        """``request_id`` with ``tokens`` prompt tokens was routed to ``replica_id``."""
        if tokens < 0:
            raise ValueError(f"OutstandingTokens: tokens must be >= 0, got {tokens}")
        self.done(request_id)
        self._requests[request_id] = (replica_id, tokens, self._clock() + self._ttl_s)
        self._by_replica[replica_id] = self._by_replica.get(replica_id, 0) + tokens
        self._expire()

    def moved(self, request_id: str, replica_id: str) -> None:
        """The request went to ``replica_id`` after all (Serve tries the next when the chosen
        replica is full)."""
        entry = self._requests.get(request_id)
        if entry is not None and entry[0] != replica_id:
            self._take(entry)
            self._requests[request_id] = (replica_id, entry[1], entry[2])
            self._by_replica[replica_id] = self._by_replica.get(replica_id, 0) + entry[1]

    def done(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._take(entry)

    def of(self, replica_id: str) -> int:
        self._expire()
        return self._by_replica.get(replica_id, 0)

    def _take(self, entry: tuple[str, int, float]) -> None:
        replica, tokens, _ = entry
        left = self._by_replica[replica] - tokens
        if left:
            self._by_replica[replica] = left
        else:
            del self._by_replica[replica]

    def _expire(self) -> None:
        now = self._clock()
        while self._requests:
            request_id, entry = next(iter(self._requests.items()))
            if entry[2] > now:
                break
            del self._requests[request_id]
            self._take(entry)


def leading_blocks_by_pool(
    results: Sequence[LookupResult | None],
    routed: Sequence[frozenset[str]] = (),
) -> dict[str, int]:
    """Per pool, how many of the request's leading blocks it holds in memory: a run, ended by
    the first block the pool lacks (a block after a gap cannot be used, keys are chained).
    ``routed``: per block, pools it was recently routed to (:meth:`RoutedBlocks.pools`), which
    count as holding it."""
    held: dict[str, int] = {}
    alive: set[str] | None = None  # pools whose run has not ended yet
    for i, result in enumerate(results):
        here = (
            {r.pool for r in result.replicas if r.tier == Tier.MEMORY}
            if result is not None
            else set()
        )
        if i < len(routed):
            here |= routed[i]
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
    stored_by_pool: Mapping[str, int] | None = None,
    answered: bool = True,
    routed_by_replica: Mapping[str, int] | None = None,
) -> RouteChoice:
    """The replica for one request (see the module docstring); ``held_by_pool`` is
    :func:`leading_blocks_by_pool` of the directory's answer (with the blocks routed recently),
    ``None`` when nothing is known; ``stored_by_pool`` the same without the routed blocks,
    to tell a ``ROUTED`` choice from a ``TIER`` one. ``answered`` False: the directory was
    silent and ``held_by_pool`` holds only the routed blocks; the choice is a ``FALLBACK``,
    made on them where they name a pool, else by power-of-two choices.
    ``routed_by_replica``: per replica id, the leading run recently routed to that replica
    (:func:`leading_blocks_by_pool` over a :class:`RoutedBlocks` keyed by replica), which breaks
    ties between replicas sharing a pool."""
    if not replicas:
        raise ValueError("no replica to route to")
    if max_queue_gap < 0:
        raise ValueError(f"max_queue_gap must be >= 0, got {max_queue_gap}")
    if held_by_pool is None or (not answered and not any(held_by_pool.values())):
        pair = rng.sample(list(replicas), min(2, len(replicas)))
        pick = min(pair, key=lambda r: r.queue_len)
        return RouteChoice(pick.replica_id, 0, RouteReason.FALLBACK)
    shortest = min(r.queue_len for r in replicas)
    candidates = [r for r in replicas if r.queue_len <= shortest + max_queue_gap]

    def held(r: ReplicaState) -> int:
        return held_by_pool.get(r.pool, 0) if r.pool is not None else 0

    own = routed_by_replica or {}
    order = list(candidates)
    rng.shuffle(order)  # random among equals; max() keeps the first of equal keys
    best = max(order, key=lambda r: (held(r), own.get(r.replica_id, 0), -r.queue_len))
    blocks = held(best)
    if not answered:
        return RouteChoice(best.replica_id, 0, RouteReason.FALLBACK)
    if not blocks:
        return RouteChoice(best.replica_id, 0, RouteReason.BALANCED)
    stored = blocks if stored_by_pool is None else stored_by_pool.get(best.pool or "", 0)
    reason = RouteReason.TIER if stored >= blocks else RouteReason.ROUTED
    return RouteChoice(best.replica_id, blocks, reason)
