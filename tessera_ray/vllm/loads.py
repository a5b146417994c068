"""What a worker's load of one step came to: the tier blocks it read and verified, where their
positions go in vLLM's cache, and what failed (no vLLM import).

A block is loaded only if its bytes hash to the block hash the pool sealed them under: under one
token key another pool may hold other, equally valid bytes than the scheduler's lookup saw (an
engine whose KV is not bitwise reproducible stored them), and those are taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tessera_ray.actors.messages import BlockRead
from tessera_ray.core.results import BlockHash
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.records import TokenRows

__all__ = ["LoadRun", "LoadOutcome", "verified_block"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadRun:
    """One load's verified positions: tier blocks ``blocks`` (rows of the staged payloads, in
    order) hold positions from ``skip`` rows into the first of them, written to ``rows``."""

    blocks: torch.Tensor
    skip: int
    rows: TokenRows


@dataclass(slots=True)
class LoadOutcome:
    """A step's verified tier blocks (staged rows), where their positions go, and what
    failed."""

    rows: torch.Tensor | None = None
    """uint8 ``[tier blocks read, block_bytes]``: the payloads as read (the rows a run names
    are verified; the others are never copied)."""
    runs: list[LoadRun] = field(default_factory=list)
    failed_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)


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
