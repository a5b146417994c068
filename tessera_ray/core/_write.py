"""Copy-on-write: writing through a sealed page moves the writer's reference to a private copy.

Sealed pages are immutable because other holders (and the dedup index) rely on their bytes;
a writer that holds a reference gets a fresh writable page with the same bytes instead, and
every other holder keeps the old ones. All checks run before any byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tessera_ray.core._bytes import copy_rows
from tessera_ray.core._records import SEALED, WRITABLE, PageRecord
from tessera_ray.core._refs import decref, need_free
from tessera_ray.core._validate import check_raw_write, check_region_write
from tessera_ray.core.results import PageHandle
from tessera_ray.errors import PageDTypeError, PageNotFreeableError, PageShapeError

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["write", "write_many", "write_region", "fork", "writable"]


def _copy_of(pool: BlockPool, src: PageRecord) -> PageRecord:
    """A fresh writable page (refcount 1) holding ``src``'s bytes; a page must be free."""
    rec = pool._free.pop_front()
    assert rec is not None
    rec.state, rec.refcount = WRITABLE, 1
    pool.data[rec.index].copy_(pool.data[src.index])
    return rec


def writable(pool: BlockPool, rec: PageRecord) -> PageRecord:
    """``rec`` itself when writable, else a private copy that takes over one reference."""
    if rec.state == WRITABLE:
        return rec
    if rec.refcount == 0:
        raise PageNotFreeableError(
            f"page {rec.index} holds no reference to write through; share() it first"
        )
    need_free(pool, 1)
    copy = _copy_of(pool, rec)
    decref(pool, rec)
    return copy


def write(pool: BlockPool, handle: PageHandle, data: torch.Tensor, offset: int) -> PageHandle:
    """``data`` into the page from byte ``offset``; the handle to use from now on."""
    rec = pool._resolve(handle)
    check_raw_write(data, offset, pool.page_bytes)
    target = writable(pool, rec)
    pool.data[target.index, offset : offset + data.numel()].copy_(data)
    return handle if target is rec else pool._handle(target)


def write_many(
    pool: BlockPool, handles: Sequence[PageHandle], data: torch.Tensor
) -> list[PageHandle]:
    """``data[i]`` into ``handles[i]`` (whole pages); the handles to use from now on."""
    recs = pool._distinct(handles)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise PageDTypeError("write_many takes a uint8 tensor [pages, page_bytes]")
    if tuple(data.shape) != (len(recs), pool.page_bytes):
        raise PageShapeError(
            f"write_many of {len(recs)} pages takes [{len(recs)}, {pool.page_bytes}], "
            f"got {tuple(data.shape)}"
        )
    for r in recs:
        if r.state == SEALED and r.refcount == 0:
            raise PageNotFreeableError(f"page {r.index} holds no reference to write through")
    need_free(pool, sum(r.state == SEALED for r in recs))  # one fresh page per fork
    targets = [writable(pool, r) for r in recs]
    copy_rows(pool.data, [r.index for r in targets], data)
    return [
        h if t is r else pool._handle(t) for h, r, t in zip(handles, recs, targets, strict=True)
    ]


def write_region(
    pool: BlockPool, handle: PageHandle, region: str, data: torch.Tensor, start_entry: int
) -> PageHandle:
    """``data`` into entries ``start_entry ..`` of one region; the handle to use from now on."""
    rec = pool._resolve(handle)
    check_region_write(pool.page_spec, region, data, start_entry)
    end = start_entry + data.shape[0]
    target = writable(pool, rec)
    pool.region_view(region)[target.index, start_entry:end].copy_(data)
    return handle if target is rec else pool._handle(target)


def fork(pool: BlockPool, handle: PageHandle) -> PageHandle:
    """A private writable copy of the page; the source and its references are untouched."""
    src = pool._resolve(handle)
    need_free(pool, 1)
    return pool._handle(_copy_of(pool, src))
