"""The records the vLLM connector's planner exchanges: what vLLM's scheduler reports per
request (:class:`NewScheduled`, :class:`CachedScheduled`) and the per-step plan the workers
carry out (:class:`StepPlan` of :class:`BlockLoad` and :class:`BlockSave`, whose positions
:class:`TokenRows` maps into vLLM's paged cache). Plain frozen dataclasses: the plan is pickled
to every worker each step, so it stays small and free of vLLM types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera_ray.actors.messages import PinTicket
from tessera_ray.core.results import TokenKey
from tessera_ray.vllm.backend import TierHit

__all__ = [
    "TokenRows",
    "BlockLoad",
    "BlockSave",
    "StepPlan",
    "NewScheduled",
    "CachedScheduled",
]


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Token positions ``[start, stop)`` of one request and where they live in vLLM's cache:
    ``block_ids[i]`` is the engine block holding positions from ``first_position + i *
    engine_tokens``. Position ``p`` is row ``block_ids[(p - first_position) // engine_tokens] *
    engine_tokens + p % engine_tokens`` of a layer's cache viewed as one row per token."""

    block_ids: tuple[int, ...]
    first_position: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def cache_rows(self, engine_tokens: int, start: int | None = None) -> list[int]:
        """The cache rows of positions ``[start or self.start, self.stop)``."""
        first = self.start if start is None else start
        return [
            self.block_ids[(p - self.first_position) // engine_tokens] * engine_tokens
            + p % engine_tokens
            for p in range(first, self.stop)
        ]

    def blocks_from(self, position: int, engine_tokens: int) -> set[int]:
        """The engine blocks holding positions ``[position, stop)``."""
        first = max(position, self.start)
        if first >= self.stop:
            return set()
        lo = (first - self.first_position) // engine_tokens
        hi = (self.stop - 1 - self.first_position) // engine_tokens
        return set(self.block_ids[lo : hi + 1])

    def first_failed_position(self, failed: set[int], engine_tokens: int) -> int | None:
        """Where vLLM recomputes from when ``failed`` engine blocks could not be loaded: the
        first position of the first of them in this run."""
        for i, block in enumerate(self.block_ids):
            if block in failed:
                return self.first_position + i * engine_tokens
        return None


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Tier blocks of one request to load this step: the tier blocks under ``token_keys``
    cover positions from ``tier_position`` on, ``len(token_keys)`` tier blocks long; only the
    positions of ``rows`` are written into vLLM's cache. ``hits[i]`` is what the scheduler's
    lookup found under ``token_keys[i]``: the holders the worker pulls it from (it does not ask
    the directory again), and the hash seen (the load verifies the bytes against the hash the
    pool returns with them)."""

    req_id: str
    namespace: str
    token_keys: tuple[TokenKey, ...]
    hits: tuple[TierHit, ...]
    tier_position: int
    rows: TokenRows
    groups: tuple[TokenRows, ...] = ()
    """A hybrid model (several KV cache groups): the positions written in every group, in
    vLLM's group order (a sliding-window group only those it keeps at ``rows.stop``)."""
    resume_keys: tuple[TokenKey, ...] = ()
    """A hybrid model: the chunks of the resume record at ``rows.stop`` (the windows and
    compressor states the engine keeps there), read and verified with the tier blocks."""
    resume_hits: tuple[TierHit, ...] = ()
    ticket: PinTicket | None = None
    """The scheduler's lookup pinned exactly these blocks in this node's pool: the worker
    reads them in place without asking the pool first (and ends the pin, used or not)."""


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Tier blocks of one request that became full this step: the tier block under
    ``token_keys[i]`` is positions ``rows.start + i * tier_tokens`` onwards, one tier block
    long, read from vLLM's cache where ``rows`` says."""

    req_id: str
    namespace: str
    token_keys: tuple[TokenKey, ...]
    rows: TokenRows
    groups: tuple[TokenRows, ...] = ()
    """A hybrid model: per KV cache group, the positions read (a sliding-window group: those it
    keeps at ``rows.stop``, the resume record)."""
    resume_keys: tuple[TokenKey, ...] = ()
    """A hybrid model: the keys of the resume record's chunks at ``rows.stop``."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What every worker does in one engine step (small and picklable)."""

    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    save_seq: int = 0
    """Names this step's saves when a worker reports their stores done (0: no saves)."""


@dataclass(frozen=True, slots=True)
class NewScheduled:
    """A request scheduled for the first time (or again after preemption) this step."""

    req_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    groups: tuple[Sequence[int], ...] = ()
    """Every KV cache group's block ids (``block_ids`` is the first group's)."""


@dataclass(frozen=True, slots=True)
class CachedScheduled:
    """A running request scheduled again: its new blocks (all its blocks when ``resumed``)."""

    req_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_groups: tuple[Sequence[int], ...] | None = None
    """Every KV cache group's new block ids (``new_block_ids`` is the first group's)."""
