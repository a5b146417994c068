"""XXH3-128's long-path accumulation as a Triton kernel: one program per page, one pass over its
bytes, read in place from the pool tensor as 8-byte words.

Imports Triton at the top, so only ``core/_xxh3.py`` imports this module, and only after
``kernel_available`` said Triton is there. The merge of the eight accumulators into the
digest stays in torch (``_xxh3.merge``): sixty-four bytes per page, not worth a second kernel.
Each program carries its page's accumulators through the blocks in order, as the scramble
after every block needs the previous block's result; it loads ``GROUP_BLOCKS`` blocks at a
time so that several kilobytes per page are in flight while the scrambles run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["GROUP_BLOCKS", "NUM_WARPS", "accumulate_kernel"]

GROUP_BLOCKS = 4
"""1,024-byte blocks one program loads per step (a power of two, as ``tl.arange`` needs)."""

NUM_WARPS = 4
"""Warps per program: ``GROUP_BLOCKS * 128`` words spread over their threads."""


@triton.jit
def _products(w, key):
    # XXH3's 32x32->64 multiply of the two halves of ``w ^ key``, in uint64.
    dk = w ^ key
    return (dk & 0xFFFFFFFF) * (dk >> 32)


@triton.jit
def _crosswise(values, swap):
    # ``values[r, i]`` moved to lane ``i ^ 1`` of row ``r`` (``swap[i, j]``: whether i feeds
    # j): a masked sum, as a tensor's lanes cannot be permuted by an index.
    spread = values[:, :, None]
    return tl.sum(tl.where(swap[None, :, :], spread, 0), 1)


@triton.jit
def _accumulate(
    words_ptr,
    slots_ptr,
    stripe_ptr,
    scramble_ptr,
    last_ptr,
    init_ptr,
    out_ptr,
    row_words,
    blocks,
    tail,
    GROUP: tl.constexpr,
):
    page = tl.program_id(0)
    row = words_ptr + tl.load(slots_ptr + page) * row_words
    lanes = tl.arange(0, 8)
    stripes = tl.arange(0, 16)
    group = tl.arange(0, GROUP)
    tile = stripes[:, None] * 8 + lanes[None, :]
    swap = (lanes[:, None] ^ 1) == lanes[None, :]
    key = tl.load(stripe_ptr + tile).to(tl.uint64, bitcast=True)
    scramble_key = tl.load(scramble_ptr + lanes).to(tl.uint64, bitcast=True)
    acc = tl.load(init_ptr + lanes).to(tl.uint64, bitcast=True)
    for first in range(0, blocks, GROUP):
        index = first + group
        inside = index < blocks
        offsets = index[:, None, None] * 128 + tile[None, :, :]
        w = tl.load(row + offsets, mask=inside[:, None, None], other=0)
        w = w.to(tl.uint64, bitcast=True)
        adds = tl.sum(_products(w, key[None, :, :]), 1) + _crosswise(tl.sum(w, 1), swap)
        for k in tl.static_range(GROUP):
            add = tl.sum(tl.where((group == k)[:, None], adds, 0), 0)
            mixed = acc + add
            mixed = (mixed ^ (mixed >> 47)) ^ scramble_key
            mixed = mixed * 0x9E3779B1
            acc = tl.where(first + k < blocks, mixed, acc)
    # The block holding the last byte: its whole stripes, never scrambled.
    partial = (stripes < tail)[:, None]
    tail_w = tl.load(row + blocks * 128 + tile, mask=partial, other=0)
    tail_w = tail_w.to(tl.uint64, bitcast=True)
    tail_products = tl.where(partial, _products(tail_w, key), 0)
    acc += tl.sum(tail_products, 0) + tl.sum(_crosswise(tl.sum(tail_w, 0)[None, :], swap), 0)
    # The last stripe: the final 64 bytes, under their own key.
    last_w = tl.load(row + row_words - 8 + lanes).to(tl.uint64, bitcast=True)
    last_key = tl.load(last_ptr + lanes).to(tl.uint64, bitcast=True)
    acc += _products(last_w, last_key) + tl.sum(_crosswise(last_w[None, :], swap), 0)
    tl.store(out_ptr + page * 8 + lanes, acc.to(tl.int64, bitcast=True))


def accumulate_kernel(
    words: torch.Tensor,
    index: torch.Tensor,
    stripe: torch.Tensor,
    scramble: torch.Tensor,
    last: torch.Tensor,
    init: torch.Tensor,
) -> torch.Tensor:
    """The accumulators ``[len(index), 8]`` (int64) of rows ``index`` of ``words``.

    ``words``: int64 ``[pages, row_words]`` (a uint8 page tensor viewed as words, rows of a
    qualifying length, ``_xxh3.rows_qualify``); ``index``: int64 ``[rows]`` page indices in
    range; the keys as in ``_xxh3.XXH3Keys`` (``stripe [16, 8]``, the others ``[8]``). All
    contiguous, on one device; checked by the caller, ``_xxh3.xxh3_128_rows``.
    """
    rows, row_words = index.numel(), words.shape[1]
    length = row_words * 8
    blocks = (length - 1) // 1024
    tail = ((length - 1) - blocks * 1024) // 64
    out = torch.empty((rows, 8), dtype=torch.int64, device=words.device)
    _accumulate[(rows,)](
        words,
        index,
        stripe,
        scramble,
        last,
        init,
        out,
        row_words,
        blocks,
        tail,
        GROUP=GROUP_BLOCKS,
        num_warps=NUM_WARPS,
    )
    return out
