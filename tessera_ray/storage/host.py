"""Host-memory tier: one slab of uint8 (pinned when CUDA exists), fixed-size slots, LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

import torch

from tessera_ray.errors import InvalidKeyError, StorageError
from tessera_ray.storage.config import HostTierConfig
from tessera_ray.storage.keys import ContentHasher, Payload, normalize_key, writable_view
from tessera_ray.storage.tier import StorageTier, TierCapabilities

__all__ = ["HostMemoryTier"]


class HostMemoryTier(StorageTier):
    """Pages in one preallocated slab: allocation never happens on the put path.

    Every page takes one slot of ``slot_bytes`` (the pool's page size, so slots never
    fragment); a full slab drops its least recently used page. Memory is trusted, so reads are
    not re-verified; puts check the content hash when a ``hasher`` is given.
    """

    capabilities = TierCapabilities(
        persistent=False, verifies_reads=False, evicts=True, reads_into=True
    )

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        hasher: ContentHasher | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.config = HostTierConfig(
            capacity_bytes=capacity_bytes, slot_bytes=slot_bytes, pin_memory=pin_memory
        )
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._slab = torch.empty(
            (self.config.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin
        )
        self._np = self._slab.numpy()
        self._hasher = hasher
        self._free = list(range(self.config.num_slots - 1, -1, -1))
        self._slots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (slot, len)
        self.evicted_pages_total = 0

    async def put_many(self, items: Sequence[tuple[bytes | str, Payload]]) -> None:
        views = self._views(items)
        for key, view in views:  # validate the whole batch before storing any of it
            if view.nbytes > self.config.slot_bytes:
                raise StorageError(
                    f"a page of {view.nbytes} B exceeds slot_bytes {self.config.slot_bytes}"
                )
            if self._hasher is not None and self._hasher(view) != key:
                raise InvalidKeyError(f"payload does not hash to its key {key.hex()}")
        for key, view in views:
            if key in self._slots:
                self._slots.move_to_end(key)
                continue
            if not self._free:
                _, (slot, _n) = self._slots.popitem(last=False)
                self._free.append(slot)
                self.evicted_pages_total += 1
            slot = self._free.pop()
            self._np[slot, : view.nbytes] = view
            self._slots[key] = (slot, view.nbytes)

    def _lookup(self, key: bytes | str) -> tuple[int, int] | None:
        raw = normalize_key(key)
        found = self._slots.get(raw)
        if found is not None:
            self._slots.move_to_end(raw)
        return found

    async def get_many(self, keys: Sequence[bytes | str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            found = self._lookup(key)
            out.append(None if found is None else self._np[found[0], : found[1]].tobytes())
        return out

    async def get_many_into(
        self, keys: Sequence[bytes | str], outs: Sequence[Payload]
    ) -> list[int | None]:
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        result: list[int | None] = []
        for key, out in zip(keys, outs, strict=True):
            view = writable_view(out)
            found = self._lookup(key)
            if found is None:
                result.append(None)
                continue
            slot, n = found
            if view.nbytes < n:
                raise ValueError(f"output buffer holds {view.nbytes} B, the page has {n} B")
            view[:n] = self._np[slot, :n].data
            result.append(n)
        return result

    async def contains_many(self, keys: Sequence[bytes | str]) -> list[bool]:
        return [normalize_key(k) in self._slots for k in keys]

    async def delete_many(self, keys: Sequence[bytes | str]) -> list[bool]:
        removed = []
        for key in keys:
            found = self._slots.pop(normalize_key(key), None)
            if found is not None:
                self._free.append(found[0])
            removed.append(found is not None)
        return removed

    async def keys(self) -> AsyncIterator[bytes]:
        for key in list(self._slots):
            yield key

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.config.slot_bytes

    async def close(self) -> None:
        self._slots.clear()
