"""The start-up heap freeze of pool processes (``actors/_heap.py``)."""

from __future__ import annotations

import gc
import weakref

from tessera_ray.actors._heap import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_live_objects_out_of_collections_and_drops_garbage_first() -> None:
    gc.unfreeze()
    kept = [_Cycle() for _ in range(100)]
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage  # unreachable, but only a collection frees a cycle
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert gone() is None  # the garbage cycle was collected first, not frozen for good
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in kept)  # no collection walks them any more
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
