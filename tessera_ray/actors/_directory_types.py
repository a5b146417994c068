"""What crosses the directory's boundary: replicas, registrations, lookup answers, and which
shard owns a key. Public through :mod:`tessera_ray.actors.directory`; kept apart from the shard
so that the input checks (:mod:`~tessera_ray.actors._directory_input`) can name them.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import ClassVar, NamedTuple, overload

import numpy as np

from tessera_ray.actors._directory_index import Found
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = [
    "Tier",
    "Replica",
    "Registration",
    "LookupResult",
    "Holder",
    "LookupAnswer",
    "Registrations",
    "shard_of",
]


class Tier(enum.IntEnum):
    """Where a replica lives inside its pool."""

    MEMORY = 0
    DISK = 1


class Replica(NamedTuple):
    """One copy of a block: on pool ``pool``, in ``tier``, at pool-local ``slot``.

    ``Replica``, ``Registration`` and ``LookupResult`` are named tuples, as the pool's
    ``SealResult``: a fetch builds one per block on the far side of a pickle, and a frozen
    dataclass costs several times more to build.

    ``generation`` is the pool's generation of that slot when the replica was registered; the
    pool rejects a pin whose generation is stale, so a reused slot never answers for old data.
    """

    pool: str
    tier: Tier
    slot: int
    generation: int


class Registration(NamedTuple):
    """``token_key`` (under ``namespace``) names block ``block_hash``, held by ``replica``."""

    namespace: str
    token_key: TokenKey
    block_hash: BlockHash
    replica: Replica


class LookupResult(NamedTuple):
    """A hit: the block a token key names and every live replica of it."""

    token_key: TokenKey
    block_hash: BlockHash
    replicas: tuple[Replica, ...]


class Holder(NamedTuple):
    """A replica as a reader pulls from it: pool ``pool`` holds the block in ``tier`` (the
    slot is the pool's own business). What a lookup's answer says per block when it travels on
    to whoever reads, so that the reader does not ask the directory again."""

    pool: str
    tier: Tier

    @staticmethod
    def of(result: LookupResult) -> tuple[Holder, ...]:
        return tuple(Holder(r.pool, r.tier) for r in result.replicas)


_TIERS = tuple(sorted(Tier))
"""``Tier`` by value (0, 1, ...), indexed: cheaper than calling ``Tier(value)`` per replica."""
assert all(t == i for i, t in enumerate(_TIERS)), "Tier values must be 0, 1, ... to index"


def _interned(names: dict[str, int], name: str) -> int:
    i = names.get(name)
    if i is None:
        i = names[name] = len(names)
    return i


_AnswerColumns = tuple[
    int,
    list[int],
    list[TokenKey],
    list[int],
    list[int],
    list[int],
    list[int],
    tuple[str, ...],
    list[int],
    list[int],
    list[int],
]
"""The arguments of ``_lookup_answer``: what a :class:`LookupAnswer` stands for."""

_PACKED = ("<i8", "<u8", "<u8", "<i8", "<u2", "<u1", "<u4", "<i8")
"""Dtypes of the numeric columns as a pickled answer carries them (positions, hash words,
replica counts, pools, tiers, slots, generations), each as plain bytes: not numpy arrays, which
Ray ships as out-of-band buffers of their own (costly for the few hits of a small lookup), and
not lists of ints, which pickle an object per value."""


class LookupAnswer(Sequence[LookupResult | None]):
    """A shard's answer to one lookup: a :class:`LookupResult` or ``None`` per key, aligned
    with the keys, kept as the columns the shard's tables gave (:class:`Found`).

    Why columns: a shard that probes a batch of keys in a few numpy passes cannot afford to
    build a result and a tuple of replicas per key (docs/directory.md has what building them
    costs). The results are built on first access, all at once, and the answer pickles as the
    columns, so a shard actor never builds them at all. Pickling frozen slotted dataclasses
    runs Python code per object, an order of magnitude more than flat columns
    (docs/measured-choices.md). The answer unpickles as a plain ``list``; in-process it
    compares equal to the list it stands for.
    """

    __slots__ = ("_built", "_found", "_keys", "_pool_names")
    __hash__: ClassVar[None]  # type: ignore[assignment]

    def __init__(
        self, token_keys: list[TokenKey], found: Found, pool_names: tuple[str, ...]
    ) -> None:
        self._keys = token_keys
        self._found = found
        self._pool_names = pool_names
        self._built: list[LookupResult | None] | None = None

    def _results(self) -> list[LookupResult | None]:
        if self._built is None:
            self._built = _lookup_answer(*self._columns())
        return self._built

    def _columns(self) -> _AnswerColumns:
        f = self._found
        positions = f.positions.tolist()
        return (
            len(self._keys),
            positions,
            list(map(self._keys.__getitem__, positions)),
            f.hi.tolist(),
            f.lo.tolist(),
            f.counts.tolist(),
            f.pools.tolist(),
            self._pool_names,
            f.tiers.tolist(),
            f.slots.tolist(),
            f.generations.tolist(),
        )

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> LookupResult | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[LookupResult | None]: ...

    def __getitem__(self, index: int | slice) -> LookupResult | list[LookupResult | None] | None:
        return self._results()[index]

    def __iter__(self) -> Iterator[LookupResult | None]:
        return iter(self._results())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LookupAnswer):
            other = other._results()
        if isinstance(other, list):
            return self._results() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"LookupAnswer({self._results()!r})"

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        f = self._found
        numeric = (f.positions, f.hi, f.lo, f.counts, f.pools, f.tiers, f.slots, f.generations)
        packed = [
            np.ascontiguousarray(a, d).tobytes() for a, d in zip(numeric, _PACKED, strict=True)
        ]
        keys = list(map(self._keys.__getitem__, f.positions.tolist()))
        return _unpacked_answer, (len(self._keys), keys, self._pool_names, *packed)


def _unpacked_answer(
    n: int, keys: list[TokenKey], pools: tuple[str, ...], *packed: bytes
) -> list[LookupResult | None]:
    """The list a pickled :class:`LookupAnswer` stood for."""
    positions, hi, lo, counts, rep_pools, tiers, slots, gens = (
        np.frombuffer(b, d).tolist() for b, d in zip(packed, _PACKED, strict=True)
    )
    return _lookup_answer(n, positions, keys, hi, lo, counts, rep_pools, pools, tiers, slots, gens)


def _lookup_answer(
    n: int,
    positions: list[int],
    keys: list[TokenKey],
    hi: list[int],
    lo: list[int],
    counts: list[int],
    rep_pools: list[int],
    pools: tuple[str, ...],
    tiers: list[int],
    slots: list[int],
    gens: list[int],
) -> list[LookupResult | None]:
    """The results the columns of a :class:`LookupAnswer` stand for.

    Built with ``map`` over C-level callables, with no Python code run per key: a named tuple's
    own constructor is a Python function, ``tuple.__new__`` on its class is not (it is what
    ``_make`` calls), and it builds the same object."""
    reps = list(
        map(
            _new_replica,
            zip(
                map(pools.__getitem__, rep_pools),
                map(_TIERS.__getitem__, tiers),
                slots,
                gens,
                strict=True,
            ),
        )
    )
    if counts.count(1) == len(counts):
        held: Iterable[tuple[Replica, ...]] = zip(reps)  # one replica each: 1-tuples
    else:
        ends = list(itertools.accumulate(counts))
        held = map(tuple, map(reps.__getitem__, map(slice, [0, *ends[:-1]], ends)))
    hashes = map(int.__or__, map(int.__lshift__, hi, repeat(64)), lo)
    results = map(_new_result, zip(keys, hashes, held, strict=True))
    if len(positions) == n:
        return list(results)
    out: list[LookupResult | None] = [None] * n
    collections.deque(map(out.__setitem__, positions, results), maxlen=0)
    return out


_new_replica = functools.partial(tuple.__new__, Replica)
_new_result = functools.partial(tuple.__new__, LookupResult)


class Registrations(list[Registration]):
    """A batch of :class:`Registration` that pickles as flat columns (why: see
    :class:`LookupAnswer`; a fetch of 512 blocks registers 512). Unpickles as a plain list."""

    __slots__ = ()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        spaces: dict[str, int] = {}
        pools: dict[str, int] = {}
        ns = [_interned(spaces, e.namespace) for e in self]
        rep_pools = [_interned(pools, e.replica.pool) for e in self]
        return _registrations, (
            list(spaces),
            ns,
            [e.token_key for e in self],
            [e.block_hash for e in self],
            list(pools),
            rep_pools,
            [int(e.replica.tier) for e in self],
            [e.replica.slot for e in self],
            [e.replica.generation for e in self],
        )


def _registrations(
    spaces: list[str],
    ns: list[int],
    keys: list[TokenKey],
    hashes: list[BlockHash],
    pools: list[str],
    rep_pools: list[int],
    tiers: list[int],
    slots: list[int],
    gens: list[int],
) -> list[Registration]:
    """The list a pickled :class:`Registrations` stood for."""
    return [
        Registration(spaces[n], key, bh, Replica(pools[p], _TIERS[t], slot, gen))
        for n, key, bh, p, t, slot, gen in zip(
            ns, keys, hashes, rep_pools, tiers, slots, gens, strict=True
        )
    ]


def shard_of(token_key: bytes, num_shards: int) -> int:
    """The shard owning ``token_key``: keys are sha256 output, so the first bytes are uniform."""
    return int.from_bytes(token_key[:4], "big") % num_shards
