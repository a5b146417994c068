"""Checking a batch of directory input and turning it into numpy columns, before anything is
applied (a bad entry anywhere loses nothing already stored).

A batch is checked whole by passes that run in C (``map`` over ``isinstance`` and ``len``,
``min`` / ``max``, one ``join``), with no Python code per entry. Only when one of them fails are
the entries checked one by one, in order, which raises the error of the first bad entry with the
message the directory has always given for it.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from tessera_ray.actors._directory_types import Registration, Replica, Tier, shard_of
from tessera_ray.actors._open_table import U64
from tessera_ray.core.results import BlockHash
from tessera_ray.errors import DirectoryError

__all__ = ["Batch", "check_key", "key_words", "registration_batch", "split_hashes", "only_mine"]

_KEY_BYTES = 32
_SLOTS = 1 << 32
"""Slots are stored as uint32: a pool's page index, far below 4 billion pages."""
_GENERATIONS = (-(1 << 63), 1 << 63)
"""Generations are stored as int64: a slot's count of reuses never gets near 2**63."""
_HASHES = 1 << 128
"""Block hashes are xxh3-128 digests, stored as two uint64 words."""
_TIER_VALUES = frozenset(int(t) for t in Tier)
_NO_KEYS = np.empty((0, _KEY_BYTES // 8), np.uint64)


class Batch(NamedTuple):
    """Checked registrations as columns; names (namespaces, pools) still as strings."""

    spaces: tuple[str, ...]
    words: U64
    hi: U64
    lo: U64
    pools: tuple[str, ...]
    tiers: NDArray[np.uint8]
    slots: NDArray[np.uint32]
    generations: NDArray[np.int64]


def check_key(token_key: object, shard: int, num_shards: int) -> None:
    """Refuse a key that is not 32 bytes or belongs to another shard."""
    if not isinstance(token_key, bytes) or len(token_key) != _KEY_BYTES:
        raise DirectoryError(f"a token key is 32 bytes, got {token_key!r:.40}")
    if shard_of(token_key, num_shards) != shard:
        raise DirectoryError(
            f"token key {token_key[:4].hex()}... belongs to shard "
            f"{shard_of(token_key, num_shards)}, not {shard}"
        )


def _lead_shards(blob: bytes, n: int, num_shards: int) -> NDArray[np.int64]:
    """:func:`shard_of` of each key of ``blob`` (``n`` keys of 32 bytes, concatenated)."""
    lead = np.frombuffer(blob, ">u4").reshape(n, _KEY_BYTES // 4)[:, 0]
    return lead.astype(np.int64) % num_shards


def _all_keys(token_keys: Sequence[object]) -> bytes | None:
    """The keys concatenated, when every one is 32 bytes."""
    if all(map(isinstance, token_keys, repeat(bytes))) and set(map(len, token_keys)) == {  # type: ignore[arg-type]
        _KEY_BYTES
    }:
        return b"".join(token_keys)  # type: ignore[arg-type]
    return None


def _words(token_keys: Sequence[object], shard: int, num_shards: int) -> U64 | None:
    n = len(token_keys)
    blob = _all_keys(token_keys)
    if blob is None:
        return None
    if num_shards > 1 and np.any(_lead_shards(blob, n, num_shards) != shard):
        return None
    return np.frombuffer(blob, np.uint64).reshape(n, _KEY_BYTES // 8)


def key_words(token_keys: Sequence[object], shard: int, num_shards: int) -> U64:
    """The keys as an ``(n, 4)`` array of words, each checked (:func:`check_key`)."""
    words = _words(token_keys, shard, num_shards) if token_keys else _NO_KEYS
    if words is None:
        for key in token_keys:
            check_key(key, shard, num_shards)
        raise AssertionError("the batched key check refused keys the per-key check passed")
    return words


def _mine(keys: Sequence[object], shard: int, num_shards: int) -> list[bool]:
    """Whether each key belongs to ``shard`` (of ``num_shards``)."""
    blob = _all_keys(keys)
    if blob is None:
        return [shard_of(k, num_shards) == shard for k in keys]  # type: ignore[arg-type]
    return (_lead_shards(blob, len(keys), num_shards) == shard).tolist()  # type: ignore[no-any-return]


def _ints(values: Sequence[object], dtype: type[np.integer[Any]]) -> NDArray[Any] | None:
    """``values`` as ``dtype``, when every one is an int that fits it."""
    if not all(map(isinstance, values, repeat(int))):
        return None
    try:
        return np.fromiter(values, dtype, len(values))
    except OverflowError:
        return None


def _hash_words(hashes: Sequence[object]) -> U64 | None:
    """Block hashes as ``(n, 2)`` words (low, high), when every one is an int in
    ``[0, 2**128)``: ``int.to_bytes`` refuses anything else."""
    try:
        blob = b"".join(map(int.to_bytes, hashes, repeat(16), repeat("little")))  # type: ignore[arg-type]
    except (OverflowError, TypeError):
        return None
    return np.frombuffer(blob, np.uint64).reshape(len(hashes), 2)


def split_hashes(hashes: Sequence[object]) -> tuple[U64, U64, NDArray[np.bool_]]:
    """Block hashes as high and low words, and which of them are block hashes at all (an int
    in ``[0, 2**128)``); the words of the others are 0."""
    words = _hash_words(hashes)
    valid = np.ones(len(hashes), bool)
    if words is None:
        ok = [isinstance(h, int) and 0 <= h < _HASHES for h in hashes]
        valid = np.array(ok, bool)
        words = _hash_words([h if good else 0 for h, good in zip(hashes, ok, strict=True)])
        assert words is not None
    return words[:, 1], words[:, 0], valid


_SPACE, _KEY, _HASH, _REPLICA = (itemgetter(i) for i in range(4))
_POOL, _TIER, _SLOT, _GENERATION = (
    attrgetter(f"replica.{f}") for f in ("pool", "tier", "slot", "generation")
)


def _batched(entries: Sequence[Registration], shard: int, num_shards: int) -> Batch | None:
    """The batch as columns, or ``None`` when any check fails."""
    if not all(map(isinstance, entries, repeat(Registration))):
        return None
    spaces = tuple(map(_SPACE, entries))
    words = _words(tuple(map(_KEY, entries)), shard, num_shards) if entries else _NO_KEYS
    if words is None or not all(map(isinstance, spaces, repeat(str))) or "" in spaces:
        return None
    if not all(map(isinstance, map(_REPLICA, entries), repeat(Replica))):
        return None
    pools = tuple(map(_POOL, entries))
    if not all(map(isinstance, pools, repeat(str))) or "" in pools:
        return None
    tiers = tuple(map(_TIER, entries))
    try:
        if not set(tiers) <= _TIER_VALUES:
            return None
    except TypeError:  # an unhashable tier
        return None
    slots = _ints(tuple(map(_SLOT, entries)), np.uint32)
    generations = _ints(tuple(map(_GENERATION, entries)), np.int64)
    hashes = _hash_words(tuple(map(_HASH, entries)))
    if slots is None or generations is None or hashes is None:
        return None
    return Batch(
        spaces=spaces,
        words=words,
        hi=hashes[:, 1],
        lo=hashes[:, 0],
        pools=pools,
        tiers=np.fromiter(tiers, np.uint8, len(tiers)),
        slots=slots,
        generations=generations,
    )


def _check_entry(e: Registration, shard: int, num_shards: int) -> Registration:
    """One entry checked, the first failure raised; returns it with plain field types."""
    check_key(e.token_key, shard, num_shards)
    if not isinstance(e.namespace, str) or not e.namespace:
        raise DirectoryError(f"namespace must be a non-empty str, got {e.namespace!r}")
    r = e.replica
    if not isinstance(r, Replica) or r.slot < 0 or not isinstance(r.pool, str) or not r.pool:
        raise DirectoryError(f"bad replica {r!r}: needs a pool name and a slot >= 0")
    low, high = _GENERATIONS
    if (
        not isinstance(r.slot, numbers.Integral)
        or r.slot >= _SLOTS
        or not isinstance(r.generation, numbers.Integral)
        or not low <= r.generation < high
        or r.tier not in _TIER_VALUES
    ):
        raise DirectoryError(
            f"bad replica {r!r}: needs a tier of {sorted(_TIER_VALUES)}, a slot below 2**32 "
            "and a generation that fits 64 bits"
        )
    bh = e.block_hash
    if not isinstance(bh, numbers.Integral) or not 0 <= bh < _HASHES:
        raise DirectoryError(f"bad block hash {bh!r:.60}: needs an int in [0, 2**128) (xxh3-128)")
    return Registration(
        e.namespace,
        e.token_key,
        BlockHash(int(bh)),
        Replica(r.pool, Tier(r.tier), int(r.slot), int(r.generation)),
    )


def registration_batch(entries: Sequence[Registration], shard: int, num_shards: int) -> Batch:
    """Every entry checked (namespace, key, replica, block hash), as columns."""
    batch = _batched(entries, shard, num_shards)
    if batch is None:
        plain = [_check_entry(e, shard, num_shards) for e in entries]
        batch = _batched(plain, shard, num_shards)
        if batch is None:
            raise AssertionError("the batched check refused entries the per-entry check passed")
    return batch


def only_mine(entries: Sequence[Registration], shard: int, num_shards: int) -> list[Registration]:
    """The entries whose keys belong to ``shard``."""
    keys = list(map(attrgetter("token_key"), entries))
    return list(itertools.compress(entries, _mine(keys, shard, num_shards)))
