"""The scheduler side of the connector for hybrid models (several vLLM KV cache groups, as
DeepSeek-V4 has): prefix blocks plus resume records (docs/v4-connector.md). No vLLM import.

A hybrid prefix of ``n`` tokens is two things in the tier:

- its *prefix blocks*: the chained tier blocks of every cache that keeps all positions (V4's
  compressed caches), keyed exactly like MLA pages;
- the *resume record* at ``n``: what every sliding-window cache (V4's windows and compressor
  states) keeps after ``n`` tokens, ``window - 1`` positions each, cut into tier blocks under
  keys derived from the key of the block that ends at ``n``. Records are written only where a
  stored prefix ends (the last tier block a step completes), not at every boundary.

A hit is the longest run of prefix blocks that ends where a whole resume record is held; it is
loaded all or nothing, asynchronously: vLLM refuses block-level load failures for models with
several groups, so a failed load fails the request and vLLM computes it from the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tessera_ray.core import token_key
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LayoutError
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.backend import TierHit
from tessera_ray.vllm.keys import key_fingerprint
from tessera_ray.vllm.records import BlockLoad, BlockSave, TokenRows
from tessera_ray.vllm.request_state import (
    LookupMatch,
    RequestLike,
    TierLookup,
    TrackedRequest,
)
from tessera_ray.vllm.scheduler import (
    SchedulerPlanner,
    TierSupply,
    check_block_sizes,
    leading_hits,
)

__all__ = ["EngineGroup", "HybridPlanner", "NULL_BLOCK", "resume_keys"]

NULL_BLOCK = 0
"""vLLM's null block: a sliding-window group's table holds it where positions were dropped."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One of vLLM's KV cache groups as the connector sees it: its block size, and for a
    sliding-window group its window (after ``n`` tokens it keeps positions from
    ``n - window + 1``, vLLM's ``SlidingWindowManager.get_num_skipped_tokens``)."""

    block_tokens: int
    window_tokens: int | None = None

    def kept_from(self, stop: int) -> int:
        """The first position this group holds after ``stop`` tokens."""
        if self.window_tokens is None:
            return 0
        return max(0, stop - self.window_tokens + 1)

    def rows(self, block_ids: Sequence[int], start: int, stop: int) -> TokenRows:
        """Positions ``[start, stop)`` in this group's blocks ``block_ids`` (all the request's,
        in position order)."""
        first, last = start // self.block_tokens, _ceil_div(stop, self.block_tokens)
        if last > len(block_ids):
            raise LayoutError(
                f"positions up to {stop} need {last} blocks of {self.block_tokens} tokens, the "
                f"request has {len(block_ids)}"
            )
        return TokenRows(tuple(block_ids[first:last]), first * self.block_tokens, start, stop)


def resume_keys(
    namespace: str, fingerprint: str, boundary: TokenKey, chunks: int
) -> list[TokenKey]:
    """The keys of the resume record's ``chunks`` tier blocks at the end of the prefix whose
    last block's key is ``boundary``."""
    return [token_key(namespace, fingerprint, boundary, [i]) for i in range(chunks)]


class HybridPlanner(SchedulerPlanner):
    """:class:`SchedulerPlanner` for a model with several KV cache groups (see the module
    docstring). ``groups`` are vLLM's groups in its order; ``resume_chunks`` the tier blocks
    one resume record takes."""

    def __init__(
        self,
        tier: TierLookup,
        layout: ModelLayout,
        *,
        groups: Sequence[EngineGroup],
        resume_chunks: int,
        model_name: str,
        **kwargs: Any,
    ) -> None:
        full = [g for g in groups if g.window_tokens is None]
        if not full:
            raise LayoutError("a hybrid model needs a KV cache group that keeps every position")
        for group in groups:
            check_block_sizes(layout.block_tokens, group.block_tokens)
        super().__init__(
            tier, layout, model_name=model_name, block_tokens=full[0].block_tokens, **kwargs
        )
        self.groups = tuple(groups)
        self.resume_chunks = resume_chunks
        self._resume_fingerprint = key_fingerprint(layout.fingerprint, model_name, "resume")
        self._failed_loads: set[str] = set()

    def _resume(self, tracked: TrackedRequest, boundary: TokenKey) -> list[TokenKey]:
        keys = tracked.resume.get(boundary)
        if keys is None:
            chunks = self.resume_chunks
            keys = resume_keys(tracked.namespace, self._resume_fingerprint, boundary, chunks)
            tracked.resume[boundary] = keys
        return keys

    # ---------------------------------------------------------------- lookups

    def matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int | None:
        if request.request_id in self._failed_loads:
            return 0  # its load failed once: the engine computes it
        return super().matched_tokens(request, num_computed_tokens)

    def _lookup_keys(self, tracked: TrackedRequest, first: int, limit: int) -> list[TokenKey]:
        # One batched lookup: the prefix blocks, then every boundary's record.
        prefix = self._keys(tracked, limit)[first:limit]
        return prefix + [k for boundary in prefix for k in self._resume(tracked, boundary)]

    def _matched(
        self,
        tracked: TrackedRequest,
        computed: int,
        first: int,
        keys: Sequence[TokenKey],
        found: Sequence[TierHit | None],
    ) -> tuple[LookupMatch | None, int]:
        n, extra = divmod(len(keys), 1 + self.resume_chunks)
        assert not extra, "lookup keys are the prefix blocks and one record per boundary"
        held = len(leading_hits(found[:n]))
        c = self.resume_chunks
        for j in range(held, 0, -1):
            at = n + (j - 1) * c
            chunks = found[at : at + c]
            if all(hit is not None for hit in chunks):
                return (
                    LookupMatch(
                        computed,
                        first,
                        list(keys[:j]),
                        [h for h in found[:j] if h is not None],
                        list(keys[at : at + c]),
                        [h for h in chunks if h is not None],
                    ),
                    held,
                )
        return None, held

    def _record_landing(
        self,
        keys: Sequence[TokenKey],
        found: Sequence[TierHit | None],
        match: LookupMatch | None,
        held: int,
        since: float,
    ) -> bool:
        # Every prefix block up to ``held`` is in the tier, but the hit ends at an earlier
        # record (or nowhere): the record at ``held`` may be landing with the same store.
        if not held or (match is not None and len(match.keys) == held):
            return False
        c = self.resume_chunks
        at = len(keys) // (1 + c) + (held - 1) * c
        return any(
            hit is None and self._landing(key, since)
            for key, hit in zip(keys[at : at + c], found[at : at + c], strict=True)
        )

    # ---------------------------------------------------------------- loads

    def after_alloc_groups(
        self,
        request: RequestLike,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Record the blocks vLLM allocated in every group for the matched tokens: the load
        writes the prefix blocks' positions in the full groups and the positions each
        sliding-window group keeps at the end of the hit."""
        tracked = self._track(request)
        match, tracked.match = tracked.match, None
        tracked.groups = [list(ids) for ids in block_ids]
        if num_external_tokens <= 0 or match is None:
            return
        start = match.computed
        stop = start + num_external_tokens
        end = (match.first + len(match.keys)) * self.tier_tokens
        if stop != end or len(block_ids) != len(self.groups):
            raise LayoutError(
                f"request {request.request_id}: vLLM took {num_external_tokens} external tokens "
                f"after {start} in {len(block_ids)} groups; the tier matched up to {end} in "
                f"{len(self.groups)}: a hybrid hit is loaded whole or not at all"
            )
        rows = tuple(
            g.rows(ids, max(start, g.kept_from(stop)), stop)
            for g, ids in zip(self.groups, block_ids, strict=True)
        )
        main = next(r for g, r in zip(self.groups, rows, strict=True) if g.window_tokens is None)
        tracked.load = BlockLoad(
            request.request_id,
            tracked.namespace,
            tuple(match.keys),
            tuple(match.hits),
            match.first * self.tier_tokens,
            main,
            rows,
            tuple(match.resume_keys),
            tuple(match.resume_hits),
        )
        tracked.known_blocks = max(tracked.known_blocks, match.first + len(match.keys))
        tracked.tier_tokens = num_external_tokens
        self.note_sources(tracked, match.first, start, match.hits)

    def loads_failed(self, req_ids: set[str]) -> None:
        """Workers could not load these requests: vLLM computes them from the start, and this
        connector does not try the tier for them again."""
        for req_id in req_ids:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.known_blocks = 0
                tracked.tier_tokens = 0
                self._failed_loads.add(req_id)

    def finished(self, req_id: str) -> TierSupply:
        self._failed_loads.discard(req_id)
        return super().finished(req_id)

    # ---------------------------------------------------------------- saves

    def _save(self, tracked: TrackedRequest, done_tokens: int) -> BlockSave | None:
        done = min(done_tokens, len(tracked.request.all_token_ids))
        t = self.tier_tokens
        if len(tracked.groups) != len(self.groups):
            return None
        allocated = min(
            len(ids) * g.block_tokens
            for g, ids in zip(self.groups, tracked.groups, strict=True)
            if g.window_tokens is None
        )
        full = min(done, allocated) // t
        if full <= tracked.known_blocks:
            return None
        keys = self._keys(tracked, full)
        first, tracked.known_blocks = tracked.known_blocks, full
        stop = full * t
        rows = tuple(
            g.rows(ids, first * t if g.window_tokens is None else g.kept_from(stop), stop)
            for g, ids in zip(self.groups, tracked.groups, strict=True)
        )
        main = next(r for g, r in zip(self.groups, rows, strict=True) if g.window_tokens is None)
        # The record needs every kept position still in the engine: a window the engine dropped
        # already (a null block) means no record here, only the prefix blocks.
        windows = [r for g, r in zip(self.groups, rows, strict=True) if g.window_tokens]
        whole = all(NULL_BLOCK not in r.block_ids for r in windows)
        return BlockSave(
            tracked.request.request_id,
            tracked.namespace,
            tuple(keys[first:full]),
            main,
            rows,
            tuple(self._resume(tracked, keys[full - 1])) if whole else (),
        )
