"""The one small interface every storage tier implements (host memory, disk, later remote).

Batch forms are the primitives (one call per request, never one per page);
single-page methods are conveniences over them. Keys are 16-byte content hashes (see
:mod:`tessera_ray.storage.keys`); payloads are any flat bytes-like object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tessera_ray.errors import PageNotFoundError
from tessera_ray.storage.keys import Payload, normalize_key, payload_view

__all__ = ["StorageTier", "TierCapabilities"]


@dataclass(frozen=True, kw_only=True)
class TierCapabilities:
    """What a tier promises; callers branch on these, never on the tier's type."""

    persistent: bool
    """Pages survive the process (and a crash, once the put returned)."""
    verifies_reads: bool
    """Every read recomputes checksum and content hash; a mismatch raises, never serves."""
    evicts: bool
    """Full tiers drop least-recently-used pages instead of refusing puts."""
    reads_into: bool
    """``get_many_into`` fills caller buffers without an intermediate copy."""


class StorageTier(ABC):
    """Async content-addressed page store for one layout (and one content-hash key).

    Semantics every tier keeps (the conformance tests in ``tests/storage`` pin them):

    - ``put_many`` stores each (key, payload); a key already present is kept (content-addressed,
      so equal keys mean equal bytes) and counts as a use. A payload whose content hash is not
      its key raises :class:`~tessera_ray.errors.InvalidKeyError` and stores nothing.
    - ``get_many`` returns one ``bytes`` or ``None`` (missing, evicted, or corrupt and now
      quarantined) per key; ``get`` raises ``PageNotFoundError`` / ``CorruptPageError``.
    - ``delete_many`` returns, per key, whether a page was removed.
    - Methods run on one event loop; a tier is not shared between loops or threads.
    """

    capabilities: TierCapabilities

    # --- batch primitives -------------------------------------------------------------------

    @abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes | str, Payload]]) -> None: ...

    @abstractmethod
    async def get_many(self, keys: Sequence[bytes | str]) -> list[bytes | None]: ...

    @abstractmethod
    async def get_many_into(
        self, keys: Sequence[bytes | str], outs: Sequence[Payload]
    ) -> list[int | None]:
        """Read each page into the matching writable buffer; returns bytes written or ``None``
        (a miss or a corrupt page: the buffer's content is then unspecified)."""

    @abstractmethod
    async def contains_many(self, keys: Sequence[bytes | str]) -> list[bool]: ...

    @abstractmethod
    async def delete_many(self, keys: Sequence[bytes | str]) -> list[bool]: ...

    @abstractmethod
    def keys(self) -> AsyncIterator[bytes]:
        """Every stored key, from a snapshot taken when iteration starts."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    # --- single-page conveniences ------------------------------------------------------------

    async def put(self, key: bytes | str, payload: Payload) -> None:
        await self.put_many([(key, payload)])

    async def get(self, key: bytes | str) -> bytes:
        """The page's bytes; raises ``PageNotFoundError`` or ``CorruptPageError``."""
        raw = normalize_key(key)
        (page,) = await self.get_many([raw])
        if page is None:
            raise PageNotFoundError(f"no page {raw.hex()} in this tier")
        return page

    async def get_into(self, key: bytes | str, out: Payload) -> int:
        raw = normalize_key(key)
        (n,) = await self.get_many_into([raw], [out])
        if n is None:
            raise PageNotFoundError(f"no page {raw.hex()} in this tier")
        return n

    async def contains(self, key: bytes | str) -> bool:
        (found,) = await self.contains_many([key])
        return found

    async def delete(self, key: bytes | str) -> bool:
        (removed,) = await self.delete_many([key])
        return removed

    async def __aenter__(self) -> StorageTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _views(items: Sequence[tuple[bytes | str, Payload]]) -> list[tuple[bytes, memoryview]]:
        return [(normalize_key(k), payload_view(p)) for k, p in items]
