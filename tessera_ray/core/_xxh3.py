"""XXH3-128 of many pages at once, computed where the pages are (any torch device).

The content hash of a page is the seeded XXH3-128 of its bytes (``core/hashing.py``). Pages in
device memory are hashed here, on the device, into exactly the digest the host computes, so a
page keeps one key in a GPU pool, a host pool and on disk without its bytes crossing to the
host. Only XXH3's long-input path is implemented (inputs over 240 bytes): pages are kilobytes.

Written from the XXH3 specification. All arithmetic is on ``int64`` tensors, whose
two's-complement wrap-around is arithmetic modulo 2**64, the unsigned arithmetic XXH3 is
defined in; right shifts mask off the copied sign bits to stay logical. The input is read as
little-endian 8-byte words (a ``uint8`` row viewed as ``int64``), which is what every torch
device is.

The long path in one paragraph: eight 64-bit accumulators take the input in 64-byte stripes;
each stripe adds its eight words crosswise (word ``i`` into accumulator ``i ^ 1``) plus, per
word, the 32x32-bit product of the halves of ``word ^ key``. Sixteen stripes make a 1,024-byte
block, after which every accumulator is scrambled. Within a block the additions commute, so a
block's sixteen stripes reduce in one sum and only the scramble runs block after block. The
block holding the last byte is never scrambled; its whole stripes, then the input's final 64
bytes (the "last stripe", under its own key), are accumulated and the accumulators merged
into two 64-bit halves.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera_ray.errors import PageBoundsError, PageDTypeError, PageShapeError

__all__ = [
    "MIN_BYTES",
    "XXH3Keys",
    "accumulate_reference",
    "keys_for",
    "merge",
    "merge_starts",
    "rows_qualify",
    "xxh3_128_rows",
]

MIN_BYTES = 241
"""Shortest input of XXH3's long path; shorter ones take paths not implemented here."""

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_PRIME32_1 = 0x9E3779B1
_PRIME32_2 = 0x85EBCA77
_PRIME32_3 = 0xC2B2AE3D
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME64_2 = 0xC2B2AE3D27D4EB4F
_PRIME64_3 = 0x165667B19E3779F9
_PRIME64_4 = 0x85EBCA77C2B2AE63
_PRIME64_5 = 0x27D4EB2F165667C5
_PRIME_MX1 = 0x165667919E3779F9

_LANES = 8
_STRIPE_BYTES = 64
_STRIPES_PER_BLOCK = 16
_BLOCK_BYTES = _STRIPE_BYTES * _STRIPES_PER_BLOCK
_BLOCK_WORDS = _BLOCK_BYTES // 8
# Offsets into the 192-byte secret that the specification fixes for each use.
_SCRAMBLE_AT = 192 - _STRIPE_BYTES
_LAST_STRIPE_AT = 192 - _STRIPE_BYTES - 7
_MERGE_LOW_AT = 11
_MERGE_HIGH_AT = 192 - _STRIPE_BYTES - 11
_ACC_INIT = (
    _PRIME32_3,
    _PRIME64_1,
    _PRIME64_2,
    _PRIME64_3,
    _PRIME64_4,
    _PRIME32_2,
    _PRIME64_5,
    _PRIME32_1,
)
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
"""XXH3's default 192-byte secret; a seed shifts its 8-byte words (see ``_seeded_secret``)."""

_SWAP = (1, 0, 3, 2, 5, 4, 7, 6)
"""Which accumulator each word of a stripe is added to: lane ``i`` feeds lane ``i ^ 1``."""

_ROW_CHUNK_BYTES = 64 << 20
"""Input bytes the torch path takes per step: bounds its temporaries (a few times this)."""


def _signed(x: int) -> int:
    """``x`` mod 2**64 as the int64 with the same bits (how torch holds a uint64)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _words(secret: bytes, at: int, count: int) -> list[int]:
    """``count`` little-endian 64-bit words of ``secret`` from byte ``at`` (any alignment)."""
    return [int.from_bytes(secret[at + 8 * i : at + 8 * i + 8], "little") for i in range(count)]


@functools.lru_cache(maxsize=256)
def _seeded_secret(seed: int) -> bytes:
    """The secret a seeded hash runs with: the seed added to even 8-byte words of the default
    secret and subtracted from odd ones (a zero seed leaves it as it is)."""
    words = _words(_SECRET, 0, len(_SECRET) // 8)
    return b"".join(
        ((w + seed if i % 2 == 0 else w - seed) & _M64).to_bytes(8, "little")
        for i, w in enumerate(words)
    )


@dataclass(frozen=True, slots=True)
class XXH3Keys:
    """Every per-seed constant of the long path, as int64 tensors on one device.

    ``stripe[n, i]`` keys word ``i`` of stripe ``n`` of a block (secret word ``n + i``);
    ``scramble`` keys the end-of-block scramble, ``last`` the last stripe; ``merge_low`` and
    ``merge_high`` key the two halves' merges; ``init`` is the accumulators' start.
    """

    stripe: torch.Tensor
    scramble: torch.Tensor
    last: torch.Tensor
    merge_low: torch.Tensor
    merge_high: torch.Tensor
    init: torch.Tensor

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """The keys in the order the Triton kernel takes them."""
        return (
            self.stripe,
            self.scramble,
            self.last,
            self.init,
            self.merge_low,
            self.merge_high,
        )


def keys_for(seed: int, device: torch.device) -> XXH3Keys:
    """The keys of ``seed`` (``0 <= seed < 2**64``) on ``device``."""
    # Checked outside the cache, which would take True for a cached 1.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _M64:
        raise PageShapeError(f"a content-hash seed is an int in [0, 2**64), got {seed!r}")
    return _keys(seed, device)


@functools.lru_cache(maxsize=64)
def _keys(seed: int, device: torch.device) -> XXH3Keys:
    # Cached: a pool hashes under a handful of seeds (one per namespace), and each copy of
    # the keys to a device costs a synchronisation.
    secret = _seeded_secret(seed)
    words = _words(secret, 0, _STRIPES_PER_BLOCK + _LANES - 1)

    def tensor(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor([_signed(v) for v in values], dtype=torch.int64, device=device)

    stripe = [words[n + i] for n in range(_STRIPES_PER_BLOCK) for i in range(_LANES)]
    return XXH3Keys(
        stripe=tensor(stripe).view(_STRIPES_PER_BLOCK, _LANES),
        scramble=tensor(_words(secret, _SCRAMBLE_AT, _LANES)),
        last=tensor(_words(secret, _LAST_STRIPE_AT, _LANES)),
        merge_low=tensor(_words(secret, _MERGE_LOW_AT, _LANES)),
        merge_high=tensor(_words(secret, _MERGE_HIGH_AT, _LANES)),
        init=tensor(_ACC_INIT),
    )


@functools.lru_cache(maxsize=64)
def _starts(row_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(merge_starts(row_bytes), dtype=torch.int64, device=device)


def rows_qualify(row_bytes: int) -> bool:
    """Whether rows of ``row_bytes`` bytes can be hashed here: the long path, whole words."""
    return row_bytes >= MIN_BYTES and row_bytes % 8 == 0


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x``: the arithmetic shift with the sign copies masked."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _stripe_sums(w: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """What stripes ``w [..., stripes, 8]`` under ``key [stripes, 8]`` add to the accumulators,
    summed over the stripes: ``[..., 8]``."""
    dk = w ^ key
    products = (dk & _M32) * _shr(dk, 32)
    return products.sum(-2) + w.sum(-2).index_select(-1, _swap_index(w.device))


@functools.lru_cache(maxsize=8)
def _swap_index(device: torch.device) -> torch.Tensor:
    return torch.tensor(_SWAP, dtype=torch.int64, device=device)


def _scramble(acc: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return ((acc ^ _shr(acc, 47)) ^ key) * _PRIME32_1


def accumulate_reference(words: torch.Tensor, keys: XXH3Keys) -> torch.Tensor:
    """The accumulators ``[rows, 8]`` (int64) after the long path over ``words``.

    ``words``: int64 ``[rows, row_bytes // 8]``, each row one input as little-endian words,
    ``row_bytes`` qualifying (:func:`rows_qualify`); ``keys`` on the same device.
    """
    rows, num_words = words.shape
    length = num_words * 8
    blocks = (length - 1) // _BLOCK_BYTES
    tail = ((length - 1) - blocks * _BLOCK_BYTES) // _STRIPE_BYTES
    acc = keys.init.expand(rows, _LANES)
    if blocks:
        full = words[:, : blocks * _BLOCK_WORDS].reshape(rows, blocks, _STRIPES_PER_BLOCK, _LANES)
        adds = _stripe_sums(full, keys.stripe)
        for b in range(blocks):
            acc = _scramble(acc + adds[:, b], keys.scramble)
    at = blocks * _BLOCK_WORDS
    if tail:
        part = words[:, at : at + tail * _LANES].reshape(rows, tail, _LANES)
        acc = acc + _stripe_sums(part, keys.stripe[:tail])
    last = words[:, num_words - _LANES :].reshape(rows, 1, _LANES)
    return acc + _stripe_sums(last, keys.last.view(1, _LANES))


def _mul_fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The 128-bit product of unsigned 64-bit ``a`` and ``b``, its halves xored together;
    built from 32-bit halves, as no torch dtype holds 128 bits."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, _shr(a, 32), b & _M32, _shr(b, 32)
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    # Cannot carry out of 64 bits: (2**32 - 1)**2 + 2 * (2**32 - 1) == 2**64 - 1.
    cross = _shr(lo_lo, 32) + (hi_lo & _M32) + lo_hi
    upper = _shr(hi_lo, 32) + _shr(cross, 32) + hi_hi
    lower = (cross << 32) | (lo_lo & _M32)
    return upper ^ lower


def _avalanche(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shr(h, 37)
    h = h * _signed(_PRIME_MX1)
    return h ^ _shr(h, 32)


def _merge_half(acc: torch.Tensor, key: torch.Tensor, start: int) -> torch.Tensor:
    folded = _mul_fold(acc[:, 0::2] ^ key[0::2], acc[:, 1::2] ^ key[1::2])
    return _avalanche(folded.sum(-1) + start)


def merge_starts(row_bytes: int) -> tuple[int, int]:
    """Where the merges of the low and the high half start, for inputs ``row_bytes`` long (as
    the int64 values with their bits)."""
    return _signed(row_bytes * _PRIME64_1), _signed(~(row_bytes * _PRIME64_2))


def merge(acc: torch.Tensor, keys: XXH3Keys, row_bytes: int) -> torch.Tensor:
    """The digests ``[rows, 2]`` (int64: low half, high half) of accumulators ``acc [rows, 8]``
    of inputs ``row_bytes`` long."""
    start_low, start_high = merge_starts(row_bytes)
    low = _merge_half(acc, keys.merge_low, start_low)
    high = _merge_half(acc, keys.merge_high, start_high)
    return torch.stack([low, high], dim=1)


def _check(data: torch.Tensor, slots: Sequence[int]) -> None:
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise PageDTypeError(
            f"pages are a uint8 [pages, bytes] tensor, got {data.dtype} {tuple(data.shape)}"
        )
    if not data.is_contiguous() or data.storage_offset() % 8:
        raise PageShapeError("pages must be one contiguous tensor whose rows start on 8 bytes")
    if not rows_qualify(data.shape[1]):
        raise PageShapeError(
            f"pages of {data.shape[1]} B are hashed on the host: the device hash takes pages "
            f"of at least {MIN_BYTES} B in whole 8-byte words"
        )
    if slots and (min(slots) < 0 or max(slots) >= data.shape[0]):
        raise PageBoundsError(f"slots must be pages of a {data.shape[0]}-page tensor")


def xxh3_128_rows(
    data: torch.Tensor, slots: Sequence[int], seed: int, *, kernel: bool = False
) -> list[int]:
    """``xxhash.xxh3_128_intdigest(bytes(data[s]), seed)`` for each row ``s`` in ``slots``, in
    order, computed on ``data``'s device.

    ``data``: ``uint8 [pages, page_bytes]``, contiguous, ``page_bytes`` qualifying
    (:func:`rows_qualify`); ``slots``: row indices; ``seed``: ``0 <= seed < 2**64``.
    ``kernel``: run the Triton kernel (``core/_xxh3_kernel.py``; the caller checks it imports)
    instead of the torch ops of :func:`accumulate_reference` and :func:`merge`.
    """
    _check(data, slots)
    if not slots:
        return []
    keys = keys_for(seed, data.device)
    words = data.view(torch.int64)
    row_bytes = data.shape[1]
    index = torch.tensor(slots, dtype=torch.int64, device=data.device)
    if kernel:
        from tessera_ray.core._xxh3_kernel import digest_kernel

        digests = digest_kernel(words, index, keys.kernel_args(), _starts(row_bytes, data.device))
    else:
        step = max(1, _ROW_CHUNK_BYTES // row_bytes)
        digests = torch.cat(
            [
                merge(accumulate_reference(words.index_select(0, part), keys), keys, row_bytes)
                for part in torch.split(index, step)
            ]
        )
    return [((hi & _M64) << 64) | (lo & _M64) for lo, hi in digests.tolist()]
