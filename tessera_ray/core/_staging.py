"""Hashing device pages on the host, for a pool whose content hash is not the default.

The default hash (xxh3-128) runs on the device itself (``core/_xxh3.py``); an injected hash
(tests pass weak ones to force collisions) is a Python function of host bytes, so device pages
are brought to it. A page copied to the host one at a time pays a device synchronisation and a
pageable copy per page. Instead the pages are gathered on the device and copied to the host in
chunks, into two pinned buffers used in turn: the copy of one chunk runs while the CPU hashes
the previous one. The hash stays the function the pool was given, the same one seal, verify
and dedup use for host pools, so a page hashes alike wherever it lives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tessera_ray.core._bytes import as_words

__all__ = ["DeviceHasher", "CHUNK_PAGES"]

CHUNK_PAGES = 64
"""Pages per device-to-host copy: large enough that a copy's fixed cost is small against its
bytes, small enough that the first chunk's hashing starts early."""


class DeviceHasher:
    """Content hashes of rows of a device ``uint8 [pages, page_bytes]`` tensor."""

    def __init__(self, data: torch.Tensor, hash_fn: Callable[[memoryview, int], int]) -> None:
        self.data = data
        self.hash_fn = hash_fn
        self._buffers: list[torch.Tensor] = []
        # One staging pair per pool: a transport thread and the pool's own thread may both
        # hash (each its own slots), so the pair is held for a whole call.
        self._lock = threading.Lock()

    def _staging(self, rows: int) -> list[torch.Tensor]:
        if not self._buffers:
            pinned = self.data.is_cuda
            shape = (CHUNK_PAGES, self.data.shape[1])
            self._buffers = [
                torch.empty(shape, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)
            ]
        return [b[:rows] for b in self._buffers]

    def hash_rows(self, rows: Sequence[int], seed: int) -> list[int]:
        """The content hash of each row in ``rows``, in order."""
        if not rows:
            return []
        out: list[int] = []
        with self._lock:
            pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
            for n, start in enumerate(range(0, len(rows), CHUNK_PAGES)):
                chunk = rows[start : start + CHUNK_PAGES]
                host = self._staging(len(chunk))[n % 2]
                index = torch.tensor(chunk, dtype=torch.long, device=self.data.device)
                src, dst = as_words(self.data), as_words(host)
                if src.dtype != dst.dtype:
                    src, dst = self.data, host
                dst.copy_(src.index_select(0, index), non_blocking=self.data.is_cuda)
                done = None
                if self.data.is_cuda:
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.record()
                if pending is not None:
                    out.extend(self._hash(*pending, seed))
                pending = (host, done)
            assert pending is not None
            out.extend(self._hash(*pending, seed))
        return out

    def _hash(self, host: torch.Tensor, done: torch.cuda.Event | None, seed: int) -> list[int]:
        if done is not None:
            done.synchronize()
        pages: np.ndarray = host.numpy()
        return [self.hash_fn(pages[i].data, seed) for i in range(pages.shape[0])]
