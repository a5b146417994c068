"""The pool's page memory: one ``uint8 [num_pages, page_bytes]`` tensor, a flat host view of it,
and how pages are read and hashed.

Kept apart from the pool's bookkeeping because where the bytes live (device, pinned host, or
page-aligned host mappings the disk tier can read into directly) is a config decision made once,
and how a page is hashed follows from it (:func:`device_hash_path`): in place on the host; on
the device for the default hash, into the same digest; staged to the host for another hash.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Literal

import torch
import xxhash

from tessera_ray.core._bytes import as_words
from tessera_ray.core._staging import DeviceHasher
from tessera_ray.core._views import flashmla_view, region_views
from tessera_ray.core._xxh3 import rows_qualify, xxh3_128_rows
from tessera_ray.core.config import PoolConfig, check_fits
from tessera_ray.core.hashing import ContentHashFn, xxh3_128
from tessera_ray.core.hostmem import aligned_host_zeros
from tessera_ray.core.shm import shared_host_zeros
from tessera_ray.errors import PageDTypeError, PoolError, UnknownNameError
from tessera_ray.layout import PageSpec

__all__ = ["HashPath", "PageMemory", "device_hash_path", "kernel_available", "page_storage"]

HashPath = Literal["host", "staged", "torch", "triton"]
"""How a pool hashes its pages: ``host`` in place with the pool's hash function; ``staged``
copied from the device to the host in chunks (``core/_staging.py``), then the same;
``torch``/``triton`` the default hash computed on the device (``core/_xxh3.py``)."""


log = logging.getLogger(__name__)
_kernel_failure: list[str] = []
"""Why the Triton kernel failed to compile or run in this process (then torch ops hash)."""


@functools.cache
def kernel_available() -> bool:
    """Whether the Triton kernel of the device hash imports (Triton is an optional extra) and
    has not failed in this process."""
    if _kernel_failure:
        return False
    try:
        import tessera_ray.core._xxh3_kernel  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or present without a usable backend
        return False
    return True


def device_hash_path(
    content_hash: ContentHashFn, page_bytes: int, device: torch.device
) -> HashPath:
    """How pages of ``page_bytes`` bytes on ``device``, which the CPU cannot read in place,
    are hashed with ``content_hash``: on the device when it is the default hash and the pages
    fit XXH3's long path in whole words (the Triton kernel on CUDA when it imports, torch ops
    otherwise); staged to the host for any other hash, which only the host can run."""
    if content_hash not in (xxh3_128, xxhash.xxh3_128_intdigest) or not rows_qualify(page_bytes):
        return "staged"
    if device.type == "cuda" and kernel_available():
        return "triton"
    return "torch"


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


def _kernel_failed(exc: Exception) -> None:
    # Same digest either way, so a kernel that will not build costs speed, never correctness.
    if not _kernel_failure:
        _kernel_failure.append(f"{type(exc).__name__}: {exc}")
        log.warning("the Triton device hash failed (%s); hashing with torch ops", exc)
    kernel_available.cache_clear()


class PageMemory:
    """The bytes of a pool's pages and the content hash they are sealed with.

    ``data`` holds every page, a row each; ``words`` is the same rows as 8-byte words where
    the page size allows (``data`` itself otherwise), what gathers of whole pages should move;
    ``host`` is its flat view (``None`` on a device); ``hash`` is the content hash as called
    per page on the host. All fixed at construction, and public because the sealing loop
    reads them once per call instead of calling a method per page.
    """

    __slots__ = (
        "_hasher",
        "_spec",
        "_views",
        "data",
        "hash",
        "host",
        "page_bytes",
        "words",
    )

    def __init__(self, spec: PageSpec, config: PoolConfig, content_hash: ContentHashFn) -> None:
        self._spec = spec
        self.page_bytes = spec.page_bytes
        self.data, self.host = page_storage(config, spec.page_bytes)
        self.words = as_words(self.data)
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

    @property
    def hash_path(self) -> HashPath:
        """How :meth:`hash_rows` hashes this memory's pages (see :data:`HashPath`)."""
        if self.host is not None:
            return "host"
        return device_hash_path(self.hash, self.page_bytes, self.data.device)

    def hash_rows(self, slots: Sequence[int], seed: int) -> list[int]:
        """Content hashes of pages ``slots``, in order, by :attr:`hash_path`."""
        fn, host, pb = self.hash, self.host, self.page_bytes
        if host is not None:
            return [fn(host[s * pb : (s + 1) * pb], seed) for s in slots]
        path = self.hash_path
        if path == "triton":
            try:
                return xxh3_128_rows(self.data, slots, seed, kernel=True)
            except PoolError:  # bad input, refused before any launch
                raise
            except Exception as exc:  # a Triton that imports but cannot compile here
                _kernel_failed(exc)
                path = "torch"
        if path != "staged":
            return xxh3_128_rows(self.data, slots, seed)
        if self._hasher is None:
            self._hasher = DeviceHasher(self.data, fn)
        return self._hasher.hash_rows(slots, seed)

    def hash_row(self, index: int, seed: int) -> int:
        """The content hash of page ``index``, as :meth:`hash_rows` computes it."""
        if self.host is not None:
            pb = self.page_bytes
            return self.hash(self.host[index * pb : (index + 1) * pb], seed)
        return self.hash_rows([index], seed)[0]

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
