"""A discrete-event simulation of an LLM fleet replaying a request trace: R engine replicas on
N nodes, each replica with its own prefix cache and queue, each node with a tier pool and disk.

What is simulated is time; the decisions are the project's own code: routers call the real
routing functions, tier hits are what the real directory shards answer, and pool residency
follows the pool's own eviction order (``_trace_tier.py``).

One replica's life of a request (times from the :class:`ModelProfile`):
1. arrival: the router picks a replica; the request waits in its FIFO queue;
2. start, when the replica's prefill engine is free, fewer than ``max_running`` requests
   decode there and its cache has room for the request's KV: the leading blocks in its own
   cache are hits; with the tier on, the following blocks the directory finds (this node's
   pool, another node's pool, any disk) are loaded, the rest computed. Loading and prefill
   hold the replica's prefill engine (loads are not overlapped with other work: pessimistic
   for the tier);
3. first token when the prefill ends (TTFT); the prompt's full blocks become hits in the
   replica's cache and are stored into its node's pool;
4. done after ``output_length`` decode steps, which run beside later prefills.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from _trace_input import TRACE_BLOCK_TOKENS, ModelProfile, TraceError, TraceRequest, check_fits
from _trace_tier import EngineCache, NodeTier, SimDirectory

from tessera_ray.actors.directory import Tier
from tessera_ray.core.hashing import token_key
from tessera_ray.core.results import TokenKey

__all__ = [
    "Router",
    "Replica",
    "Fleet",
    "RunStats",
    "request_keys",
    "bound_hits",
    "bound_tokens",
    "quantile",
]

_ARRIVE, _PREFILLED, _DONE = 0, 1, 2


def request_keys(requests: Sequence[TraceRequest]) -> list[list[TokenKey]]:
    """Per request, the chained token keys of its full blocks (one per trace block)."""
    memo: dict[tuple[TokenKey | None, int], TokenKey] = {}
    out = []
    for r in requests:
        keys: list[TokenKey] = []
        parent: TokenKey | None = None
        for hid in r.hash_ids[: r.full_blocks]:
            k = memo.get((parent, hid))
            if k is None:
                k = memo[(parent, hid)] = token_key("trace", "trace-blocks", parent, [hid])
            keys.append(k)
            parent = k
        out.append(keys)
    return out


def bound_hits(requests: Sequence[TraceRequest], keys: Sequence[Sequence[TokenKey]]) -> list[int]:
    """Per request, its leading full blocks seen in any earlier request: its hits with an
    unbounded cache shared by all, filled on arrival (the bound no router can beat)."""
    seen: set[TokenKey] = set()
    hits = []
    for ks in keys:
        hit = 0
        while hit < len(ks) and ks[hit] in seen:
            hit += 1
        hits.append(hit)
        seen.update(ks)
    return hits


def bound_tokens(requests: Sequence[TraceRequest], keys: Sequence[Sequence[TokenKey]]) -> int:
    """Prompt tokens computed with the unbounded cache of :func:`bound_hits`."""
    hits = bound_hits(requests, keys)
    return sum(r.input_length - h * r.block_tokens for r, h in zip(requests, hits, strict=True))


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``: the smallest value at least ``q`` of them reach."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


@dataclass
class Replica:
    index: int
    node: int
    pool: str
    cache: EngineCache
    waiting: deque[int] = field(default_factory=deque)
    running: int = 0
    busy: bool = False
    active_blocks: int = 0
    """Blocks of the requests routed here and not finished (a KV router's decode load)."""
    busy_s: float = 0.0

    @property
    def queue_len(self) -> int:
        return len(self.waiting) + self.running


class Router(Protocol):
    name: str

    def choose(self, fleet: Fleet, req: TraceRequest, keys: Sequence[TokenKey]) -> int: ...


@dataclass
class RunStats:
    router: str
    replicas: int
    prompt_tokens: int = 0
    computed_tokens: int = 0
    local_tokens: int = 0
    tier_node_tokens: int = 0
    tier_remote_tokens: int = 0
    disk_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    spilled_blocks: int = 0
    choices: dict[str, int] = field(default_factory=dict)

    def ttft(self, q: float) -> float:
        return quantile(self.ttft_s, q)

    @property
    def load_spread(self) -> float:
        """Busiest replica's prefill-engine time over the mean (1.0: even)."""
        mean = statistics.fmean(self.busy_s)
        return max(self.busy_s) / mean if mean else 1.0


class Fleet:
    """Replicas on nodes, their caches, the tier, and the event loop that replays a trace."""

    def __init__(
        self,
        profile: ModelProfile,
        num_replicas: int,
        *,
        tier: bool,
        num_shards: int = 4,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        self.profile = profile
        self.tier = tier
        self.now = 0.0
        self.block_tokens = block_tokens
        self.block_bytes = profile.kv_bytes_per_token * block_tokens
        self.directory = SimDirectory(num_shards)
        self.holders: dict[TokenKey, set[int]] = {}
        per_node = profile.replicas_per_node
        self.num_nodes = math.ceil(num_replicas / per_node)
        self.nodes = [
            NodeTier(
                f"pool-{n}",
                self.directory,
                profile.pool_bytes_per_node // self.block_bytes if self.tier else 0,
                profile.disk_bytes_per_node // self.block_bytes if self.tier else 0,
            )
            for n in range(self.num_nodes)
        ]
        self.replicas = [
            Replica(
                i,
                i // per_node,
                f"pool-{i // per_node}",
                EngineCache(profile.engine_cache_tokens, i, self.holders, block_tokens),
            )
            for i in range(num_replicas)
        ]
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0

    # ------------------------------------------------------------------ events

    def _at(self, t: float, kind: int, req: int, replica: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, req, replica))

    def run(
        self,
        requests: Sequence[TraceRequest],
        keys: Sequence[Sequence[TokenKey]],
        router: Router,
        *,
        time_scale: float = 1.0,
        rounds: Sequence[Sequence[int]] | None = None,
        concurrency: int = 1,
    ) -> RunStats:
        """Replay ``requests`` (arrival times multiplied by ``time_scale``) through
        ``router``; returns what happened. ``rounds``: a closed loop instead, as a client
        sends them: the requests of each round (by index), ``concurrency`` at a time, each
        next one when one is done, the next round when the whole round is."""
        check_fits(requests, self.profile)
        self._reqs, self._keys, self._router = requests, keys, router
        self._private: dict[int, int] = {}  # started request -> its private KV tokens
        self._arrival_s: dict[int, float] = {}
        self.stats = RunStats(router.name, len(self.replicas))
        self._rounds = deque(deque(r) for r in rounds) if rounds is not None else None
        self._concurrency, self._in_flight = concurrency, 0
        if self._rounds is None:
            for i, r in enumerate(requests):
                self._at(r.arrival_ms / 1e3 * time_scale, _ARRIVE, i, -1)
        else:
            self._send()
        while self._events:
            t, _, kind, i, rep = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVE:
                self._arrive(i)
            elif kind == _PREFILLED:
                self._prefilled(i, rep)
            else:
                self._done(i, rep)
        stuck = [r.index for r in self.replicas if r.waiting]
        if stuck:
            raise TraceError(f"requests left waiting on replica(s) {stuck[:5]}: KV too small")
        self.stats.busy_s = [r.busy_s for r in self.replicas]
        self.stats.spilled_blocks = sum(n.spilled_blocks for n in self.nodes)
        return self.stats

    def _send(self, after_s: float = 0.0) -> None:
        """The closed loop's next requests, ``after_s`` from now (when the client has the
        answer it waited for)."""
        rounds = self._rounds
        assert rounds is not None
        while rounds and not rounds[0] and self._in_flight == 0:
            rounds.popleft()
        while rounds and rounds[0] and self._in_flight < self._concurrency:
            self._at(self.now + after_s, _ARRIVE, rounds[0].popleft(), -1)
            self._in_flight += 1

    def _arrive(self, i: int) -> None:
        req = self._reqs[i]
        rep = self.replicas[self._router.choose(self, req, self._keys[i])]
        rep.waiting.append(i)
        rep.active_blocks += self.blocks_of(req)
        self._arrival_s[i] = self.now
        self._try_start(rep)

    @staticmethod
    def blocks_of(req: TraceRequest) -> int:
        return math.ceil((req.input_length + req.output_length) / req.block_tokens)

    def _try_start(self, rep: Replica) -> None:
        if rep.busy or not rep.waiting or rep.running >= self.profile.max_running:
            return
        i = rep.waiting[0]
        req, keys = self._reqs[i], self._keys[i]
        private = req.input_length - len(keys) * self.block_tokens + req.output_length
        hit = rep.cache.hit_run(keys)
        plan = self._tier_plan(rep, keys[hit:]) if self.tier else []
        if not rep.cache.admit(keys, private):
            # A request that fits no replica even alone was refused before the replay
            # (check_fits); this one waits for a running request to release its KV.
            return
        rep.waiting.popleft()
        self._private[i] = private
        loaded = len(plan)
        load_s = self._load(rep, keys[hit : hit + loaded], plan)
        # As vLLM, the last prompt token is always computed (its logits give the first token).
        cached = min((hit + loaded) * self.block_tokens, req.input_length - 1)
        new = req.input_length - cached
        s = self.stats
        s.prompt_tokens += req.input_length
        s.computed_tokens += new
        local = min(hit * self.block_tokens, cached)
        s.local_tokens += local
        # The recomputed last token, when it was in a loaded block, is not a tier hit.
        s.tier_node_tokens -= (
            (hit + loaded) * self.block_tokens - cached - (hit * self.block_tokens - local)
        )
        prefill_s = self.profile.prefill_s(new, cached)
        rep.busy = True
        rep.running += 1
        rep.busy_s += load_s + prefill_s
        self._at(self.now + load_s + prefill_s, _PREFILLED, i, rep.index)

    def _tier_plan(self, rep: Replica, keys: Sequence[TokenKey]) -> list[Tier | str]:
        """Per leading block the directory holds: where it is read from ('node', 'remote'
        or DISK), stopping at the first block no replica holds."""
        plan: list[Tier | str] = []
        if not keys:
            return plan
        for result in self.directory.lookup(keys):
            if result is None or not result.replicas:
                break
            pools = {r.pool for r in result.replicas if r.tier == Tier.MEMORY}
            if rep.pool in pools:
                plan.append("node")
            elif pools:
                plan.append("remote")
            else:
                plan.append(Tier.DISK)
        return plan

    def _load(self, rep: Replica, keys: Sequence[TokenKey], plan: Sequence[Tier | str]) -> float:
        """Time to bring ``keys`` into the engine; blocks from elsewhere land in this node's
        pool first (the tier fetches into the reader's pool), so the next reader here finds
        them."""
        if not keys:
            return 0.0
        p, s = self.profile, self.stats
        remote = sum(1 for w in plan if w == "remote")
        disk = sum(1 for w in plan if w == Tier.DISK)
        s.tier_remote_tokens += remote * self.block_tokens
        s.disk_tokens += disk * self.block_tokens
        s.tier_node_tokens += (len(keys) - remote - disk) * self.block_tokens
        node = self.nodes[rep.node]
        node.store([k for k, w in zip(keys, plan, strict=True) if w != "node"])
        node.touch(keys)
        gb = self.block_bytes / 1e9
        return gb * (len(keys) / p.same_node_gb_s + remote / p.cross_node_gb_s + disk / p.disk_gb_s)

    def _prefilled(self, i: int, r: int) -> None:
        rep = self.replicas[r]
        keys = self._keys[i]
        overhead = self.profile.request_overhead_s
        self.stats.ttft_s.append(self.now - self._arrival_s.pop(i) + overhead)
        rep.cache.ready(keys)
        if self.tier:
            self.nodes[rep.node].store(keys)
        rep.busy = False
        steps = self._reqs[i].output_length
        self._at(self.now + steps * self.profile.decode_s_per_token, _DONE, i, r)
        self._try_start(rep)

    def _done(self, i: int, r: int) -> None:
        rep = self.replicas[r]
        rep.cache.release(self._keys[i], self._private.pop(i))
        completed = getattr(self._router, "completed", None)
        if completed is not None:  # a router that counts its own outstanding work
            completed(self._reqs[i], r)
        rep.running -= 1
        rep.active_blocks -= self.blocks_of(self._reqs[i])
        self._try_start(rep)
        if self._rounds is not None:
            self._in_flight -= 1
            self._send(self.profile.request_overhead_s)
