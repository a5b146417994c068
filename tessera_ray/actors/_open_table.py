"""Rows in numpy columns and an open-addressing index over them: storage with no Python object
per entry, for the directory shard (:mod:`~tessera_ray.actors._directory_index`).

Why not dicts: a dict of tuples costs a Python object, with its header and pointers, per
directory entry and Python code per key looked up; these tables cost the fields' own bytes and
some slack, and a batch of keys is probed in a few numpy passes (docs/directory.md has the
layout and the figures).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

__all__ = ["Rows", "SlotIndex", "mix64", "I64", "U64"]

I64 = NDArray[np.int64]
U64 = NDArray[np.uint64]

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix64(x: U64) -> U64:
    """The splitmix64 finalizer: every input bit moves every output bit, so small or structured
    inputs (block hashes 0, 1, 2 in tests; namespace ids) spread over the slots as uniformly as
    random ones. Numpy's uint64 arithmetic on arrays wraps, which is what the mix wants."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return x


class Rows:
    """Fixed-width records in one numpy structured array, allocated densely, with freed rows kept
    for reuse.

    One record per row, not one array per field: a probe or a lookup touches every field of a
    row it visits, and in a table far larger than the CPU caches each array visited is a cache
    miss of its own.

    Capacity grows by ``growth`` (1.125, not doubled): right after a growth the unused rows are
    slack that counts against the bytes per entry. The copies that small steps cost add up to
    a few times the final size, once. Which rows are free is the owner's to mark in its own
    fields; this class only hands out row numbers. A field is read through ``self[name]`` (or
    records through :attr:`data`) each time, never kept: a growth replaces the array.
    """

    def __init__(self, dtype: DTypeLike, *, growth: float = 1.125, initial_rows: int = 64) -> None:
        assert growth > 1.0
        self._growth = growth
        self.data = np.zeros(initial_rows, dtype)
        self.size = 0
        """Rows ever handed out (the high-water mark); rows ``>= size`` are unused capacity."""
        self._free = np.empty(0, np.int64)
        self._num_free = 0

    def __getitem__(self, name: str) -> NDArray[Any]:
        return self.data[name]

    @property
    def capacity(self) -> int:
        return len(self.data)

    @property
    def live(self) -> int:
        """Rows handed out and not released."""
        return self.size - self._num_free

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self._free.nbytes

    def alloc(self, n: int) -> I64:
        """``n`` row numbers: freed rows first, then new ones (growing the array)."""
        take = min(n, self._num_free)
        reused = self._free[self._num_free - take : self._num_free].copy()
        self._num_free -= take
        fresh = n - take
        if self.size + fresh > self.capacity:
            grown = np.zeros(
                max(self.size + fresh, math.ceil(self.capacity * self._growth)), self.data.dtype
            )
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        rows = np.concatenate((reused, np.arange(self.size, self.size + fresh, dtype=np.int64)))
        self.size += fresh
        return rows

    def release(self, rows: I64) -> None:
        """Take back ``rows`` (distinct, handed out, not yet released) for reuse."""
        end = self._num_free + len(rows)
        if end > len(self._free):
            grown = np.empty(max(end, int(len(self._free) * self._growth) + 1024), np.int64)
            grown[: self._num_free] = self._free[: self._num_free]
            self._free = grown
        self._free[self._num_free : end] = rows
        self._num_free = end


EMPTY = -1
_TOMBSTONE = -2
_WINDOW = np.arange(8, dtype=np.int64)
"""Slots a probe looks at per pass: most probes end within the first few slots, and a pass costs
the same numpy calls whatever its width, so a batch needs a few passes rather than one per slot
of its longest probe run."""


class SlotIndex:
    """Linear probing from a 64-bit hash to a row number; the owner keeps the rows, and says how
    to hash them and whether a row is the one a probe looks for.

    A slot is a 4-byte row number and a 1-byte tag (8 bits of the hash), so keeping the load at
    most ``max_load`` costs a few bytes per entry. A probe looks at a window of slots per pass
    and asks the owner about a row only where the tag matches. A removed entry leaves a
    tombstone (a probe walks past it, an insert reuses it); :meth:`rebuild` clears them. The
    first slot is the hash's top 32 bits scaled to the table (multiply-shift), so the table need
    not be a power of two and can grow by ``growth``.
    """

    def __init__(self, *, max_load: float = 0.7, growth: float = 1.4) -> None:
        self.max_load = max_load
        self.growth = growth
        self._slots = np.full(64, EMPTY, np.int32)
        self._tags = np.zeros(64, np.uint8)
        self._live = 0
        self._tombstones = 0

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + self._tags.nbytes

    def _start(self, h: U64) -> I64:
        return ((h >> np.uint64(32)) * np.uint64(len(self._slots)) >> np.uint64(32)).astype(
            np.int64
        )

    @staticmethod
    def _tag(h: U64) -> NDArray[np.uint8]:
        return h.astype(np.uint8)  # the low byte; the start uses the high bits

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more entries keep the load (tombstones included) within bounds."""
        return self._live + self._tombstones + extra <= self.max_load * len(self._slots)

    def rebuild(self, h: U64, rows: I64, extra: int) -> None:
        """Start over with every live entry (``rows``, hashed ``h``), sized so that ``extra``
        more fit and the load then sits at ``max_load / growth``."""
        target = self.max_load / self.growth
        size = max(64, math.ceil((len(rows) + extra) / target))
        assert size < 2**32, "the multiply-shift start needs a table below 2**32 slots"
        self._slots = np.full(size, EMPTY, np.int32)
        self._tags = np.zeros(size, np.uint8)
        self._live = self._tombstones = 0
        self.insert(h, rows)

    def find(self, h: U64, same: Callable[[I64, I64], NDArray[np.bool_]]) -> tuple[I64, I64]:
        """For each probe ``i`` (hash ``h[i]``): the row for which ``same(rows, probes)`` holds
        and the slot holding it, or ``-1`` twice. ``same`` is asked only about live rows whose
        tag matches.

        A probe ends at its row or at an empty slot: linear probing never leaves an empty slot
        between an entry and its first slot, so nothing is missed by ending a window early."""
        cap, width = len(self._slots), len(_WINDOW)
        rows = np.full(len(h), -1, np.int64)
        at = np.full(len(h), -1, np.int64)
        tags = self._tag(h)
        probes = np.arange(len(h), dtype=np.int64)
        pos = self._start(h)
        # np.take rather than fancy indexing: several times faster on small batches (it would
        # copy a strided source first, so the owner never hands it a record's field).
        while len(probes):
            window = (pos[:, None] + _WINDOW).ravel()
            seen = np.take(self._slots, window, mode="wrap")
            tag_met = np.take(self._tags, window, mode="wrap").reshape(-1, width) == tags[:, None]
            maybe = np.flatnonzero(tag_met.ravel() & (seen >= 0))
            found = np.take(seen, maybe).astype(np.int64)
            owner = maybe // width
            hit = same(found, np.take(probes, owner))
            maybe, found, owner = maybe[hit], found[hit], owner[hit]
            asked = np.take(probes, owner)
            rows[asked] = found
            at[asked] = np.take(window, maybe) % cap
            # Eight bools of a window read as one uint64: nonzero when any slot is empty.
            done = (seen == EMPTY).view(np.uint64) != 0
            done[owner] = True
            go = ~done
            probes, pos, tags = probes[go], pos[go] + width, tags[go]
        return rows, at

    def insert(self, h: U64, rows: I64) -> None:
        """Add ``rows`` (distinct, none already here; the caller made room with :meth:`fits` /
        :meth:`rebuild`). Rows racing for one free slot: one wins (read back after the write,
        whichever numpy kept), the others probe on."""
        slots, cap = self._slots, len(self._slots)
        tags = self._tag(h)
        todo = np.arange(len(h), dtype=np.int64)
        pos = self._start(h)
        while len(todo):
            free = np.flatnonzero(slots[pos] < 0)
            cand, cpos = rows[todo[free]], pos[free]
            was_tombstone = slots[cpos] == _TOMBSTONE
            slots[cpos] = cand
            won = slots[cpos] == cand
            self._tags[cpos[won]] = tags[todo[free[won]]]
            self._tombstones -= int(np.count_nonzero(was_tombstone & won))
            stay = np.ones(len(todo), bool)
            stay[free[won]] = False
            todo = todo[stay]
            pos = pos[stay] + 1
            pos[pos == cap] = 0
        self._live += len(rows)

    def erase(self, at: I64) -> None:
        """Remove the entries in slots ``at`` (distinct, from :meth:`find`)."""
        self._slots[at] = _TOMBSTONE
        self._live -= len(at)
        self._tombstones += len(at)
