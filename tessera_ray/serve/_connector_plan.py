"""The scheduler side of the vLLM connector, in plain Python (no vLLM import).

Per request it keeps the chained token keys of its full blocks, the vLLM block ids they live in,
and how many leading blocks the tier already holds; per engine step it turns that into a small
:class:`StepPlan` (what each worker loads and saves), which is all that crosses to the workers.

Token keys follow vLLM's block hashing inputs: each block's key chains the parent block's key
and the block's token ids, and carries vLLM's extra keys of the block (LoRA adapter, multimodal
inputs, prompt embeddings, the ``cache_salt``), the model's name and the tier layout's
fingerprint. The ``cache_salt`` also picks the tenant namespace, so a request of another salt
is a miss at the directory even for equal tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessera_ray.core import token_key
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LayoutError
from tessera_ray.layout import ModelLayout

__all__ = [
    "BlockLoad",
    "BlockSave",
    "StepPlan",
    "NewScheduled",
    "CachedScheduled",
    "SchedulerPlanner",
    "ExtraKeysFn",
    "tenant_namespace",
    "check_paged_layout",
]

log = logging.getLogger(__name__)

ExtraKeysFn = Callable[[Any, int, int, int], tuple[Any, int]]
"""``(request, start token, end token, multimodal index) -> (extra keys or None, next index)``:
vLLM's per-block extra hash inputs (``generate_block_hash_extra_keys``)."""


class RequestLike(Protocol):
    """The parts of vLLM's ``Request`` the planner reads."""

    request_id: str
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


class TierLookup(Protocol):
    def lookup(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockHash | None]: ...


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Blocks of one request to load this step: ``block_ids[i]`` of vLLM's cache receives the
    tier block under ``token_keys[i]``; ``block_hashes[i]`` is the hash the scheduler's lookup
    saw (the load verifies the bytes against the hash the pool returns with them)."""

    req_id: str
    namespace: str
    block_ids: tuple[int, ...]
    token_keys: tuple[TokenKey, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Blocks of one request that became full this step: store ``block_ids[i]`` of vLLM's
    cache under ``token_keys[i]``."""

    req_id: str
    namespace: str
    block_ids: tuple[int, ...]
    token_keys: tuple[TokenKey, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What every worker does in one engine step (small and picklable)."""

    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()


@dataclass(frozen=True, slots=True)
class NewScheduled:
    """A request scheduled for the first time (or again after preemption) this step."""

    req_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True, slots=True)
class CachedScheduled:
    """A running request scheduled again: its new blocks (all its blocks when ``resumed``)."""

    req_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class _Tracked:
    request: RequestLike
    namespace: str
    keys: list[TokenKey] = field(default_factory=list)
    mm_index: int = 0
    block_ids: list[int] = field(default_factory=list)
    known_blocks: int = 0
    """Leading blocks the tier holds or that were already handed to a worker to save."""
    match: tuple[int, list[TokenKey], list[BlockHash]] | None = None
    load: BlockLoad | None = None
    loaded: tuple[int, tuple[int, ...]] = (0, ())
    """The last load: the first block's index in the request, and its vLLM block ids."""


def tenant_namespace(base: str, cache_salt: str | None) -> str:
    """The tier namespace of a request: ``base``, or a per-salt namespace under it. The salt is
    hashed so it never appears in the tier's state or metrics."""
    if not cache_salt:
        return base
    return f"{base}/salt-{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}"


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
            "connector moves MLA layouts (DeepSeek-V2/V3, Kimi-K2) only"
        )
    return layout.groups[0].page.page_bytes


def _no_extra_keys(request: Any, start: int, end: int, mm_index: int) -> tuple[Any, int]:
    return None, mm_index


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
        extra_keys: ExtraKeysFn = _no_extra_keys,
    ) -> None:
        if block_tokens != layout.block_tokens:
            raise LayoutError(
                f"vLLM's block_size {block_tokens} differs from the tier's block of "
                f"{layout.block_tokens} tokens; run vLLM with block_size={layout.block_tokens}"
            )
        self.tier = tier
        self.layout = layout
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.can_load = can_load
        self.can_save = can_save
        self.extra_keys = extra_keys
        self._plain_fingerprint = self._fingerprint(model_name, None)
        self._model_name = model_name
        self._requests: dict[str, _Tracked] = {}

    def _fingerprint(self, model_name: str, extra: Any) -> str:
        # JSON of a list keeps the parts apart (no separator a model name could contain);
        # vLLM's extra keys are tuples of str, int and bytes, whose repr is stable.
        return json.dumps([self.layout.fingerprint, model_name, repr(extra) if extra else None])

    def _track(self, request: RequestLike) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        namespace = tenant_namespace(self.namespace, request.cache_salt)
        if tracked is None or tracked.request is not request or tracked.namespace != namespace:
            tracked = _Tracked(request, namespace)
            self._requests[request.request_id] = tracked
        return tracked

    def _keys(self, tracked: _Tracked, num_blocks: int) -> list[TokenKey]:
        """The chained keys of the first ``num_blocks`` blocks (extended as tokens arrive)."""
        bs = self.block_tokens
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

    # ---------------------------------------------------------------- vLLM's scheduler hooks

    def matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` whose full blocks the tier holds (one lookup).

        The prompt's last token is never claimed: vLLM must compute at least one token to
        sample from, so a block-aligned prompt leaves its last block to vLLM (as vLLM's own
        connectors do)."""
        if not self.can_load:
            return 0
        tracked = self._track(request)
        tracked.match = None
        bs = self.block_tokens
        if num_computed_tokens % bs:
            return 0
        start, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if limit <= start:
            return 0
        keys = self._keys(tracked, limit)[start:limit]
        try:
            found = self.tier.lookup(tracked.namespace, keys)
        except Exception as exc:  # a tier that is down is a miss, never a failed request
            log.warning("tier lookup failed, treating as a miss: %s", exc)
            return 0
        hashes: list[BlockHash] = []
        for h in found:
            if h is None:
                break
            hashes.append(h)
        if hashes:
            tracked.match = (start, keys[: len(hashes)], hashes)
        return len(hashes) * bs

    def after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Record the blocks vLLM allocated for the matched tokens: they are loaded this step."""
        tracked = self._track(request)
        match, tracked.match = tracked.match, None
        if num_external_tokens <= 0 or match is None:
            return
        start, keys, hashes = match
        # Whole blocks: should vLLM take fewer tokens than matched and end inside a block, that
        # block is still loaded whole (vLLM recomputes past its own count).
        n = -(-num_external_tokens // self.block_tokens)
        if n > len(keys) or start + n > len(block_ids):
            raise LayoutError(
                f"request {request.request_id}: vLLM allocated for {num_external_tokens} "
                f"external tokens, more than the {len(keys)} blocks matched"
            )
        tracked.load = BlockLoad(
            request.request_id,
            tracked.namespace,
            tuple(block_ids[start : start + n]),
            tuple(keys[:n]),
            tuple(hashes[:n]),
        )
        tracked.known_blocks = max(tracked.known_blocks, start + n)
        tracked.loaded = (start, tracked.load.block_ids)

    def build(self, new: Sequence[NewScheduled], cached: Sequence[CachedScheduled]) -> StepPlan:
        """This step's plan: pending loads, and every block that becomes full this step."""
        loads: list[BlockLoad] = []
        saves: list[BlockSave] = []
        for tracked in self._requests.values():
            if tracked.load is not None:
                loads.append(tracked.load)
                tracked.load = None
        steps: list[tuple[_Tracked, int]] = []
        for n in new:
            tracked_new = self._requests.get(n.req_id)
            if tracked_new is not None:
                tracked_new.block_ids = list(n.block_ids)
                steps.append((tracked_new, n.num_computed_tokens + n.num_scheduled_tokens))
        for c in cached:
            tracked_c = self._requests.get(c.req_id)
            if tracked_c is None:
                continue
            if c.resumed:
                tracked_c.block_ids = list(c.new_block_ids or ())
            elif c.new_block_ids:
                tracked_c.block_ids.extend(c.new_block_ids)
            steps.append((tracked_c, c.num_computed_tokens + c.num_scheduled_tokens))
        if self.can_save:
            for tracked, done in steps:
                save = self._save(tracked, done)
                if save is not None:
                    saves.append(save)
        return StepPlan(tuple(loads), tuple(saves))

    def _save(self, tracked: _Tracked, done_tokens: int) -> BlockSave | None:
        # Only tokens already in the request count: positions of speculative draft tokens
        # hold KV of tokens that may yet be rejected.
        done = min(done_tokens, len(tracked.request.all_token_ids))
        full = min(done // self.block_tokens, len(tracked.block_ids))
        if full <= tracked.known_blocks:
            return None
        keys = self._keys(tracked, full)
        first, tracked.known_blocks = tracked.known_blocks, full
        return BlockSave(
            tracked.request.request_id,
            tracked.namespace,
            tuple(tracked.block_ids[first:full]),
            tuple(keys[first:full]),
        )

    def load_failed(self, block_ids: set[int]) -> None:
        """Workers could not load ``block_ids``: vLLM recomputes them from the first failed
        block of each request, so those blocks are saved again once recomputed."""
        if not block_ids:
            return
        for tracked in self._requests.values():
            start, ids = tracked.loaded
            failed = [i for i, b in enumerate(ids) if b in block_ids]
            if failed:
                tracked.known_blocks = min(tracked.known_blocks, start + failed[0])
                tracked.loaded = (0, ())

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
