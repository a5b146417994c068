"""Keep the garbage collector off a pool process's long-lived heap.

Why: a pool actor's heap is mostly what it built at start-up and keeps until it exits (torch,
Ray, NIXL, one record per page slot). CPython's full collection walks all of it, and an
occasional fetch paid for that walk many times its own length. Frozen after start-up, those
objects are never walked again; what the pool allocates per request is collected as before.
It buys tail latency, not throughput (docs/measured-choices.md).
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect start-up garbage, then move every object still tracked to the collector's
    permanent generation; returns how many were frozen. Call once, when start-up is done."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
