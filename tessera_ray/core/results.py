"""Ids and the small frozen results the pool hands across its boundary.

Everything here is immutable and cheap to pickle (frozen dataclasses, and ``NamedTuple`` for
the two values made once per page on hot paths): actors return these, never the pool's live
records. Ids are ``NewType``s over ``int`` / ``bytes`` so mypy keeps a page index, a content
hash and a token key apart at no runtime cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, NewType

__all__ = [
    "PageIndex",
    "ContentHash",
    "BlockHash",
    "TokenKey",
    "PageHandle",
    "SealResult",
    "BlockSealResult",
    "EvictedPage",
    "PoolStats",
]

PageIndex = NewType("PageIndex", int)
"""Row of a page in the pool tensor (the slot a kernel's block table names)."""

ContentHash = NewType("ContentHash", int)
"""Keyed hash of a page's bytes (xxh3-128 by default); only a candidate for equality."""

BlockHash = NewType("BlockHash", int)
"""Digest of a block's page content hashes in layer order."""

TokenKey = NewType("TokenKey", bytes)
"""Chained sha256 over (namespace, layout fingerprint, parent key, block token ids)."""


class PageHandle(NamedTuple):
    """Names one page: ``length`` bytes at byte ``offset`` of memory region ``region``.

    ``generation`` is the page slot's generation when the handle was issued; freeing the slot
    moves it on, so an old handle is detected as stale instead of silently naming new data.
    Handles are plain numbers, never pointers: resolving one is an O(1) table lookup that
    checks every field.

    A ``NamedTuple`` rather than a frozen dataclass, like :class:`SealResult`: equally
    immutable and small, but cheaper to build (a frozen dataclass pays one
    ``object.__setattr__`` per field), and one is built per page sealed.
    """

    region: int
    offset: int
    length: int
    generation: int


class SealResult(NamedTuple):
    """Outcome of sealing one page.

    ``handle`` is the page the caller now holds a reference to: the candidate itself, or, when
    ``deduplicated``, an existing page with equal bytes (the candidate was freed and its handle
    is stale). ``collision`` is True when the hash matched stored pages whose bytes differ.
    """

    handle: PageHandle
    content_hash: ContentHash
    deduplicated: bool
    collision: bool


@dataclass(frozen=True, slots=True)
class BlockSealResult:
    """Outcome of sealing every layer page of one token block."""

    block_hash: BlockHash
    pages: tuple[SealResult, ...]
    token_key_registered: bool
    """False when ``token_key`` already named a live block (first registration wins)."""

    @property
    def handles(self) -> tuple[PageHandle, ...]:
        return tuple(p.handle for p in self.pages)


@dataclass(frozen=True, slots=True)
class EvictedPage:
    """A sealed page that left the pool, with what the tier below needs to keep it."""

    namespace: str
    content_hash: ContentHash
    page: PageIndex
    data: bytes | None
    """A copy of the page bytes (``None`` when eviction was asked not to copy)."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool's counters; ``pages_free + pages_used == pages_total`` always."""

    page_bytes: int
    pages_total: int
    pages_free: int
    pages_used: int
    """Pages not on the free list: writable, referenced sealed, and evictable sealed pages."""
    pages_sealed: int
    pages_shared: int
    """Sealed pages with more than one reference."""
    pages_evictable: int
    """Sealed pages with no reference, in the LRU."""
    blocks: int
    token_keys: int
    dedup_hits: int
    """Seals answered by an existing page with equal bytes (cumulative)."""
    bytes_saved_by_dedup: int
    """``dedup_hits x page_bytes``: memory a copy per seal would have taken (cumulative)."""
    collisions: int
    """Pages installed although their hash matched stored pages with other bytes (cumulative)."""
    evictions: int
