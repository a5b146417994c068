"""Small frozen results that cross process boundaries between client, pools and directory.

Cheap to pickle, never live internal objects. Every list-shaped request is answered by a list
aligned with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, overload

import numpy as np

from tessera_ray.actors.directory import Tier
from tessera_ray.core.results import BlockHash, TokenKey

__all__ = [
    "Reservation",
    "StoredBlock",
    "PinnedBlock",
    "PinTicket",
    "BlockRead",
    "BlockReads",
    "LayerCheck",
    "BlockCheck",
    "BlockRef",
    "EvictionReport",
    "InstallResult",
    "FetchFailure",
    "BlockFailure",
    "NOT_HELD",
    "PoolStatus",
]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Slots for ``num_blocks`` blocks held for the caller until ``expires_at_s`` (wall clock).

    Commit or abort before then; an expired reservation is returned to the free list by the
    pool, so a client that dies mid-store leaves nothing behind.
    """

    id: int
    pool: str
    num_blocks: int
    expires_at_s: float


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One committed block: its key, content-derived block hash, and where it sits.

    ``slot`` / ``generation`` name the block's first page in the pool (what the directory
    records); ``deduplicated`` is True when every page was already stored with equal bytes;
    ``registered`` is False when the key already named another block in this pool (the first
    registration of a key wins, so a live key is never redirected).
    """

    token_key: TokenKey
    block_hash: BlockHash
    slot: int
    generation: int
    deduplicated: bool
    registered: bool


class PinnedBlock(NamedTuple):
    """A block held in memory for a reader: per layer group, its page slots and the content
    hash of each page (what the reader must find after the transfer). A named tuple, cheap
    to build where a pin ticket is unpickled (see :meth:`PinTicket.__reduce__`)."""

    token_key: TokenKey
    block_hash: BlockHash
    slots: tuple[tuple[int, ...], ...]
    content_hashes: tuple[tuple[int, ...], ...]


class BlockRead(NamedTuple):
    """A block's bytes as a pool holds them, with the block hash it sealed them under: a
    consumer checks the one against the other before use. Under one token key two pools may
    hold different, equally valid bytes (an engine whose KV is not bitwise reproducible
    recomputed the block), so this hash, not the one a lookup returned earlier, is the check."""

    block_hash: BlockHash
    payload: np.ndarray
    """uint8 ``[block_bytes]``, every layer group's pages in order."""


LayerCheck = Callable[[int, Sequence[int]], list[int]]
"""``check(layer, rows)``: of the payload rows ``rows``, those whose page of layer ``layer``
does not hash to the seal the pool holds for it; raises
:class:`~tessera_ray.errors.TransferFailedError` where the pages' pool exited (whatever they
hash to, they are no longer its pinned pages)."""


@dataclass(frozen=True, slots=True)
class BlockReads:
    """What a pool read for a list of token keys, as columns: per key the block hash (``None``:
    not held), and the held blocks' payloads in one array, so that it crosses a process
    boundary as one buffer instead of one per block. Indexing gives a :class:`BlockRead` (a
    view of its row) or ``None``."""

    block_hashes: tuple[BlockHash | None, ...]
    payloads: np.ndarray
    """uint8 ``[blocks held, block_bytes]``, the held keys' rows in key order."""
    rows: tuple[int, ...]
    """Per key, its row in ``payloads``; -1 where not held."""
    verified: bool = False
    """Every held block's bytes were checked against its seal where they landed (a NIXL read
    hashes each page as it arrives), so the reader need not hash them again."""
    carrier: str = ""
    """What carried the bytes to the reader: ``"mapped"`` (the pool's memory, mapped in the
    reader's process), a transport kind (``"nixl"``), or ``""``: a Ray call's payload."""
    lent: bool = False
    """``payloads`` is a view of the reader's staging memory, which its next read reuses: a
    caller that keeps the rows past that read copies them first."""
    pinned: bool = False
    """``payloads`` is a view of the pool's own pages (mapped into the reader's process), which
    stay as they are only while the read's pin holds: the tier ends the pin when the caller
    says it copied them (:meth:`~tessera_ray.vllm.backend.TierBackend.end_reads`)."""
    check_layer: LayerCheck | None = None
    """Set where nothing was hashed yet (a read in place of a mapped pool's pages): the caller
    checks each layer's pages as it copies them, so the first layer waits for its own pages'
    hashes only. A caller that does not call it verifies the payloads whole, as ever."""

    @classmethod
    def of(
        cls,
        block_hashes: Sequence[BlockHash | None],
        payloads: np.ndarray,
        *,
        verified: bool = False,
        carrier: str = "",
        lent: bool = False,
        pinned: bool = False,
        check_layer: LayerCheck | None = None,
    ) -> BlockReads:
        rows, held = [], 0
        for h in block_hashes:
            rows.append(-1 if h is None else held)
            held += h is not None
        if held != len(payloads):
            raise ValueError(f"{held} blocks held, {len(payloads)} payload rows")
        return cls(
            tuple(block_hashes), payloads, tuple(rows), verified, carrier, lent, pinned, check_layer
        )

    @classmethod
    def joined(cls, parts: Sequence[BlockReads]) -> BlockReads:
        """Reads of consecutive runs of keys as one (a single part is returned as it is; more
        are copied into one array, which nothing lends)."""
        if len(parts) == 1:
            return parts[0]
        hashes = [h for part in parts for h in part.block_hashes]
        payloads = np.concatenate([part.payloads for part in parts])
        verified = all(part.verified for part in parts)
        return cls.of(hashes, payloads, verified=verified, carrier=parts[0].carrier)

    def __len__(self) -> int:
        return len(self.block_hashes)

    def _at(self, i: int) -> BlockRead | None:
        h, row = self.block_hashes[i], self.rows[i]
        return None if h is None else BlockRead(h, self.payloads[row])

    @overload
    def __getitem__(self, i: int) -> BlockRead | None: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockRead | None]: ...
    def __getitem__(self, i: int | slice) -> BlockRead | list[BlockRead | None] | None:
        if isinstance(i, slice):
            return [self._at(j) for j in range(len(self))[i]]
        return self._at(i)

    def __iter__(self) -> Iterator[BlockRead | None]:
        return (self._at(i) for i in range(len(self)))


class BlockCheck(StrEnum):
    """What a pool found when asked to check a block a consumer could not verify."""

    INTACT = "intact"
    """Its bytes here still match its seal: the consumer's copy went bad on the way."""
    DROPPED = "dropped"
    """Its bytes here rotted: the block left this pool's memory (never served again from it;
    a verified disk copy, if any, stays) and the next store of its key installs it afresh."""
    IN_USE = "in_use"
    """Rotten, but other readers hold it right now; ask again once they are done."""
    ABSENT = "absent"
    """Not in this pool's memory."""


@dataclass(frozen=True, slots=True)
class PinTicket:
    """Blocks pinned on ``pool`` until unpinned or ``expires_at_s``; ``blocks[i]`` answers the
    i-th requested key (``None``: not held here)."""

    id: int
    pool: str
    namespace: str
    blocks: tuple[PinnedBlock | None, ...]
    expires_at_s: float
    incarnation: int = 0
    """The owner process's random start id: a reader that cached the owner's transport data
    re-adds it when this changes (a restarted pool has a new NIXL agent under the same name)."""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Pickled as flat columns, not one object per block: the dataclass pickling runs
        # Python code for every PinnedBlock on every fetch's pin (see directory.LookupAnswer
        # for the same on lookups; the figures in docs/measured-choices.md).
        held = [(i, b) for i, b in enumerate(self.blocks) if b is not None]
        groups = len(held[0][1].slots) if held else 0
        per_group = [
            (
                [len(b.slots[g]) for _, b in held],
                [s for _, b in held for s in b.slots[g]],
                [h for _, b in held for h in b.content_hashes[g]],
            )
            for g in range(groups)
        ]
        return _pin_ticket, (
            self.id,
            self.pool,
            self.namespace,
            self.expires_at_s,
            self.incarnation,
            len(self.blocks),
            [i for i, _ in held],
            [b.token_key for _, b in held],
            [b.block_hash for _, b in held],
            per_group,
        )


def _pin_ticket(
    pin_id: int,
    pool: str,
    namespace: str,
    expires_at_s: float,
    incarnation: int,
    n: int,
    positions: list[int],
    keys: list[TokenKey],
    hashes: list[BlockHash],
    per_group: list[tuple[list[int], list[int], list[int]]],
) -> PinTicket:
    """The ticket a pickled :class:`PinTicket` stood for."""
    slots: list[list[tuple[int, ...]]] = [[] for _ in positions]
    digests: list[list[tuple[int, ...]]] = [[] for _ in positions]
    for counts, flat_slots, flat_hashes in per_group:
        at = 0
        for i, count in enumerate(counts):
            slots[i].append(tuple(flat_slots[at : at + count]))
            digests[i].append(tuple(flat_hashes[at : at + count]))
            at += count
    blocks: list[PinnedBlock | None] = [None] * n
    for i, pos in enumerate(positions):
        blocks[pos] = PinnedBlock(keys[i], hashes[i], tuple(slots[i]), tuple(digests[i]))
    return PinTicket(pin_id, pool, namespace, tuple(blocks), expires_at_s, incarnation)


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block named by namespace, token key and block hash (eviction and inventory reports)."""

    namespace: str
    token_key: TokenKey
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class EvictionReport:
    """What one eviction round did: blocks dropped from memory because other replicas exist,
    blocks moved to disk (the last copy), and blocks lost because no disk tier was set."""

    dropped: tuple[BlockRef, ...]
    spilled: tuple[BlockRef, ...]
    lost: tuple[BlockRef, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.dropped) + len(self.spilled) + len(self.lost)


class FetchFailure(StrEnum):
    """Why one block was not fetched from another pool (callers branch on this, never on a
    message)."""

    OWNER_UNAVAILABLE = "owner_unavailable"
    """The owner did not answer the pin: dead, restarting, unreachable or too slow."""
    WRONG_NAMESPACE = "wrong_namespace"
    """The owner answered for another namespace than the one asked (a bug, never used)."""
    NOT_HELD = "not_held"
    """The owner does not hold the block (evicted, or never had it)."""
    TRANSFER_FAILED = "transfer_failed"
    """The bytes did not arrive: the owner or its transport went away during the read."""
    TIMEOUT = "timeout"
    """The read did not finish in time."""
    HASH_MISMATCH = "hash_mismatch"
    """The bytes arrived hashing otherwise than the owner sealed them: not installed."""
    LAYOUT_MISMATCH = "layout_mismatch"
    """Owner and reader disagree on the block's pages (layout or page size)."""


@dataclass(frozen=True, slots=True)
class BlockFailure:
    """One block a fetch did not install: why (for control flow) and the detail (for people)."""

    reason: FetchFailure
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"


NOT_HELD = BlockFailure(FetchFailure.NOT_HELD, "the owner does not hold it")
"""A key the owner's pin found no block under."""


@dataclass(frozen=True, slots=True)
class InstallResult:
    """Outcome of installing fetched blocks: ``installed[i]`` for the i-th block, or why it
    was refused in ``errors[i]``."""

    installed: tuple[StoredBlock | None, ...]
    errors: tuple[BlockFailure | None, ...]


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """A pool's health and usage snapshot (what `tessera-ray status` prints)."""

    name: str
    node: str
    layout: str
    fingerprint: str
    block_bytes: int
    blocks_capacity: int
    blocks_free: int
    blocks_in_memory: int
    blocks_on_disk: int
    disk_bytes: int
    reservations: int
    pins: int
    dedup_hits: int
    bytes_saved_by_dedup: int
    collisions: int
    evictions: int
    spills: int
    restores: int
    lost_blocks: int
    transfers_in: int
    bytes_in: int
    transport: str
    """How this pool pulls blocks: ``nixl`` (one-sided reads) or ``object-store``."""
    quarantines: int = 0
    """Disk records that failed verification and were quarantined (cumulative)."""
    rotten_blocks: int = 0
    """Blocks dropped from memory because their bytes no longer matched their seal when a
    consumer had them checked (cumulative)."""
    pages_used: dict[Tier, int] = field(default_factory=dict)
    """Pages in use per tier (disk: pages of the blocks stored there); no disk key: no tier."""
    pages_free: dict[Tier, int] = field(default_factory=dict)
    """Pages free per tier (disk: whole blocks' pages that fit under the capacity)."""
    channel_pins: int = 0
    """Pins this pool served to readers on its direct channel (cumulative); the others came
    as Ray actor calls."""
    channel_refused: int = 0
    """Connections to the channel dropped for a wrong secret or a malformed frame
    (cumulative): a security signal where it is not zero."""
    mapped_bytes_in: int = 0
    """Bytes of pages this pool read out of a same-node pool's mapped memory rather than over
    its transport's backend (cumulative; part of ``bytes_in``'s reads)."""

    @property
    def tier_counts(self) -> dict[Tier, int]:
        """Blocks per tier (derived from ``blocks_in_memory`` and ``blocks_on_disk``)."""
        return {Tier.MEMORY: self.blocks_in_memory, Tier.DISK: self.blocks_on_disk}
