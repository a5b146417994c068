"""The scheduler-side state the vLLM connector's planner keeps per request: the request
itself (only the parts of vLLM's ``Request`` it reads), the tier lookup in flight, what that
lookup matched, and the keys, blocks and loads recorded so far.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessera_ray.actors.messages import PinTicket
from tessera_ray.core.results import TokenKey
from tessera_ray.vllm.backend import TierHit
from tessera_ray.vllm.records import BlockLoad, TokenRows

__all__ = [
    "LookupFuture",
    "RequestLike",
    "TierLookup",
    "PendingLookup",
    "LookupMatch",
    "TrackedRequest",
]

LookupFuture = concurrent.futures.Future[list[TierHit | None]]


class RequestLike(Protocol):
    """The parts of vLLM's ``Request`` the planner reads."""

    request_id: str
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


class TierLookup(Protocol):
    """What the planner needs of the tier (a :class:`TierBackend` has it)."""

    def lookup_async(self, namespace: str, keys: Sequence[TokenKey]) -> LookupFuture:
        """Start one batched lookup; the future gives, per key, what the tier holds and where
        (a :class:`~tessera_ray.vllm.backend.TierHit`) or ``None``."""
        ...


@dataclass(slots=True)
class PendingLookup:
    """A lookup in flight for the tier blocks ``first .. first + len(keys)`` of a request
    (``pinned``: its future gives the hits with a pin ticket, a ``PinnedHits``)."""

    first: int
    keys: list[TokenKey]
    future: concurrent.futures.Future[Any]
    started_s: float
    pinned: bool = False


@dataclass(slots=True)
class LookupMatch:
    """The tier blocks a finished lookup found, from the position vLLM asked about."""

    computed: int
    first: int
    keys: list[TokenKey]
    hits: list[TierHit]
    resume_keys: list[TokenKey] = field(default_factory=list)
    """A hybrid model: the chunks of the resume record where the match ends, and their hits."""
    resume_hits: list[TierHit] = field(default_factory=list)
    ticket: PinTicket | None = None
    """The lookup's pin of the leading ``len(ticket.blocks)`` blocks in this node's pool, for
    the worker's read (ended by whoever does not hand it on)."""


@dataclass(slots=True)
class TrackedRequest:
    """One request the planner follows, from its first lookup until it finishes."""

    request: RequestLike
    namespace: str
    keys: list[TokenKey] = field(default_factory=list)
    mm_index: int = 0
    block_ids: list[int] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    """A hybrid model: every KV cache group's block ids, in position order."""
    resume: dict[TokenKey, list[TokenKey]] = field(default_factory=dict)
    """A hybrid model: the record chunk keys derived so far, by boundary key (a lookup asks
    again every step it waits)."""
    router_word_until: float | None = None
    """Until when the router's word that the tier held none of its blocks stands (``None``:
    not read yet; ``-inf``: no such word)."""
    router_word_taken: bool = False
    """A lookup was not made on the router's word."""
    known_blocks: int = 0
    """Leading tier blocks the tier holds or that were already handed to a worker to save."""
    lookup: PendingLookup | None = None
    relook_s: float = 0.0
    """No new lookup before this time (waiting on blocks this engine is storing)."""
    match: LookupMatch | None = None
    load: BlockLoad | None = None
    loaded: TokenRows | None = None
    """Where the last load wrote, to map a failed engine block back to a tier block."""
    tier_tokens: int = 0
    """Prompt tokens the last load took from the tier, less any that failed to load."""
    sources: list[str] = field(default_factory=list)
    """Per tier block of the last load, where the tier held it (``SOURCES``)."""
    sources_from: tuple[int, int] = (0, 0)
    """The first of those tier blocks, and the position the load started at."""
