"""The routers the fleet simulator compares, each deciding from what it would know in a real
fleet (queue lengths, its own records, the directory), never from the simulator's hidden
state.

- ``round_robin``, ``power_of_two``: no cache knowledge.
- ``ray_prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter``, driven through Ray's own
  ``PrefixTree`` (``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_tree.py``) with
  the router's rule from ``prefix_aware_router.py`` (ray 2.60.0) at its defaults: the load is
  never "imbalanced" (``imbalanced_threshold`` is infinite), a match rate below 0.1 sends the
  request to the replicas with the fewest characters in the tree, otherwise to the replicas
  with the longest match; Serve then takes the shortest queue among them; no tree eviction
  (``do_eviction`` is off). A prompt's text is one character per trace block, so a match is
  counted in blocks as Ray counts characters.
- ``overlap_load``: Dynamo's KV router cost as its router design page documents it
  (docs.nvidia.com/dynamo, "Router Design"): per worker, ``overlap_weight x`` the blocks it
  would prefill (the request's blocks past the leading run already in that worker's cache,
  known from KV events) ``+`` its active blocks (blocks of requests routed there and not
  done, plus this one's); the lowest cost wins (temperature 0).
- ``tessera``: the project's :func:`choose_replica` over node pools as its Serve router calls
  it at its defaults: the directory's answer and the routed-block memory (30 s) per pool and
  per replica, load in the prompt tokens of each replica's unfinished requests as the router
  counts them, ``max_token_gap`` 16384; ``tessera_local``: the same with no tier, each replica
  its own "pool"; ``tessera_requests``: with the tier, load in request counts (Serve's queue
  lengths) and ``max_queue_gap`` 2, the router's ``balance_on="requests"``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from _trace_input import TraceRequest
from _trace_sim import Fleet
from _trace_sim import Replica as SimReplica

from tessera_ray.core.results import TokenKey
from tessera_ray.serve.routing import (
    OutstandingTokens,
    ReplicaState,
    RoutedBlocks,
    choose_replica,
    leading_blocks_by_pool,
)

__all__ = [
    "RoundRobin",
    "PowerOfTwo",
    "RayPrefixAffinity",
    "OverlapMinusLoad",
    "TesseraRouter",
    "prompt_text",
]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int:
        i = self._next % len(fleet.replicas)
        self._next += 1
        return i


def _two_choices(fleet: Fleet, rng: random.Random, among: Sequence[int] | None = None) -> int:
    pool = range(len(fleet.replicas)) if among is None else among
    pair = rng.sample(list(pool), min(2, len(pool)))
    return min(pair, key=lambda i: fleet.replicas[i].queue_len)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int:
        return _two_choices(fleet, self._rng)


_TEXT_BASE = 0xE000  # first code point past the surrogates: every id maps to a valid char


def prompt_text(req: TraceRequest) -> str:
    """One character per trace block of the prompt (the last one may be partial)."""
    return "".join(chr(_TEXT_BASE + h) for h in req.hash_ids)


class RayPrefixAffinity:
    name = "ray_prefix"
    match_rate_threshold = 0.1  # PrefixCacheAffinityRouter.initialize_state's default

    def __init__(self, seed: int, num_replicas: int) -> None:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self._rng = random.Random(seed)
        self._tree = PrefixTree()
        self._ids = [f"replica-{i}" for i in range(num_replicas)]
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._tree.add_tenants(self._ids, 0.0)

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int:
        text = prompt_text(req)
        matched, tenants = self._tree.prefix_match(text, self._ids)
        if len(matched) / len(text) < self.match_rate_threshold:
            tenants = self._tree.get_smallest_tenants()
        if tenants:
            among = [self._index[t] for t in tenants]
            self._rng.shuffle(among)
            pick = min(among, key=lambda i: fleet.replicas[i].queue_len)
        else:
            pick = _two_choices(fleet, self._rng)
        self._tree.insert(text, self._ids[pick], fleet.now)
        return pick


class OverlapMinusLoad:
    name = "overlap_load"

    def __init__(self, seed: int, overlap_weight: float = 1.0) -> None:
        self._rng = random.Random(seed)
        self._w = overlap_weight

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int:
        # Each worker's leading run of cached blocks, by the rule the tier's router uses.
        held = [frozenset(str(i) for i in fleet.holders.get(k, ())) for k in keys]
        runs = leading_blocks_by_pool([None] * len(keys), held)
        overlap = {int(i): n for i, n in runs.items()}
        blocks = fleet.blocks_of(req)
        prompt = -(-req.input_length // req.block_tokens)
        best, best_cost = [], float("inf")
        for rep in fleet.replicas:
            cost = self._w * (prompt - overlap.get(rep.index, 0)) + rep.active_blocks + blocks
            if cost < best_cost:
                best, best_cost = [rep.index], cost
            elif cost == best_cost:
                best.append(rep.index)
        return self._rng.choice(best)


class TesseraRouter:
    """The project's routing choice; ``tier`` False: no directory, only the routed memory."""

    def __init__(
        self,
        seed: int,
        *,
        tier: bool,
        balance_on: str = "prompt_tokens",
        max_queue_gap: int = 2,
        max_token_gap: int = 16384,
        routed_memory_s: float = 30.0,
    ) -> None:
        self.name = "tessera" if tier else "tessera_local"
        self._rng = random.Random(seed)
        self._tier = tier
        self._by_tokens = balance_on == "prompt_tokens"
        self._gap = max_token_gap if self._by_tokens else max_queue_gap
        self._fleet: Fleet | None = None
        self._routed = RoutedBlocks(routed_memory_s, clock=self._clock)
        self._routed_replicas = RoutedBlocks(routed_memory_s, clock=self._clock)
        self._outstanding = OutstandingTokens(clock=self._clock)
        self.choices: dict[str, int] = {}

    def _clock(self) -> float:
        return self._fleet.now if self._fleet is not None else 0.0

    def _pool(self, fleet: Fleet, i: int) -> str:
        return fleet.replicas[i].pool if self._tier else f"replica-{i}"

    def _load(self, rep: SimReplica) -> int:
        return self._outstanding.of(str(rep.index)) if self._by_tokens else rep.queue_len

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int:
        self._fleet = fleet
        results = fleet.directory.lookup(keys) if self._tier and keys else [None] * len(keys)
        routed = self._routed.pools(keys)
        states = [
            ReplicaState(str(r.index), self._pool(fleet, r.index), self._load(r))
            for r in fleet.replicas
        ]
        choice = choose_replica(
            states,
            leading_blocks_by_pool(results, routed),
            max_queue_gap=self._gap,
            rng=self._rng,
            stored_by_pool=leading_blocks_by_pool(results),
            routed_by_replica=leading_blocks_by_pool(
                [None] * len(keys), self._routed_replicas.pools(keys)
            ),
        )
        self.choices[choice.reason.value] = self.choices.get(choice.reason.value, 0) + 1
        pick = int(choice.replica_id)
        self._routed.note(keys, self._pool(fleet, pick))
        self._routed_replicas.note(keys, choice.replica_id)
        self._outstanding.add(str(req.index), choice.replica_id, req.input_length)
        return pick

    def completed(self, req: TraceRequest, replica: int) -> None:
        self._outstanding.done(str(req.index))
