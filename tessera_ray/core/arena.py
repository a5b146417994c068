"""Per-request ring buffers for what does not page well.

A V4 sliding window keeps only the last 128 tokens of every layer, rewritten at every step,
and a compressed layer's not-yet-full compression group (its uncompressed tail) lives only
until the group completes. Neither is shared or sealed, so neither belongs in the
content-addressed pool: each request gets rings of its own, sized once, written in place, and
freed together when the request ends.
"""

from __future__ import annotations

import torch

from tessera_ray.errors import ArenaError
from tessera_ray.layout import CacheSpec

__all__ = ["RingBuffer", "RequestArena"]


class RingBuffer:
    """The last ``capacity_entries`` entries of ``num_layers`` layers, as raw bytes.

    Storage is ``uint8 [num_layers, capacity_entries, entry_bytes]``; entry ``t`` (counting
    every entry ever appended) lives in slot ``t % capacity_entries``.
    """

    __slots__ = ("capacity_entries", "data", "entry_bytes", "num_layers", "total_entries")

    def __init__(
        self, *, num_layers: int, capacity_entries: int, entry_bytes: int, device: str = "cpu"
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("capacity_entries", capacity_entries),
            ("entry_bytes", entry_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ArenaError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.capacity_entries = capacity_entries
        self.entry_bytes = entry_bytes
        self.total_entries = 0
        self.data = torch.zeros(
            (num_layers, capacity_entries, entry_bytes), dtype=torch.uint8, device=device
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __len__(self) -> int:
        """Entries currently held (at most the capacity)."""
        return min(self.total_entries, self.capacity_entries)

    def append(self, entries: torch.Tensor) -> None:
        """Append ``uint8 [num_layers, n, entry_bytes]``; the oldest entries are overwritten."""
        want = (self.num_layers, entries.shape[1] if entries.dim() == 3 else -1, self.entry_bytes)
        if entries.dtype != torch.uint8 or entries.dim() != 3 or tuple(entries.shape) != want:
            raise ArenaError(
                f"append takes uint8 [{self.num_layers}, n, {self.entry_bytes}], got "
                f"{entries.dtype} {tuple(entries.shape)}"
            )
        n = entries.shape[1]
        if n > self.capacity_entries:  # only the last capacity_entries can survive anyway
            self.total_entries += n - self.capacity_entries
            entries = entries[:, n - self.capacity_entries :]
            n = self.capacity_entries
        start = self.total_entries % self.capacity_entries
        first = min(n, self.capacity_entries - start)
        self.data[:, start : start + first].copy_(entries[:, :first])
        if first < n:
            self.data[:, : n - first].copy_(entries[:, first:])
        self.total_entries += n

    def window(self) -> torch.Tensor:
        """A copy of the held entries, oldest first: ``[num_layers, len(self), entry_bytes]``."""
        held = len(self)
        start = (self.total_entries - held) % self.capacity_entries
        order = (torch.arange(held, device=self.data.device) + start) % self.capacity_entries
        return self.data.index_select(1, order)


class RequestArena:
    """Ring buffers of in-flight requests, within a fixed byte budget.

    Rings are named per request (``"swa"``, ``"csa-tail"``, ...); ``close`` frees every ring of
    a request at once.
    """

    def __init__(self, capacity_bytes: int, *, device: str = "cpu") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ArenaError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes <= 0:
            raise ArenaError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._rings: dict[str, dict[str, RingBuffer]] = {}
        self.bytes_used = 0

    def open(
        self,
        request_id: str,
        name: str,
        *,
        num_layers: int,
        capacity_entries: int,
        entry_bytes: int,
    ) -> RingBuffer:
        """A new zeroed ring for ``request_id``; raises if it would exceed the budget."""
        rings = self._rings.get(request_id, {})
        if name in rings:
            raise ArenaError(f"request {request_id!r} already has a ring {name!r}")
        need = num_layers * capacity_entries * entry_bytes
        if self.bytes_used + need > self.capacity_bytes:
            raise ArenaError(
                f"ring {name!r} of {need:,} B does not fit: {self.bytes_used:,} of "
                f"{self.capacity_bytes:,} B in use; close finished requests first"
            )
        ring = RingBuffer(
            num_layers=num_layers,
            capacity_entries=capacity_entries,
            entry_bytes=entry_bytes,
            device=self.device,
        )
        self._rings.setdefault(request_id, {})[name] = ring
        self.bytes_used += ring.nbytes
        return ring

    def open_window(
        self, request_id: str, spec: CacheSpec, num_layers: int, name: str = "window"
    ) -> RingBuffer:
        """The sliding-window ring of a windowed cache spec (e.g. V4's 128-token SWA)."""
        if spec.window_tokens is None:
            raise ArenaError(f"{spec.label()} has no sliding window")
        return self.open(
            request_id,
            name,
            num_layers=num_layers,
            capacity_entries=spec.window_tokens // spec.stride_tokens,
            entry_bytes=spec.entry.entry_bytes,
        )

    def ring(self, request_id: str, name: str) -> RingBuffer:
        try:
            return self._rings[request_id][name]
        except KeyError:
            raise ArenaError(f"request {request_id!r} has no ring {name!r}") from None

    def close(self, request_id: str) -> int:
        """Free every ring of ``request_id``; returns the bytes freed."""
        rings = self._rings.pop(request_id, None)
        if rings is None:
            raise ArenaError(f"unknown request {request_id!r}")
        freed = sum(r.nbytes for r in rings.values())
        self.bytes_used -= freed
        return freed

    @property
    def requests(self) -> int:
        return len(self._rings)
