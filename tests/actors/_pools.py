"""What the PoolService tests share: a tiny MLA layout, a settable clock, chained keys,
random payloads, and running a coroutine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from tessera_ray.actors.pool_service import PoolService
from tessera_ray.core import token_key
from tessera_ray.layout import MLAConfig, build_layout

LAYOUT = build_layout(MLAConfig(name="tiny-mla", num_layers=2, num_heads=4))
NS = "tenant-a"
T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, ns: str = NS, start: int = 0) -> list[bytes]:
    out, parent = [], None
    for i in range(start, start + n):
        parent = token_key(ns, LAYOUT.fingerprint, parent, [i] * 64)
        out.append(parent)
    return out


def payloads(n: int, seed: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def rot(pool: PoolService, key: bytes, group: int = 0, page: int = 1) -> None:
    """Flip a byte of one page of ``key``'s block in the pool's memory, as bad RAM would."""
    handles = pool.pools[group].lookup(NS, key)
    assert handles is not None
    slot = handles[page].offset // handles[page].length
    pool.pools[group].data[slot, 17] ^= 0x08
    pool.pools[group].release_many(list(handles))
