"""The pool's page memory: one ``uint8 [num_pages, page_bytes]`` tensor, a flat host view of it,
and how pages are read and hashed.

Kept apart from the pool's bookkeeping because where the bytes live (device, pinned host, or
page-aligned host mappings the disk tier can read into directly) is a config decision made once,
and how a page is hashed follows from it: in place on the host, staged in chunks from a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from tessera_ray.core._staging import DeviceHasher
from tessera_ray.core._views import flashmla_view, region_views
from tessera_ray.core.config import PoolConfig, check_fits
from tessera_ray.core.hashing import ContentHashFn, xxh3_128
from tessera_ray.core.hostmem import aligned_host_zeros
from tessera_ray.core.shm import shared_host_zeros
from tessera_ray.errors import PageDTypeError, UnknownNameError
from tessera_ray.layout import PageSpec

__all__ = ["PageMemory", "page_storage"]


def page_storage(config: PoolConfig, page_bytes: int) -> tuple[torch.Tensor, memoryview | None]:
    """Zeroed page memory for ``config``, and for host memory a flat ``memoryview`` of it.

    The view lets xxh3 read a page in place, without a copy; slicing it is cheaper than
    building a numpy row per page. ``None`` on a device, whose bytes the CPU cannot read.
    """
    check_fits(config, page_bytes)
    pinned = config.resolved_pin_memory()
    if config.shared_memory_dir is not None:  # host pages other processes of the node map
        data = shared_host_zeros(config.shared_memory_dir, config.num_pages, page_bytes, pin=pinned)
    elif config.is_cuda or pinned:  # device and pinned allocations are page-aligned already
        data = torch.zeros(
            (config.num_pages, page_bytes),
            dtype=torch.uint8,
            device=config.device,
            pin_memory=pinned,
        )
    else:
        data = aligned_host_zeros(config.num_pages, page_bytes)
    host = None if config.is_cuda else data.numpy().reshape(-1).data
    return data, host


class PageMemory:
    """The bytes of a pool's pages and the content hash they are sealed with.

    ``data`` holds every page, a row each; ``host`` is its flat view (``None`` on a device);
    ``hash`` is the content hash as called per page. All fixed at construction, and public
    because the sealing loop reads them once per call instead of calling a method per page.
    """

    __slots__ = ("_hasher", "_spec", "_views", "data", "hash", "host", "page_bytes")

    def __init__(self, spec: PageSpec, config: PoolConfig, content_hash: ContentHashFn) -> None:
        self._spec = spec
        self.page_bytes = spec.page_bytes
        self.data, self.host = page_storage(config, spec.page_bytes)
        # The default hash is called straight from the C extension: one Python frame less per
        # page is a measurable share of sealing (see bench_pool.py).
        self.hash: ContentHashFn = (
            xxhash.xxh3_128_intdigest if content_hash is xxh3_128 else content_hash
        )
        self._hasher: DeviceHasher | None = None
        self._views: dict[str, torch.Tensor] | None = None

    def buffer(self, index: int) -> memoryview:
        """Page ``index``'s bytes: in place on the host, a copy from a device."""
        if self.host is not None:
            pb = self.page_bytes
            return self.host[index * pb : (index + 1) * pb]
        return self.data[index].cpu().numpy().data

    def hash_rows(self, slots: Sequence[int], seed: int) -> list[int]:
        """Content hashes of pages ``slots``: in place on the host, staged from a device."""
        fn, host, pb = self.hash, self.host, self.page_bytes
        if host is None:
            if self._hasher is None:
                self._hasher = DeviceHasher(self.data, fn)
            return self._hasher.hash_rows(slots, seed)
        return [fn(host[s * pb : (s + 1) * pb], seed) for s in slots]

    def region_view(self, region: str) -> torch.Tensor:
        """Typed zero-copy view ``[num_pages, entries_per_page, columns]`` of one region."""
        if self._views is None:
            self._views = region_views(self.data, self._spec)
        try:
            return self._views[region]
        except KeyError:
            raise UnknownNameError(
                f"no region {region!r}; this page has {', '.join(self._views)}"
            ) from None

    def flashmla_view(self) -> torch.Tensor:
        """FlashMLA's ``[num_pages, block_tokens, 1, 576]`` bf16 view (mla-bf16 pages only)."""
        try:
            return flashmla_view(self.data, self._spec)
        except ValueError as e:
            raise PageDTypeError(str(e)) from None
