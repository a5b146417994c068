"""What a worker's load of one step came to: the tier blocks it read and verified, where their
positions go in vLLM's cache, and what failed; and how a run of them lands in a layer's cache
(no vLLM import).

A block is loaded only if its bytes hash to the block hash the pool sealed them under: under one
token key another pool may hold other, equally valid bytes than the scheduler's lookup saw (an
engine whose KV is not bitwise reproducible stored them), and those are taken.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from tessera_ray.actors.messages import BlockRead
from tessera_ray.core.results import BlockHash
from tessera_ray.errors import LayoutError
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.planes import LayerPlanes
from tessera_ray.vllm.records import TokenRows

__all__ = ["LoadRun", "LoadOutcome", "land_run", "staged", "verified_block"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadRun:
    """One load's verified positions: ``count`` consecutive staged tier blocks of part ``part``
    of the step's reads, from its block ``first``, hold positions from ``skip`` rows into the
    first of them, written to ``rows``."""

    part: int
    first: int
    count: int
    skip: int
    rows: TokenRows


@dataclass(slots=True)
class LoadOutcome:
    """A step's verified tier blocks (staged rows), where their positions go, and what
    failed."""

    parts: list[torch.Tensor] = field(default_factory=list)
    """Per read of the step, uint8 ``[tier blocks read, block_bytes]``: the payloads where the
    read left them (the rows a run names are verified; the others are never copied)."""
    runs: list[LoadRun] = field(default_factory=list)
    failed_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)


def staged(payloads: np.ndarray) -> torch.Tensor:
    """``payloads`` as a tensor over the same memory (no copy)."""
    with warnings.catch_warnings():  # read-only (shared) memory: only ever read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(payloads)


def land_run(planes: LayerPlanes, pages: torch.Tensor, run: LoadRun, engine_tokens: int) -> None:
    """Write one layer's share of ``run`` into its cache, straight from the staged pages (no
    copy in between). ``pages``: the layer's pages of the run's part, ``[blocks, T, row]`` (a
    strided view of the staged payloads). Whole engine blocks go by :meth:`LayerPlanes.write_tokens`
    (a slice copy per run of consecutive block ids), once per tier block slot of an engine block
    or engine block slot of a tier block; the partial engine blocks at either end one tier
    block's share at a time."""
    t, e, rows = pages.shape[1], engine_tokens, run.rows
    blocks = pages[run.first : run.first + run.count]

    def partial(start: int, stop: int) -> None:
        # Positions [start, stop) of one engine block, in pieces that lie in one tier block.
        ids = torch.tensor([rows.block_ids[(start - rows.first_position) // e]])
        at = start - rows.start + run.skip
        while start < stop:
            tier_block, offset = divmod(at, t)
            n = min(stop - start, t - offset)
            planes.write_tokens(
                ids, blocks[tier_block : tier_block + 1, offset : offset + n], start % e
            )
            start, at = start + n, at + n

    lo = min(rows.stop, -(-rows.start // e) * e)
    hi = max(lo, rows.stop // e * e)
    if lo > rows.start:
        partial(rows.start, lo)
    if hi > lo:
        first = (lo - rows.first_position) // e
        ids = torch.tensor(rows.block_ids[first : first + (hi - lo) // e])
        _land_blocks(planes, blocks, lo - rows.start + run.skip, ids, e)
    if rows.stop > hi:
        partial(hi, rows.stop)


def _land_blocks(
    planes: LayerPlanes, blocks: torch.Tensor, at: int, ids: torch.Tensor, e: int
) -> None:
    """Whole engine blocks ``ids`` from the run's staged ``blocks`` (``[n, T, row]``), the first
    from position ``at`` of the run."""
    t, m = blocks.shape[1], len(ids)
    if at % min(t, e):
        raise LayoutError(
            f"engine blocks from run position {at}: not on a {min(t, e)}-token boundary"
        )
    if e % t == 0:  # an engine block is k tier blocks: its slot j from every k-th of them
        k = e // t
        src = blocks[at // t : at // t + m * k]
        for j in range(k):
            planes.write_tokens(ids, src[j::k], j * t)
        return
    # A tier block is k engine blocks: slot j of each tier block (every k-th engine id, so
    # one copy per block where runs of consecutive ids would allow fewer).
    k = t // e
    slots = blocks.view(len(blocks), k, e, blocks.shape[2])
    u0 = at // e
    for j in range(k):
        u = u0 + (j - u0) % k  # the run's first engine block in slot j
        if u < u0 + m:
            got = ids[u - u0 :: k]
            planes.write_tokens(got, slots[u // k : u // k + len(got), j])


def verified_block(
    layout: ModelLayout, namespace: str, block: BlockRead, looked_up: BlockHash, checked: bool
) -> bool:
    """Whether ``block`` may be loaded: a whole block of ``layout`` whose bytes hash to the hash
    the pool sealed it under (``checked``: the reader hashed them where they landed already)."""
    row = block.payload
    if row.dtype != np.uint8 or row.size != layout.block_bytes:
        log.warning("tier block of %d bytes, expected %d", row.size, layout.block_bytes)
        return False
    if not checked and payload_block_hash(layout, namespace, row) != block.block_hash:
        log.warning("tier block failed verification against its sealed hash; recomputing")
        return False
    if block.block_hash != looked_up:
        log.debug("the pool holds other valid bytes under this key than the lookup saw")
    return True
