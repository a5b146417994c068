"""The scheduler side of the vLLM connector, in plain Python (no vLLM import).

Per request it keeps the chained token keys of its full tier blocks, the vLLM block ids its
tokens live in, and how many leading tier blocks the tier already holds; per engine step it
turns that into a small :class:`StepPlan` (what each worker loads and saves), which is all that
crosses to the workers.

The tier's block (64 tokens for MLA, FlashMLA's page) stays the unit of dedup and transfer
whatever block size the engine runs: an engine block may hold several tier blocks (128, 256)
or a tier block span several engine blocks (16, 32). Loads and saves therefore name token
positions, and :class:`TokenRows` says where those positions sit in vLLM's paged cache. A load
writes exactly the positions vLLM counts as externally computed, never a position the step
itself writes nor one vLLM already holds (its own prefix-cache blocks may be shared by other
requests).

Token keys follow vLLM's block hashing inputs, and a request's ``cache_salt`` picks its tenant
namespace (:mod:`~tessera_ray.vllm.keys`). The records a step exchanges live in
:mod:`~tessera_ray.vllm.records`, the per-request state in
:mod:`~tessera_ray.vllm.request_state`.

The scheduler thread never waits on the tier for long: a lookup runs in the background and
:meth:`SchedulerPlanner.matched_tokens` answers ``None`` ("ask again next step") until it is
back, waiting at most ``lookup_wait_s`` each time.

A request whose prefix this engine is storing right now (its tier stores run behind the engine)
would otherwise miss the blocks still on their way and recompute them: when the tier's run of
blocks stops at one whose store is still running (the workers report each step's stores done,
:meth:`SchedulerPlanner.stores_done`), the planner asks the tier again (answering ``None``
meanwhile) until the store ends, or ``store_wait_s`` after it was handed over at most. A lookup
asked before such a store ended and answered after it is stale: it is asked again, not taken as
a miss (so is a hybrid prefix whose blocks are in and whose record is still landing).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tessera_ray.actors.messages import PinTicket
from tessera_ray.core import token_key
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LayoutError, TierUnavailableError
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.backend import SOURCES, PinnedHits, TierBackend, TierHit, hit_source
from tessera_ray.vllm.keys import (
    ExtraKeysFn,
    key_fingerprint,
    no_extra_keys,
    tenant_namespace,
)
from tessera_ray.vllm.records import (
    BlockLoad,
    BlockSave,
    CachedScheduled,
    NewScheduled,
    StepPlan,
    TokenRows,
)
from tessera_ray.vllm.request_state import (
    LookupMatch,
    PendingLookup,
    RequestLike,
    TierLookup,
    TrackedRequest,
)
from tessera_ray.vllm.router_word import ROUTER_WORD_S, ROUTER_WORD_TAKEN_PARAM, router_missed
from tessera_ray.vllm.stats import ConnectorCounters

__all__ = [
    "SchedulerPlanner",
    "TierSupply",
    "check_paged_layout",
    "check_block_sizes",
    "TIER_TOKENS_PARAM",
    "TIER_SOURCES_PARAM",
]

TIER_TOKENS_PARAM = "tessera_tier_tokens"
"""The key of a finished request's ``kv_transfer_params`` (the OpenAI response's field of that
name) that counts the prompt tokens the tier supplied to it."""

TIER_SOURCES_PARAM = "tessera_tier_sources"
"""Beside it: those tokens by where the tier read them (:data:`~tessera_ray.vllm.backend.SOURCES`:
this node's pool's memory, another pool's memory, a disk tier)."""

log = logging.getLogger(__name__)


class TierSupply(NamedTuple):
    """What the tier supplied to one finished request's prompt."""

    tokens: int
    sources: dict[str, int]
    """``tokens`` by :data:`~tessera_ray.vllm.backend.SOURCES` entry."""
    router_word: bool = False
    """The engine took the router's word that the tier held none of the prompt's blocks, and
    did not look them up itself."""

    def params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params``."""
        params = {TIER_TOKENS_PARAM: self.tokens, TIER_SOURCES_PARAM: dict(self.sources)}
        return {**params, ROUTER_WORD_TAKEN_PARAM: True} if self.router_word else params


_RELOOK_S = 0.01  # between lookups of a request waiting on this engine's own stores


def check_paged_layout(layout: ModelLayout) -> int:
    """The page bytes of ``layout`` if it is what the connector moves: one paged group holding
    every layer (MLA: one latent page per layer), no sliding windows."""
    if (
        len(layout.groups) != 1
        or layout.windows
        or layout.groups[0].layers != tuple(range(layout.num_layers))
    ):
        raise LayoutError(
            f"layout {layout.model}/{layout.format_name} is not one page per layer; the vLLM "
            "connector moves MLA and full-attention layouts only"
        )
    return layout.groups[0].page.page_bytes


def check_block_sizes(tier_tokens: int, engine_tokens: int) -> None:
    """An engine block must hold whole tier blocks, or a tier block whole engine blocks."""
    if engine_tokens <= 0 or (tier_tokens % engine_tokens and engine_tokens % tier_tokens):
        raise LayoutError(
            f"vLLM's block_size {engine_tokens} and the tier's block of {tier_tokens} tokens do "
            f"not divide one another; run vLLM with a block_size that divides or is a multiple "
            f"of {tier_tokens} (e.g. 16, 32, {tier_tokens}, {2 * tier_tokens})"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _answer(pending: PendingLookup, answer: Any) -> PinnedHits:
    """A lookup's answer as hits and the pin it made (``None``: a plain lookup's)."""
    return answer if pending.pinned else (answer, None)


def leading_hits(found: Sequence[TierHit | None]) -> list[TierHit]:
    """The hits before the first miss."""
    hits: list[TierHit] = []
    for hit in found:
        if hit is None:
            break
        hits.append(hit)
    return hits


class SchedulerPlanner:
    """Scheduler-side state of the connector (see the module docstring)."""

    def __init__(
        self,
        tier: TierLookup,
        layout: ModelLayout,
        *,
        namespace: str,
        model_name: str,
        block_tokens: int,
        can_load: bool,
        can_save: bool,
        extra_keys: ExtraKeysFn = no_extra_keys,
        lookup_wait_s: float = 0.002,
        lookup_timeout_s: float = 30.0,
        store_wait_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        counters: ConnectorCounters | None = None,
        local_pool: str | None = None,
        pin_on_lookup: bool = False,
    ) -> None:
        check_block_sizes(layout.block_tokens, block_tokens)
        self.local_pool = local_pool
        self.tier = tier
        # Lookups pin what this node's pool holds, for a worker that reads it in place: the
        # worker's read then starts without a round trip to the pool (a backend that cannot
        # pin answers None and the lookup is a plain one).
        self._pins = tier if pin_on_lookup and isinstance(tier, TierBackend) else None
        self.layout = layout
        self.namespace = namespace
        self.tier_tokens = layout.block_tokens
        self.engine_tokens = block_tokens
        self.can_load = can_load
        self.can_save = can_save
        self.extra_keys = extra_keys
        self.lookup_wait_s = lookup_wait_s
        self.lookup_timeout_s = lookup_timeout_s
        self.store_wait_s = store_wait_s
        self._clock = clock
        self.counters = counters if counters is not None else ConnectorCounters()
        self._save_seq = 0
        self._storing: dict[TokenKey, int] = {}
        """Keys whose store is still running, to the step's ``save_seq`` that handed them over."""
        self._stores: dict[int, tuple[float, list[TokenKey]]] = {}
        """Per ``save_seq`` still running, when lookups stop waiting for it and its keys (in
        ``save_seq`` order, so in deadline order too)."""
        # When each key's store ended (oldest first): a lookup asked before that moment may
        # have missed a block that has landed since, and is asked again, not taken as a miss.
        self._landed: dict[TokenKey, float] = {}
        self._plain_fingerprint = self._fingerprint(model_name, None)
        self._model_name = model_name
        self._requests: dict[str, TrackedRequest] = {}

    def _fingerprint(self, model_name: str, extra: Any) -> str:
        return key_fingerprint(self.layout.fingerprint, model_name, extra)

    def _track(self, request: RequestLike) -> TrackedRequest:
        tracked = self._requests.get(request.request_id)
        namespace = tenant_namespace(self.namespace, request.cache_salt)
        if tracked is None or tracked.request is not request or tracked.namespace != namespace:
            tracked = TrackedRequest(request, namespace)
            self._requests[request.request_id] = tracked
        return tracked

    def _keys(self, tracked: TrackedRequest, num_blocks: int) -> list[TokenKey]:
        """The chained keys of the first ``num_blocks`` tier blocks (extended as tokens
        arrive)."""
        bs = self.tier_tokens
        tokens = tracked.request.all_token_ids
        while len(tracked.keys) < num_blocks:
            start = len(tracked.keys) * bs
            extra, tracked.mm_index = self.extra_keys(
                tracked.request, start, start + bs, tracked.mm_index
            )
            fingerprint = (
                self._fingerprint(self._model_name, extra) if extra else self._plain_fingerprint
            )
            parent = tracked.keys[-1] if tracked.keys else None
            tracked.keys.append(
                token_key(tracked.namespace, fingerprint, parent, list(tokens[start : start + bs]))
            )
        return tracked.keys[:num_blocks]

    def _rows(self, tracked: TrackedRequest, start: int, stop: int) -> TokenRows:
        """Where positions ``[start, stop)`` of ``tracked`` live in vLLM's cache."""
        e = self.engine_tokens
        first, last = start // e, _ceil_div(stop, e)
        return TokenRows(tuple(tracked.block_ids[first:last]), first * e, start, stop)

    # ---------------------------------------------------------------- vLLM's scheduler hooks

    def matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int | None:
        """Tokens past ``num_computed_tokens`` whose tier blocks the tier holds, or ``None``
        while the lookup (one batched call) is still on its way: vLLM asks again next step.

        The prompt's last token is never claimed: vLLM must compute at least one token to
        sample from, so a block-aligned prompt leaves its last tier block to vLLM (as vLLM's
        own connectors do)."""
        tracked = self._track(request)
        bs = self.tier_tokens
        # What vLLM holds already this engine stored when it computed it, or loaded from the
        # tier: storing it again on every local hit would copy the whole prefix each time.
        tracked.known_blocks = max(tracked.known_blocks, num_computed_tokens // bs)
        if not self.can_load:
            return 0
        self._drop_match(tracked)
        first, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if limit <= first:
            tracked.lookup = None
            return 0
        keys = self._lookup_keys(tracked, first, limit)
        if first == 0 and self._router_missed(tracked, keys[0]):
            self.counters.add(router_misses=1)
            tracked.router_word_taken = True
            return 0
        pending = tracked.lookup
        if pending is None and self._clock() < tracked.relook_s:
            self.counters.add(store_waits=1)
            return None
        if pending is None or pending.first != first or pending.keys != keys:
            self._drop_lookup(pending)
            try:
                pending = tracked.lookup = self._start_lookup(tracked.namespace, first, keys)
            except TierUnavailableError as exc:  # a tier that is down is a miss
                self._tier_failed(exc)
                return 0
        try:
            found, ticket = _answer(pending, pending.future.result(timeout=self.lookup_wait_s))
        except TimeoutError:
            if self._clock() - pending.started_s < self.lookup_timeout_s:
                self.counters.add(lookup_waits=1)
                return None
            self._drop_lookup(pending)
            tracked.lookup = None
            self.counters.add(tier_failures=1)
            log.warning("tier lookup took over %.1f s, treating as a miss", self.lookup_timeout_s)
            return 0
        except TierUnavailableError as exc:
            tracked.lookup = None
            self._tier_failed(exc)
            return 0
        tracked.lookup = None
        prefix = keys[: limit - first]
        match, held = self._matched(tracked, num_computed_tokens, first, keys, found)
        since = pending.started_s
        if self._still_storing(prefix, held, since) or self._record_landing(
            keys, found, match, held, since
        ):
            self._unpin(ticket)
            tracked.relook_s = self._clock() + _RELOOK_S
            self.counters.add(store_waits=1)
            return None
        if match is None:
            self._unpin(ticket)
            return 0
        match.ticket = ticket
        tracked.match = match
        return (first + len(match.keys)) * bs - num_computed_tokens

    def _start_lookup(self, namespace: str, first: int, keys: list[TokenKey]) -> PendingLookup:
        future = self._pins.lookup_pinned_async(namespace, keys) if self._pins else None
        if future is not None:
            return PendingLookup(first, keys, future, self._clock(), pinned=True)
        return PendingLookup(first, keys, self.tier.lookup_async(namespace, keys), self._clock())

    def _unpin(self, ticket: PinTicket | None) -> None:
        if ticket is not None and self._pins is not None:
            self._pins.unpin(ticket)

    def _drop_lookup(self, pending: PendingLookup | None) -> None:
        """Abandon a lookup: a pin it made, now or when it answers, is ended."""
        if pending is None:
            return
        pending.future.cancel()
        if pending.pinned:
            pending.future.add_done_callback(self._unpin_answer)

    def _unpin_answer(self, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._unpin(future.result()[1])

    def _drop_match(self, tracked: TrackedRequest) -> None:
        """Forget the request's match (and end its pin: no load will read it)."""
        if tracked.match is not None:
            self._unpin(tracked.match.ticket)
            tracked.match = None

    def _router_missed(self, tracked: TrackedRequest, first_key: TokenKey) -> bool:
        """Whether the tier-aware router's lookup found no copy of the request's first tier
        block, said moments ago (:mod:`~tessera_ray.vllm.router_word`), and this engine is not
        storing that block itself: then there is nothing to look up."""
        now = self._clock()
        if tracked.router_word_until is None:
            said = router_missed(getattr(tracked.request, "kv_transfer_params", None), first_key)
            tracked.router_word_until = now + ROUTER_WORD_S if said else -math.inf
        if now >= tracked.router_word_until:
            return False
        self._forget_expired()
        return first_key not in self._storing and first_key not in self._landed

    def _lookup_keys(self, tracked: TrackedRequest, first: int, limit: int) -> list[TokenKey]:
        """What one lookup asks for: the keys of tier blocks ``first .. limit``."""
        return self._keys(tracked, limit)[first:limit]

    def _matched(
        self,
        tracked: TrackedRequest,
        computed: int,
        first: int,
        keys: Sequence[TokenKey],
        found: Sequence[TierHit | None],
    ) -> tuple[LookupMatch | None, int]:
        """What a lookup of ``keys`` found: the match (``None``: nothing to load) and how many
        leading tier blocks the tier held."""
        hits = leading_hits(found)
        if not hits:
            return None, 0
        return LookupMatch(computed, first, list(keys[: len(hits)]), hits), len(hits)

    def _tier_failed(self, exc: TierUnavailableError) -> None:
        self.counters.add(tier_failures=1)
        log.warning("tier lookup failed, treating as a miss: %s", exc)

    def _still_storing(self, keys: Sequence[TokenKey], found: int, since: float) -> bool:
        """Whether the first of ``keys`` the tier did not hold (``keys[found]``) may still
        land, or has landed since a lookup asked at ``since``: worth asking again rather
        than recomputing."""
        self._forget_expired()
        for key in keys[:found]:
            self._storing.pop(key, None)
        return found < len(keys) and self._landing(keys[found], since)

    def _landing(self, key: TokenKey, since: float) -> bool:
        """Whether this engine is storing ``key``, or its store ended after ``since``."""
        return key in self._storing or self._landed.get(key, -math.inf) >= since

    def _record_landing(
        self,
        keys: Sequence[TokenKey],
        found: Sequence[TierHit | None],
        match: LookupMatch | None,
        held: int,
        since: float,
    ) -> bool:
        """Whether what ends the held prefix beyond the match is still landing: nothing for a
        model whose hit is its prefix blocks alone (the hybrid planner's resume records)."""
        return False

    def _forget_expired(self) -> None:
        now = self._clock()
        horizon = now - self.store_wait_s
        while self._landed:
            key = next(iter(self._landed))
            if self._landed[key] >= horizon:
                break
            del self._landed[key]
        while self._stores:
            oldest = next(iter(self._stores))
            if self._stores[oldest][0] > now:
                break
            self._store_ended(oldest, landed=False)

    def _store_ended(self, seq: int, *, landed: bool = True) -> None:
        """A store ended: reported by the workers (``landed``), or given up on."""
        _, keys = self._stores.pop(seq, (0.0, []))
        now = self._clock()
        for key in keys:
            if self._storing.get(key) == seq:  # not handed over again by a later step
                del self._storing[key]
                self._landed.pop(key, None)  # kept in the order the stores ended
                if landed:
                    self._landed[key] = now

    def stores_done(self, seqs: Sequence[int]) -> None:
        """Workers finished (stored, or gave up on) the saves of the steps ``seqs``."""
        for seq in seqs:
            self._store_ended(seq)

    def after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Record the blocks vLLM allocated for the matched tokens: they are loaded this step,
        exactly the ``num_external_tokens`` positions after the ones vLLM already holds."""
        tracked = self._track(request)
        match, tracked.match = tracked.match, None
        if num_external_tokens <= 0 or match is None:
            if match is not None:
                self._unpin(match.ticket)
            return
        bs = self.tier_tokens
        start = match.computed
        stop = start + num_external_tokens
        n = _ceil_div(stop, bs) - match.first
        tracked.block_ids = list(block_ids)
        if n > len(match.keys) or _ceil_div(stop, self.engine_tokens) > len(block_ids):
            raise LayoutError(
                f"request {request.request_id}: vLLM allocated {len(block_ids)} blocks for "
                f"{num_external_tokens} external tokens after {start}, more than the "
                f"{len(match.keys)} tier blocks matched"
            )
        rows = self._rows(tracked, start, stop)
        ticket = match.ticket
        if ticket is not None and len(ticket.blocks) != n:  # pinned other blocks than loaded
            self._unpin(ticket)
            ticket = None
        tracked.load = BlockLoad(
            request.request_id,
            tracked.namespace,
            tuple(match.keys[:n]),
            tuple(match.hits[:n]),
            match.first * bs,
            rows,
            ticket=ticket,
        )
        tracked.known_blocks = max(tracked.known_blocks, match.first + n)
        tracked.loaded = rows
        tracked.tier_tokens = num_external_tokens
        self.note_sources(tracked, match.first, start, match.hits[:n])

    def note_sources(
        self, tracked: TrackedRequest, first: int, start: int, hits: Sequence[TierHit]
    ) -> None:
        """Where the tier blocks ``first ..`` a load reads from position ``start`` are held."""
        tracked.sources = [hit_source(h, self.local_pool) for h in hits]
        tracked.sources_from = (first, start)

    def build(self, new: Sequence[NewScheduled], cached: Sequence[CachedScheduled]) -> StepPlan:
        """This step's plan: pending loads, and every tier block that becomes full this step."""
        loads: list[BlockLoad] = []
        saves: list[BlockSave] = []
        for tracked in self._requests.values():
            if tracked.load is not None:
                loads.append(tracked.load)
                tracked.load = None
        steps: list[tuple[TrackedRequest, int]] = []
        for n in new:
            tracked_new = self._requests.get(n.req_id)
            if tracked_new is not None:
                tracked_new.block_ids = list(n.block_ids)
                tracked_new.groups = [list(ids) for ids in n.groups]
                steps.append((tracked_new, n.num_computed_tokens + n.num_scheduled_tokens))
        for c in cached:
            tracked_c = self._requests.get(c.req_id)
            if tracked_c is None:
                continue
            if c.resumed:
                tracked_c.block_ids = list(c.new_block_ids or ())
                tracked_c.groups = [list(ids) for ids in c.new_groups or ()]
            else:
                tracked_c.block_ids.extend(c.new_block_ids or ())
                for ids, more in zip(tracked_c.groups, c.new_groups or (), strict=False):
                    ids.extend(more)
            steps.append((tracked_c, c.num_computed_tokens + c.num_scheduled_tokens))
        if self.can_save:
            for tracked, done in steps:
                save = self._save(tracked, done)
                if save is not None:
                    saves.append(save)
        if not saves:
            return StepPlan(tuple(loads))
        self._save_seq += 1
        if self.can_load and self.store_wait_s > 0:
            self._forget_expired()
            keys = [k for save in saves for k in (*save.token_keys, *save.resume_keys)]
            self._stores[self._save_seq] = (self._clock() + self.store_wait_s, keys)
            self._storing.update(dict.fromkeys(keys, self._save_seq))
        return StepPlan(tuple(loads), tuple(saves), self._save_seq)

    def _save(self, tracked: TrackedRequest, done_tokens: int) -> BlockSave | None:
        # Only tokens already in the request count: positions of speculative draft tokens
        # hold KV of tokens that may yet be rejected.
        done = min(done_tokens, len(tracked.request.all_token_ids))
        bs = self.tier_tokens
        full = min(done, len(tracked.block_ids) * self.engine_tokens) // bs
        if full <= tracked.known_blocks:
            return None
        keys = self._keys(tracked, full)
        first, tracked.known_blocks = tracked.known_blocks, full
        return BlockSave(
            tracked.request.request_id,
            tracked.namespace,
            tuple(keys[first:full]),
            self._rows(tracked, first * bs, full * bs),
        )

    def load_failed(self, block_ids: set[int]) -> None:
        """Workers could not load ``block_ids`` (engine blocks): vLLM recomputes them from the
        first failed block of each request, so those tier blocks are saved again once
        recomputed."""
        if not block_ids:
            return
        for tracked in self._requests.values():
            if tracked.loaded is None:
                continue
            position = tracked.loaded.first_failed_position(block_ids, self.engine_tokens)
            if position is not None:
                tracked.known_blocks = min(tracked.known_blocks, position // self.tier_tokens)
                tracked.tier_tokens = max(0, position - tracked.loaded.start)
                tracked.loaded = None

    def finished(self, req_id: str) -> TierSupply:
        """Forget a finished request; what the tier supplied to its prompt."""
        tracked = self._requests.pop(req_id, None)
        sources = dict.fromkeys(SOURCES, 0)
        if tracked is None:
            return TierSupply(0, sources)
        self._drop_lookup(tracked.lookup)
        self._drop_match(tracked)
        # The tokens still counted as loaded (a failed load shortens them), block by block.
        bs = self.tier_tokens
        first, start = tracked.sources_from
        stop = start + tracked.tier_tokens
        for i, source in enumerate(tracked.sources):
            lo, hi = max(start, (first + i) * bs), min(stop, (first + i + 1) * bs)
            sources[source] += max(0, hi - lo)
        return TierSupply(tracked.tier_tokens, sources, tracked.router_word_taken)
