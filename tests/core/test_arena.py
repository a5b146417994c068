"""Per-request ring buffers: wrap-around order, budget, and freeing with the request."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.core import RequestArena, RingBuffer
from tessera_ray.errors import ArenaError
from tessera_ray.layout import preset_layout


def entries(values: list[int], layers: int = 2, entry_bytes: int = 3) -> torch.Tensor:
    col = torch.tensor(values, dtype=torch.uint8).view(1, -1, 1)
    return col.expand(layers, -1, entry_bytes).contiguous()


def test_ring_keeps_last_entries_in_order() -> None:
    ring = RingBuffer(num_layers=2, capacity_entries=4, entry_bytes=3)
    ring.append(entries([1, 2, 3]))
    assert ring.window()[0, :, 0].tolist() == [1, 2, 3]
    ring.append(entries([4, 5, 6]))  # wraps
    assert len(ring) == 4 and ring.total_entries == 6
    assert ring.window()[1, :, 2].tolist() == [3, 4, 5, 6]
    ring.append(entries(list(range(10, 20))))  # longer than the ring
    assert ring.window()[0, :, 0].tolist() == [16, 17, 18, 19] and ring.total_entries == 16


def test_ring_rejects_wrong_shape_and_dtype() -> None:
    ring = RingBuffer(num_layers=2, capacity_entries=4, entry_bytes=3)
    with pytest.raises(ArenaError):
        ring.append(torch.zeros(2, 1, 3))
    with pytest.raises(ArenaError):
        ring.append(torch.zeros(3, 1, 3, dtype=torch.uint8))
    assert ring.total_entries == 0


def test_arena_budget_and_close() -> None:
    layout = preset_layout("deepseek-v4-flash")
    spec, layers = layout.windows[0]
    assert spec.window_tokens == 128
    per_request = len(layers) * 128 // spec.stride_tokens * spec.entry.entry_bytes
    arena = RequestArena(2 * per_request)
    arena.open_window("r1", spec, len(layers))
    arena.open_window("r2", spec, len(layers))
    assert arena.bytes_used == 2 * per_request
    with pytest.raises(ArenaError, match="does not fit"):
        arena.open_window("r3", spec, len(layers))
    assert arena.bytes_used == 2 * per_request and arena.requests == 2
    with pytest.raises(ArenaError, match="already"):
        arena.open_window("r1", spec, len(layers))
    assert arena.close("r1") == per_request and arena.bytes_used == per_request
    arena.open_window("r3", spec, len(layers))
    with pytest.raises(ArenaError):
        arena.ring("r1", "window")
    with pytest.raises(ArenaError):
        arena.close("r1")
