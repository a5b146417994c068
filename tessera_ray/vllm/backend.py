"""What the vLLM connector needs of the tier: one batched interface (:class:`TierBackend`), the
record a lookup answers per block (:class:`TierHit`), and the one failure type a backend raises
when the tier cannot answer (:class:`~tessera_ray.errors.TierUnavailableError`).

The scheduler's lookup learns where each block is held; that answer rides in the step's plan to
the worker, whose read pulls the blocks from those holders without asking the directory again.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from tessera_ray.actors.directory import Holder, LookupResult, Tier
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import (
    LeaseError,
    PoolExhaustedError,
    StorageError,
    TierUnavailableError,
    TransportError,
)
from tessera_ray.layout import ModelLayout

__all__ = [
    "PinnedHits",
    "TierBackend",
    "TierHit",
    "TierUnavailableError",
    "hit_of",
    "hit_source",
    "SOURCES",
    "tier_call",
    "TIER_FAILURES",
]

TIER_FAILURES: tuple[type[BaseException], ...] = (
    ConnectionError,  # a pool, a shard or a channel that did not answer
    TimeoutError,
    TransportError,  # a transfer that failed or did not verify
    LeaseError,  # a reservation or pin that expired meanwhile
    PoolExhaustedError,  # no room to store or pull into right now
    StorageError,  # the disk tier below refused
)
"""What the tier does in normal operation when it cannot serve a call: the connector
recomputes. Anything else out of a backend is a bug."""


@contextlib.contextmanager
def tier_call(what: str) -> Iterator[None]:
    """Turn the tier's expected failures inside into one :class:`TierUnavailableError`."""
    try:
        yield
    except TierUnavailableError:
        raise
    except TIER_FAILURES as exc:
        raise TierUnavailableError(f"{what}: {type(exc).__name__}: {exc}") from exc


class TierHit(NamedTuple):
    """A block the tier holds under a token key: the hash it was sealed under, and its holders,
    memory copies first (empty where the backend is one process and needs none)."""

    block_hash: BlockHash
    holders: tuple[Holder, ...] = ()


def hit_of(result: LookupResult) -> TierHit:
    """A directory answer as the connector carries it (pool and tier per replica, no slots)."""
    return TierHit(result.block_hash, Holder.of(result))


SOURCES = ("local", "remote", "disk")
"""Where a loaded block came from: this node's pool's memory, another pool's memory, a disk
tier (the split a finished request reports, beside its count of tier tokens)."""


def hit_source(hit: TierHit, local_pool: str | None) -> str:
    """The :data:`SOURCES` entry of ``hit`` as the engine on ``local_pool``'s node reads it (a
    one-process backend lists no holders: its blocks are local)."""
    if not hit.holders or any(h == (local_pool, Tier.MEMORY) for h in hit.holders):
        return "local"
    if any(h.tier == Tier.MEMORY for h in hit.holders):
        return "remote"
    return "disk"


PinnedHits = tuple[list[TierHit | None], PinTicket | None]
"""A lookup's hits with the run this engine's pool holds pinned (``None``: nothing pinned)."""


class TierBackend(abc.ABC):
    """What the connector needs of the tier; every method is one batched call.

    Every method raises :class:`~tessera_ray.errors.TierUnavailableError` when the tier cannot
    answer (the caller recomputes); any other exception is a bug and is not caught as one."""

    layout: ModelLayout
    """The layout the tier stores pages in (token keys and hashes carry its fingerprint)."""
    timeout_s: float
    """Longest one batched call may take."""
    local_pool: str | None = None
    """The pool this engine's node reads through (``None``: the backend has no pools)."""

    @abc.abstractmethod
    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        """Start one batched lookup: per key, what the tier holds under it and where, or
        ``None`` (a miss). Returns at once; the scheduler waits on the future briefly."""

    def lookup_pinned_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[PinnedHits] | None:
        """:meth:`lookup_async`, with the leading run this engine's own pool holds in memory
        pinned for the worker's read (which then starts without asking the pool): the ticket
        travels in the step's plan to :meth:`read`, and whoever does not read it ends it with
        :meth:`unpin`. ``None``: this backend does not pin on lookup."""
        return None

    def unpin(self, ticket: PinTicket) -> None:  # noqa: B027 - nothing pinned by default
        """End a pin :meth:`lookup_pinned_async` made that no read will use (without waiting:
        a lost unpin ends with the pin's lease)."""

    def lookup(self, namespace: str, keys: Sequence[TokenKey]) -> list[TierHit | None]:
        """:meth:`lookup_async`, waited for."""
        with tier_call("tier lookup"):
            return self.lookup_async(namespace, keys).result(self.timeout_s)

    def prepare_reads(self) -> None:  # noqa: B027 - optional hook, nothing to set up here
        """Set up what reads need, once, where reads happen (the worker); optional."""

    def release_reads(self) -> None:  # noqa: B027 - optional hook, nothing to release here
        """Release what :meth:`prepare_reads` set up (the worker shuts down)."""

    @abc.abstractmethod
    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        """Per key, the block's payload (uint8 ``[block_bytes]``) with the hash the pool
        sealed it under, or nothing when the tier no longer holds it (evicted since the
        lookup, owner gone). ``hits``: what the scheduler's lookup found for ``keys`` (the
        holders to pull from); ``None`` reads what the reader's own pool holds. ``ticket``:
        the pin :meth:`lookup_pinned_async` made of exactly ``keys`` (the read takes it over,
        used or not). Not verified here."""

    def end_reads(self) -> bool:
        """The caller copied what every read since the last call returned ``pinned``
        (:class:`~tessera_ray.actors.messages.BlockReads`): end those pins. ``False`` when a pin
        may have lapsed before this call, so that the pool may have reused its pages while they
        were copied: the caller then treats those copies as failed (nothing pinned here:
        ``True``)."""
        return True

    @abc.abstractmethod
    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        """The blocks under ``keys`` came back with bytes that do not match their hash: the
        tier checks its own copies and drops the ones that rotted, so the next save of those
        keys stores them afresh instead of every later request recomputing them."""

    @abc.abstractmethod
    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        """Store ``payloads[i]`` (uint8 ``[len(keys), block_bytes]``) under ``keys[i]``."""
