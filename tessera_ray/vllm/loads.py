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

from tessera_ray.actors.messages import BlockRead, LayerCheck
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LayoutError
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.planes import LayerPlanes, consecutive_runs
from tessera_ray.vllm.records import TokenRows

__all__ = ["LoadRun", "LoadOutcome", "PartCheck", "land_run", "staged", "verified_block"]

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
    req_id: str = ""


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
    checks: dict[int, PartCheck] = field(default_factory=dict)
    """By part: the parts read in place, whose pages are checked one layer at a time, each
    layer's just before it lands."""


@dataclass(slots=True)
class PartCheck:
    """A part read in place, not hashed yet (:attr:`BlockReads.check_layer`)."""

    check: LayerCheck
    namespace: str
    keys: list[TokenKey | None]
    """Per payload row, its token key (reported to the tier when its pages do not match)."""
    failed: bool = False
    """A page did not match (or its pool exited): none of the part lands from then on."""


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
    # A tier block is k engine blocks: the run's engine block r is slot (u0 + r) % k of
    # staged tier block (u0 + r) // k. Where the engine ids come in long runs of consecutive
    # ids (vLLM hands out a fresh cache's blocks in order), per run: its whole tier blocks in
    # one copy, the slots before and after in one per tier block. Else per slot: every k-th
    # engine id, one copy per run of consecutive ids among those (cheaper per copy in Python,
    # so better where the ids lie scattered and most copies are of one block anyway).
    k = t // e
    slots = blocks.view(len(blocks), k, e, blocks.shape[2])
    u0 = at // e
    runs = consecutive_runs(ids.tolist())
    if m >= 2 * k * len(runs):  # runs of two tier blocks or more, on average
        for i, j, block in runs:
            for u, q, s, n in _pieces(u0 + i, u0 + j, k):
                src = slots[q : q + max(1, n // k), s : s + min(n, k)]
                planes.write_groups(block + u - u0 - i, src)
        return
    for j in range(k):
        u = u0 + (j - u0) % k  # the run's first engine block in slot j
        if u < u0 + m:
            got = ids[u - u0 :: k]
            planes.write_tokens(got, slots[u // k : u // k + len(got), j])


def _pieces(u: int, stop: int, k: int) -> list[tuple[int, int, int, int]]:
    """Engine slots ``[u, stop)`` of staged tier blocks of ``k`` slots, as copies: ``(u, tier
    block, first slot, slots)``, whole tier blocks together (``slots`` a multiple of ``k``)."""
    out = []
    while u < stop:
        q, s = divmod(u, k)
        n = (stop - u) // k * k if s == 0 and stop - u >= k else min(k - s, stop - u)
        out.append((u, q, s, n))
        u += n
    return out


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
