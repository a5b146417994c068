"""The directory's numpy tables: rows handed out and taken back, and the slot index's probes
across the table's end, over tombstones and through a rebuild."""

from __future__ import annotations

import numpy as np

from tessera_ray.actors._open_table import Rows, SlotIndex


def _index_of(rows: np.ndarray) -> dict[int, int]:
    return {int(r): i for i, r in enumerate(rows)}


def test_rows_reuse_what_was_released_and_grow_in_small_steps() -> None:
    t = Rows(np.dtype([("x", "<i8")]), initial_rows=8)
    first = t.alloc(8)
    assert first.tolist() == list(range(8)) and t.capacity == 8
    t.release(first[2:4])
    assert sorted(t.alloc(3).tolist()) == [2, 3, 8] and t.live == 9
    assert t.capacity == 9  # the need, when above 1.125 x the capacity


def test_probes_wrap_around_the_end_and_walk_past_tombstones() -> None:
    index = SlotIndex()
    # Every hash starts at the last slot, so all but one entry lives past the table's end.
    h = (np.uint64(0xFFFFFFFF) << np.uint64(32)) | np.arange(30, dtype=np.uint64)
    rows = np.arange(100, 130, dtype=np.int64)
    index.insert(h, rows)
    owner = _index_of(rows)

    def same(found: np.ndarray, probes: np.ndarray) -> np.ndarray:
        return np.array([owner[int(r)] == p for r, p in zip(found, probes, strict=True)], bool)

    got, at = index.find(h, same)
    assert got.tolist() == rows.tolist() and len(set(at.tolist())) == 30
    index.erase(at[:10])
    got, _ = index.find(h, same)
    assert got.tolist() == [-1] * 10 + rows[10:].tolist()
    index.rebuild(h[10:], rows[10:], extra=0)
    got, _ = index.find(h, same)
    assert got.tolist() == [-1] * 10 + rows[10:].tolist()
