"""Which blocks a pool lets go of first under memory pressure, as a pure choice (the pool
service gathers the facts and does the evicting).

Cheapest to lose first: a block with a durable copy (on this pool's disk tier, or a disk replica
elsewhere) leaves memory without a write; then one another pool holds in memory (still served
from there, but spilled, since that pool may be evicting its copy at the same moment, trusting
this one); then the rest, spilled. Least recently used first within each class. Without a disk
tier there is nowhere to spill, so a copy in another pool's memory is the best there is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar

from tessera_ray.actors.directory import Replica, Tier

__all__ = ["eviction_plan"]

K = TypeVar("K")


def eviction_plan(
    candidates: Sequence[K],
    on_disk_here: Collection[K],
    elsewhere: Mapping[K, Sequence[Replica]],
    *,
    has_disk: bool,
) -> tuple[list[K], set[K]]:
    """The order to try ``candidates`` (least recently used first) in, and which of them may
    leave memory without a disk write. ``elsewhere``: per candidate, its replicas on other
    pools (missing: none known)."""
    replicated = {k for k in candidates if any(r.tier == Tier.MEMORY for r in elsewhere.get(k, ()))}
    durable = {
        k
        for k in candidates
        if k in on_disk_here or any(r.tier == Tier.DISK for r in elsewhere.get(k, ()))
    }
    if not has_disk:
        durable |= replicated
    order = sorted(candidates, key=lambda k: (k not in durable, k not in replicated))
    return order, durable
