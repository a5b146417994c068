"""The tables of one directory shard in numpy records: token keys, blocks, and each block's
replicas, with no Python object per entry (:class:`DirectoryIndex`).

Three row tables (:class:`~tessera_ray.actors._open_table.Rows`), two hash indexes over
them (:class:`~tessera_ray.actors._open_table.SlotIndex`):

- a key row holds the 32-byte token key as four words and the row of the block it names;
  ``(namespace, key) -> key row`` is indexed (the namespace is the block's);
- a block row holds the 128-bit block hash as two words, the namespace id, and its first
  replica row; ``(namespace, block hash) -> block row`` is indexed;
- a replica row holds pool id, tier, slot, generation and the next replica row of the same
  block: each block's replicas are a chain in registration order.

A key keeps naming its block row after the block's last replica went, but it is dead: a
block row counts the times it lost its last replica (its epoch), a key row holds the epoch it
was named in, and a lookup that meets a key of an older epoch forgets it. A later registration
of the same block under another key revives the row, not the keys that named it before: the
pool that registers the block again holds it under that key only. Block rows nothing names
any more (no replica, no key) are reclaimed in a batch once there are enough of them that the
scan pays for itself.
The interning of namespaces and pools and the checking of input are the shard's
(:class:`~tessera_ray.actors.directory.DirectoryShard`); every array here is already valid.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from tessera_ray.actors._open_table import I64, U64, Rows, SlotIndex, mix64
from tessera_ray.errors import DirectoryError

__all__ = [
    "DirectoryIndex",
    "Found",
    "FREE_POOL",
    "FREE_NAMESPACE",
    "KEY_ROW",
    "BLOCK_ROW",
    "REPLICA_ROW",
]

FREE_POOL = 0xFFFF
"""Pool id of a released replica row; pool ids are below it (uint16)."""
FREE_NAMESPACE = 0xFFFF_FFFF
"""Namespace id of a released block row; namespace ids are below it (uint32)."""
KEY_ROW = np.dtype([("key", "<u8", (4,)), ("block", "<i4"), ("epoch", "<u4")])
"""A token key (32 bytes as four words), the row of the block it names (-1: a free row) and
that block's epoch when the key was named."""
BLOCK_ROW = np.dtype(
    [("hi", "<u8"), ("lo", "<u8"), ("ns", "<u4"), ("head", "<i4"), ("epoch", "<u4")]
)
"""A block hash (two words), its namespace id, its first replica row (-1: none), and how many
times it lost its last replica (keys named before then are dead)."""
REPLICA_ROW = np.dtype(
    [("gen", "<i8"), ("slot", "<u4"), ("next", "<i4"), ("pool", "<u2"), ("tier", "u1")]
)
"""A replica: generation, slot, the next replica row of its block (-1: the last), pool, tier.
Packed (19 bytes): numpy reads the unaligned fields of a gathered record fine."""
_ALL_FOUR = np.frombuffer(bytes([1, 1, 1, 1]), np.uint32)[0]
"""Four ``True`` bytes read as one uint32."""
_MAX_ROWS = 2**31 - 1
"""Rows per table: row numbers are int32 in the indexes and the chains."""
_RECLAIM_MIN = 64
"""Fewest empty block rows worth a reclaim scan."""
_LAST = np.int64(1) << 40
"""Sort key offset that puts a batch's new replicas after a chain's existing ones."""


class Found(NamedTuple):
    """What a lookup found, as columns: ``positions`` of the keys hit (ascending), their
    block hashes (``hi``, ``lo`` words), how many replicas each has, and the replicas' fields
    concatenated hit by hit, each block's in registration order."""

    positions: I64
    hi: U64
    lo: U64
    counts: I64
    pools: NDArray[np.uint16]
    tiers: NDArray[np.uint8]
    slots: NDArray[np.uint32]
    generations: NDArray[np.int64]


def _repeats(h: U64) -> bool:
    """Whether any hash occurs twice (a sort: cheaper than ``np.unique``'s hashing here)."""
    ordered = np.sort(h)
    return bool(np.any(ordered[1:] == ordered[:-1]))


def _distinct(a: I64) -> I64:
    """The distinct values of ``a``, sorted (a sort: cheaper than ``np.unique``'s hashing)."""
    ordered = np.sort(a)
    distinct: I64 = ordered[
        np.concatenate((ordered[:1] == ordered[:1], ordered[1:] != ordered[:-1]))
    ]
    return distinct


def _u64(a: NDArray[np.generic] | int) -> U64:
    return np.asarray(a).astype(np.uint64)


class DirectoryIndex:
    """Keys, blocks and replica chains of one shard. Every method takes a batch as arrays."""

    def __init__(self) -> None:
        self._keys = Rows(KEY_ROW)
        self._blocks = Rows(BLOCK_ROW)
        self._reps = Rows(REPLICA_ROW)
        self._key_index = SlotIndex()
        self._block_index = SlotIndex()
        self.live_blocks = 0
        """Block rows with at least one replica (what the dict model held)."""
        self.replicas = 0
        self._reclaim_at = _RECLAIM_MIN

    @property
    def token_keys(self) -> int:
        return self._keys.live

    def table_bytes(self) -> dict[str, int]:
        """Bytes of every array each table holds (unused capacity and free rows included)."""
        return {
            "keys": self._keys.nbytes,
            "blocks": self._blocks.nbytes,
            "replicas": self._reps.nbytes,
            "key_index": self._key_index.nbytes,
            "block_index": self._block_index.nbytes,
        }

    # ------------------------------------------------------------------ hashing

    @staticmethod
    def _key_hash(ns: U64, words: U64) -> U64:
        return mix64(words[:, 1] ^ mix64(ns))

    @staticmethod
    def _block_hash(ns: U64, hi: U64, lo: U64) -> U64:
        return mix64(lo ^ mix64(hi ^ mix64(ns)))

    def _find_keys(self, ns: U64, words: U64) -> tuple[I64, I64]:
        keys, block_ns = self._keys.data, self._blocks["ns"]

        def same(rows: I64, probes: I64) -> NDArray[np.bool_]:
            met = np.take(keys, rows)
            # The four word comparisons of a row read as one uint32: all equal or not.
            equal = met["key"] == np.take(words, probes, axis=0)
            hit: NDArray[np.bool_] = equal.view(np.uint32).ravel() == _ALL_FOUR
            hit &= block_ns[met["block"]] == np.take(ns, probes)  # a field: fancy, not take
            return hit

        return self._key_index.find(self._key_hash(ns, words), same)

    def _find_blocks(self, ns: U64, hi: U64, lo: U64) -> tuple[I64, I64, U64]:
        blocks = self._blocks.data

        def same(rows: I64, probes: I64) -> NDArray[np.bool_]:
            met = np.take(blocks, rows)
            hit: NDArray[np.bool_] = met["lo"] == np.take(lo, probes)
            hit &= met["hi"] == np.take(hi, probes)
            hit &= met["ns"] == np.take(ns, probes)
            return hit

        h = self._block_hash(ns, hi, lo)
        rows, at = self._block_index.find(h, same)
        return rows, at, h

    def _room_for_keys(self, extra: int) -> None:
        if not self._key_index.fits(extra):
            k = self._keys
            rows = np.flatnonzero(k["block"][: k.size] >= 0)
            ns = _u64(self._blocks["ns"][k["block"][rows]])
            self._key_index.rebuild(self._key_hash(ns, k["key"][rows]), rows, extra)

    def _room_for_blocks(self, extra: int) -> None:
        if not self._block_index.fits(extra):
            b = self._blocks
            rows = np.flatnonzero(b["ns"][: b.size] != FREE_NAMESPACE)
            h = self._block_hash(_u64(b["ns"][rows]), b["hi"][rows], b["lo"][rows])
            self._block_index.rebuild(h, rows, extra)

    # ------------------------------------------------------------------ chains

    def _chains(self, blocks: I64) -> tuple[I64, I64, I64]:
        """Every replica row of ``blocks``: which block (index into ``blocks``), the row, its
        place in the chain; grouped by block, each chain in order."""
        head, following = self._blocks["head"], self._reps["next"]
        cur = head[blocks].astype(np.int64)
        idx = np.arange(len(blocks), dtype=np.int64)
        which: list[I64] = []
        rows: list[I64] = []
        place: list[I64] = []
        step = 0
        while True:
            keep = cur >= 0
            idx, cur = idx[keep], cur[keep]
            if not len(cur):
                break
            which.append(idx)
            rows.append(cur)
            place.append(np.full(len(cur), step, np.int64))
            cur = following[cur].astype(np.int64)
            step += 1
        if len(which) <= 1:
            empty = np.empty(0, np.int64)
            return (which[0], rows[0], place[0]) if which else (empty, empty, empty)
        w = np.concatenate(which)
        order = np.argsort(w, kind="stable")  # rounds are in chain order; keep it per block
        return w[order], np.concatenate(rows)[order], np.concatenate(place)[order]

    def _relink(self, blocks: I64, which: I64, rows: I64) -> None:
        """Make the chain of each of ``blocks`` exactly ``rows`` (grouped by ``which``, an index
        into ``blocks``, in order); a block with none gets an empty chain."""
        head, following = self._blocks["head"], self._reps["next"]
        head[blocks] = -1
        if not len(rows):
            return
        starts = np.flatnonzero(np.concatenate(([True], which[1:] != which[:-1])))
        after = np.empty(len(rows), np.int64)
        after[:-1] = rows[1:]
        after[starts[1:] - 1] = -1
        after[-1] = -1
        following[rows] = after
        head[blocks[which[starts]]] = rows[starts]

    # ------------------------------------------------------------------ writes

    def register(
        self,
        ns: U64,
        words: U64,
        hi: U64,
        lo: U64,
        pools: NDArray[np.uint16],
        tiers: NDArray[np.uint8],
        slots: NDArray[np.uint32],
        generations: NDArray[np.int64],
    ) -> int:
        """Entry ``i``: key ``words[i]`` under namespace ``ns[i]`` names block ``(hi[i],
        lo[i])``, held by pool ``pools[i]`` in ``tiers[i]`` at ``slots[i]``. As if applied one
        by one, in order; returns how many replicas are new."""
        tables = (self._keys, self._blocks, self._reps)
        if max(t.live for t in tables) + len(ns) > _MAX_ROWS:
            raise DirectoryError(
                f"a shard table holds at most {_MAX_ROWS:,} rows; run the tier with more shards"
            )
        blocks = self._block_rows(ns, hi, lo)
        self._add_keys(ns, words, blocks)
        return self._add_replicas(blocks, pools, tiers, slots, generations)

    def _block_rows(self, ns: U64, hi: U64, lo: U64) -> I64:
        """The row of each block, new rows (empty chains) for those not held yet."""
        rows, _, h = self._find_blocks(ns, hi, lo)
        missing = np.flatnonzero(rows < 0)
        if not len(missing):
            return rows
        take, inverse = missing, np.arange(len(missing))
        if _repeats(h[missing]):  # the same block twice in the batch, perhaps
            ident = np.stack((ns[missing], hi[missing], lo[missing]), axis=1)
            _, first, inverse = np.unique(ident, axis=0, return_index=True, return_inverse=True)
            take = missing[first]
        self._room_for_blocks(len(take))  # before the new rows exist: it indexes every row
        new = self._blocks.alloc(len(take))
        b = self._blocks
        b["hi"][new], b["lo"][new], b["ns"][new] = hi[take], lo[take], ns[take]
        b["head"][new] = -1
        b["epoch"][new] = 0
        self._block_index.insert(h[take], new)
        rows[missing] = new[inverse.reshape(-1)]
        return rows

    def _add_keys(self, ns: U64, words: U64, blocks: I64) -> None:
        """Keys not held yet name the block of their first entry; a held key keeps its block,
        unless it is dead (its block lost every replica since): then it names the new one."""
        rows, _ = self._find_keys(ns, words)
        held = np.flatnonzero(rows >= 0)
        if len(held):
            k, b = self._keys, self._blocks
            dead = held[k["epoch"][rows[held]] != b["epoch"][k["block"][rows[held]]]]
            # The first entry naming a dead key wins, as for a new key.
            _, first = np.unique(rows[dead], return_index=True)
            dead = dead[first]
            k["block"][rows[dead]] = blocks[dead]
            k["epoch"][rows[dead]] = b["epoch"][blocks[dead]]
        missing = np.flatnonzero(rows < 0)
        if not len(missing):
            return
        h = self._key_hash(ns[missing], words[missing])
        if _repeats(h):  # the same key twice in the batch, perhaps
            ident = np.concatenate((ns[missing, None], words[missing]), axis=1)
            _, first = np.unique(ident, axis=0, return_index=True)
            missing, h = missing[first], h[first]
        self._room_for_keys(len(missing))  # before the new rows exist: it indexes every row
        new = self._keys.alloc(len(missing))
        self._keys["key"][new] = words[missing]
        self._keys["block"][new] = blocks[missing]
        self._keys["epoch"][new] = self._blocks["epoch"][blocks[missing]]
        self._key_index.insert(h, new)

    def _add_replicas(
        self,
        blocks: I64,
        pools: NDArray[np.uint16],
        tiers: NDArray[np.uint8],
        slots: NDArray[np.uint32],
        generations: NDArray[np.int64],
    ) -> int:
        """One replica per (block, pool, tier): the first entry naming one places it (after
        the block's existing replicas), the last one sets its slot and generation."""
        n = len(blocks)
        ident = (_u64(blocks) << np.uint64(24)) | (_u64(pools) << np.uint64(8)) | _u64(tiers)
        named, first = np.unique(ident, return_index=True)
        last = n - 1 - np.unique(ident[::-1], return_index=True)[1]
        named_blocks = blocks[first]
        held = _distinct(named_blocks)
        which, rows, place = self._chains(held)
        reps = self._reps
        row_ident = (
            (_u64(held[which]) << np.uint64(24))
            | (_u64(reps["pool"][rows]) << np.uint64(8))
            | _u64(reps["tier"][rows])
        )
        j = np.minimum(np.searchsorted(named, row_ident), len(named) - 1)
        again = named[j] == row_ident
        reps["slot"][rows[again]] = slots[last[j[again]]]
        reps["gen"][rows[again]] = generations[last[j[again]]]
        fresh = np.ones(len(named), bool)
        fresh[j[again]] = False
        fresh_idx = np.flatnonzero(fresh)
        if not len(fresh_idx):
            return 0
        new = reps.alloc(len(fresh_idx))
        reps["pool"][new] = pools[first[fresh_idx]]
        reps["tier"][new] = tiers[first[fresh_idx]]
        reps["slot"][new] = slots[last[fresh_idx]]
        reps["gen"][new] = generations[last[fresh_idx]]
        all_which = np.concatenate((which, np.searchsorted(held, named_blocks[fresh_idx])))
        all_place = np.concatenate((place, _LAST + first[fresh_idx]))
        all_rows = np.concatenate((rows, new))
        order = np.lexsort((all_place, all_which))
        was_empty = self._blocks["head"][held] < 0
        self._relink(held, all_which[order], all_rows[order])
        self.live_blocks += int(np.count_nonzero(was_empty))  # each gets a replica here
        self.replicas += len(new)
        return len(new)

    def drop(self, ns: U64, hi: U64, lo: U64, pool: int, tier: int | None) -> int:
        """Forget ``pool``'s replicas (in ``tier``, or every tier) of the given blocks."""
        rows, _, _ = self._find_blocks(ns, hi, lo)
        return self._remove(_distinct(rows[rows >= 0]), pool, tier)

    def purge(self, pool: int) -> int:
        """Forget every replica on ``pool``."""
        reps = self._reps
        if not np.any(reps["pool"][: reps.size] == pool):
            return 0
        b = self._blocks
        return self._remove(np.flatnonzero(b["head"][: b.size] >= 0), pool, None)

    def _remove(self, blocks: I64, pool: int, tier: int | None) -> int:
        which, rows, _ = self._chains(blocks)
        reps = self._reps
        gone = reps["pool"][rows] == pool
        if tier is not None:
            gone &= reps["tier"][rows] == tier
        dropped = int(np.count_nonzero(gone))
        if not dropped:
            return 0
        reps["pool"][rows[gone]] = FREE_POOL
        reps.release(rows[gone])
        b = self._blocks
        was_live = b["head"][blocks] >= 0
        self._relink(blocks, which[~gone], rows[~gone])
        died = blocks[was_live & (b["head"][blocks] < 0)]
        b["epoch"][died] += np.uint32(1)  # the keys naming them die with them
        self.live_blocks -= len(died)
        self.replicas -= dropped
        self._maybe_reclaim()
        return dropped

    def _maybe_reclaim(self) -> None:
        """Release block rows with no replica that no key names, once there are enough empty
        rows that a scan over every key pays for itself (the threshold doubles with what a
        scan could not release, so a scan's cost stays proportional to the rows it frees)."""
        b = self._blocks
        if b.live - self.live_blocks <= self._reclaim_at:
            return
        k = self._keys
        named = np.zeros(b.size, bool)
        key_blocks = k["block"][: k.size]
        named[key_blocks[key_blocks >= 0]] = True
        dead = np.flatnonzero(
            ~named & (b["head"][: b.size] < 0) & (b["ns"][: b.size] != FREE_NAMESPACE)
        )
        if len(dead):
            _, at, _ = self._find_blocks(_u64(b["ns"][dead]), b["hi"][dead], b["lo"][dead])
            self._block_index.erase(at)
            b["ns"][dead] = FREE_NAMESPACE
            b.release(dead)
        self._reclaim_at = max(_RECLAIM_MIN, 2 * (b.live - self.live_blocks), b.live // 4)

    # ------------------------------------------------------------------ reads

    def lookup(self, ns: int, words: U64) -> Found:
        """The keys held under ``ns`` whose block has a replica, with the replicas. A dead key
        (its block lost every replica since it was named) is forgotten here."""
        probe_ns = np.full(len(words), ns, np.uint64)
        rows, at = self._find_keys(probe_ns, words)
        found = np.flatnonzero(rows >= 0)
        blocks = self._keys["block"][np.take(rows, found)].astype(np.int64)
        met = np.take(self._blocks.data, blocks)
        live = (met["head"] >= 0) & (self._keys["epoch"][np.take(rows, found)] == met["epoch"])
        if not live.all():
            self._forget_keys(at[found[~live]], rows[found[~live]])
            found, blocks, met = found[live], blocks[live], met[live]
        which, reps_rows, _ = self._chains(blocks)
        reps = np.take(self._reps.data, reps_rows)
        return Found(
            positions=found,
            hi=met["hi"],
            lo=met["lo"],
            counts=np.bincount(which, minlength=len(blocks)),
            pools=reps["pool"],
            tiers=reps["tier"],
            slots=reps["slot"],
            generations=reps["gen"],
        )

    def _forget_keys(self, at: I64, rows: I64) -> None:
        at, first = np.unique(at, return_index=True)  # a key asked twice is forgotten once
        rows = rows[first]
        self._key_index.erase(at)
        self._keys["block"][rows] = -1
        self._keys.release(rows)
        self._maybe_reclaim()
