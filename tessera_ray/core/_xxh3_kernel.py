"""XXH3-128's long path as a Triton kernel: one program per page, one pass over its bytes, read
in place from the pool tensor as 8-byte words, and the merge into the page's digest.

Imports Triton at the top, so only ``core/_xxh3.py`` imports this module, and only once
``kernel_available`` has said Triton is there. The arithmetic is the torch form's
(``_xxh3.accumulate_reference`` and ``_xxh3.merge``), on uint64 values, whose shifts are
logical. Each program carries its page's accumulators through the blocks in order, as the
scramble after every block needs the previous block's result; it loads ``GROUP_BLOCKS`` blocks
at a time so that several kilobytes per page are in flight while the scrambles run. The merge
runs in the kernel too: as a dozen torch ops on sixty-four bytes per page it would cost more
launches than the pass over the pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["GROUP_BLOCKS", "NUM_WARPS", "digest_kernel"]

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
def _mul_fold(a, b):
    # The 128-bit product of uint64 ``a`` and ``b`` from 32-bit halves, its halves xored.
    a_lo = a & 0xFFFFFFFF
    a_hi = a >> 32
    b_lo = b & 0xFFFFFFFF
    b_hi = b >> 32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + a_hi * b_hi
    lower = (cross << 32) | (lo_lo & 0xFFFFFFFF)
    return upper ^ lower


@triton.jit
def _merge_half(acc, lanes, key_ptr, start):
    # One 64-bit half of the digest: accumulator pairs (2k, 2k + 1) keyed, folded, summed.
    pair = tl.arange(0, 4)
    even = tl.sum(tl.where(lanes[None, :] == 2 * pair[:, None], acc[None, :], 0), 1)
    odd = tl.sum(tl.where(lanes[None, :] == 2 * pair[:, None] + 1, acc[None, :], 0), 1)
    key_even = tl.load(key_ptr + 2 * pair).to(tl.uint64, bitcast=True)
    key_odd = tl.load(key_ptr + 2 * pair + 1).to(tl.uint64, bitcast=True)
    h = tl.sum(_mul_fold(even ^ key_even, odd ^ key_odd), 0) + start
    h = h ^ (h >> 37)
    # The product's low 64 bits do not depend on signedness; keep the result unsigned.
    h = (h * 0x165667919E3779F9).to(tl.uint64, bitcast=True)
    return h ^ (h >> 32)


# Loop bounds need no specialising; the row length does: its divisibility tells the compiler
# how far rows are aligned, which decides how wide its loads may be.
@triton.jit(do_not_specialize=["blocks", "tail"])
def _digest(
    words_ptr,
    slots_ptr,
    stripe_ptr,
    scramble_ptr,
    last_ptr,
    init_ptr,
    merge_low_ptr,
    merge_high_ptr,
    starts_ptr,
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
    start_low = tl.load(starts_ptr).to(tl.uint64, bitcast=True)
    start_high = tl.load(starts_ptr + 1).to(tl.uint64, bitcast=True)
    low = _merge_half(acc, lanes, merge_low_ptr, start_low)
    high = _merge_half(acc, lanes, merge_high_ptr, start_high)
    tl.store(out_ptr + page * 2, low.to(tl.int64, bitcast=True))
    tl.store(out_ptr + page * 2 + 1, high.to(tl.int64, bitcast=True))


def digest_kernel(
    words: torch.Tensor,
    index: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    starts: torch.Tensor,
) -> torch.Tensor:
    """The digests ``[len(index), 2]`` (int64: low half, high half) of rows ``index`` of
    ``words``.

    ``words``: int64 ``[pages, row_words]`` (a uint8 page tensor viewed as words, rows of a
    qualifying length, ``_xxh3.rows_qualify``); ``index``: int64 ``[rows]`` page indices in
    range; ``keys``: ``(stripe [16, 8], scramble, last, init, merge_low, merge_high)`` (the
    others ``[8]``) as in ``_xxh3.XXH3Keys``; ``starts``: ``[2]``, the merges' start values for
    this row length. All int64, contiguous, on one device; checked by ``_xxh3.xxh3_128_rows``.
    """
    rows, row_words = index.numel(), words.shape[1]
    length = row_words * 8
    blocks = (length - 1) // 1024
    tail = ((length - 1) - blocks * 1024) // 64
    out = torch.empty((rows, 2), dtype=torch.int64, device=words.device)
    _digest[(rows,)](
        words,
        index,
        *keys,
        starts,
        out,
        row_words,
        blocks,
        tail,
        GROUP=GROUP_BLOCKS,
        num_warps=NUM_WARPS,
    )
    return out
