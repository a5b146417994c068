"""Records of the verified fetch: the owner's export, and the reader's per-page outcome.

Plain data, apart from the read-verify-seal step in :mod:`tessera_ray.transport.fetch` (which
re-exports every name here): exports cross processes pickled, results go back to callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from tessera_ray.core import ContentHash, PageHandle
from tessera_ray.errors import (
    TransferTimeoutError,
    TransportConfigError,
    TransportError,
    VerificationError,
)

__all__ = [
    "PageExport",
    "FailureReason",
    "FetchedPage",
    "FailedPage",
    "PageFetchResult",
    "all_failed",
]


@dataclass(frozen=True, kw_only=True)
class PageExport:
    """The owner's answer to a fetch: which of its slots hold the pinned pages, and what they
    must hash to. Cheap to pickle; valid while the owner's lease on the pages lasts."""

    peer: str
    """Name of the owner's transport (``PeerInfo.name``)."""
    namespace: str
    """Tenant namespace the pages are sealed under (keys the content hash)."""
    fingerprint: str
    """Layout fingerprint of the owner's pool (keys the content hash, too)."""
    page_bytes: int
    slots: tuple[int, ...]
    content_hashes: tuple[int, ...]
    group: int = 0
    """Layer group (index of the pool in the owner's ``register`` call) the slots belong to."""

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.content_hashes):
            raise TransportConfigError(
                f"{len(self.slots)} slots but {len(self.content_hashes)} content hashes"
            )

    def __len__(self) -> int:
        return len(self.slots)


class FailureReason(StrEnum):
    TRANSFER_FAILED = "transfer_failed"
    """The backend reported an error (owner dead, connection lost, unknown peer)."""
    TIMEOUT = "timeout"
    HASH_MISMATCH = "hash_mismatch"
    """The bytes that landed do not hash to the exported content hash."""
    LAYOUT_MISMATCH = "layout_mismatch"
    """Owner and reader pools differ in layout fingerprint or page size."""


class FetchedPage(NamedTuple):
    """One verified, sealed page of a fetch. A named tuple, as the pool's ``SealResult``: a
    fetch makes one per page, and a frozen dataclass costs markedly more to build."""

    position: int
    """Index of the page in the export."""
    content_hash: ContentHash
    handle: PageHandle
    """The sealed local page; the caller holds one reference."""
    deduplicated: bool
    """An equal page was already local: ``handle`` is that page, the fetched copy was freed."""


class FailedPage(NamedTuple):
    position: int
    content_hash: ContentHash
    reason: FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class PageFetchResult:
    """Outcome of one verified page fetch (a transport read of one export); every exported page
    is in exactly one of the two lists. Per block and across pools: the client's ``FetchResult``."""

    fetched: tuple[FetchedPage, ...]
    failed: tuple[FailedPage, ...]
    bytes_moved: int
    """Bytes of the reads that completed (verified or not)."""
    withheld_slots: int = 0
    """Reserved slots kept out of use because the backend could not cancel the read (0 almost
    always); they are neither free nor sealed until the process ends."""

    @property
    def ok(self) -> bool:
        return not self.failed

    def raise_for_failures(self) -> None:
        """Raise the error matching the first failure (for callers that want all or nothing)."""
        if not self.failed:
            return
        first = self.failed[0]
        msg = f"{len(self.failed)} of {len(self.fetched) + len(self.failed)} pages not fetched: "
        msg += first.detail
        if first.reason is FailureReason.HASH_MISMATCH:
            raise VerificationError(msg)
        if first.reason is FailureReason.TIMEOUT:
            raise TransferTimeoutError(msg)
        raise TransportError(msg)


def all_failed(
    export: PageExport, reason: FailureReason, detail: str, withheld: int = 0
) -> PageFetchResult:
    """``export`` failed whole: every page for ``reason``, no bytes moved."""
    failed = tuple(
        FailedPage(i, ContentHash(c), reason, detail) for i, c in enumerate(export.content_hashes)
    )
    return PageFetchResult((), failed, 0, withheld)
