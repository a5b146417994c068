"""The block pools of one pool service, one per layer group of the layout, handled as one.

A token block is one page per layer of every group; its payload is those pages' bytes in group
then layer order. Every reference a pool service takes spans every group, so each group holds a
block or none does, and the first group decides: whether a block is held, whether it may be
evicted, and its place in the eviction order (the first group's page LRU, the only one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tessera_ray.actors.messages import BlockFailure, FetchFailure, PinnedBlock, StoredBlock
from tessera_ray.actors.tenancy import check_batch
from tessera_ray.core import (
    BlockPool,
    ContentHashFn,
    PageHandle,
    PoolConfig,
    block_hash,
    content_seed,
    xxh3_128,
)
from tessera_ray.core.results import BlockHash, ContentHash, TokenKey
from tessera_ray.errors import PageShapeError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport.fetch import PageFetchResult

__all__ = ["GroupStats", "Handles", "Key", "LayerGroups", "Leaving", "check_keys"]

_KEY_BYTES = 32

Handles = list[list[PageHandle]]
"""One block's page handles, per layer group (each list in layer order)."""
Key = tuple[str, bytes]
"""A block's (namespace, token key)."""


def check_keys(namespace: str, token_keys: Sequence[bytes]) -> None:
    """A clear error for a batch too large, a bad namespace or a key of the wrong form."""
    check_batch(len(token_keys))
    if not isinstance(namespace, str) or not namespace:
        raise PageShapeError(f"namespace must be a non-empty str, got {namespace!r}")
    for key in token_keys:
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise PageShapeError(f"a token key is {_KEY_BYTES} bytes, got {key!r:.40}")


@dataclass(frozen=True, slots=True)
class Leaving:
    """A key whose block left memory: its hash, and its bytes when they were copied out."""

    key: TokenKey
    block_hash: BlockHash
    payload: bytes | None


@dataclass(frozen=True, slots=True)
class GroupStats:
    pages_used: int
    pages_free: int
    dedup_hits: int
    bytes_saved_by_dedup: int
    collisions: int
    evictions: int


class LayerGroups:
    """The layer groups' block pools and the hashes of the blocks they hold by name."""

    def __init__(
        self,
        layout: ModelLayout,
        num_blocks: int,
        device: str,
        content_hash: ContentHashFn = xxh3_128,
        shared_memory_dir: str | None = None,
    ) -> None:
        """``shared_memory_dir``: CPU pools keep their pages there, for other processes of
        the node to map (``PoolConfig.shared_memory_dir``); ignored on a device."""
        if not layout.groups:
            raise PageShapeError(f"layout {layout.model!r} has no paged layer group to pool")
        self.layout = layout
        self.pools = [
            BlockPool.for_group(
                layout,
                i,
                PoolConfig(
                    num_pages=num_blocks * len(g.layers),
                    device=device,
                    shared_memory_dir=None if device.startswith("cuda") else shared_memory_dir,
                ),
                content_hash=content_hash,
            )
            for i, g in enumerate(layout.groups)
        ]
        self.group_bytes = [g.block_bytes for g in layout.groups]
        self.block_bytes = sum(self.group_bytes)
        self.hashes: dict[Key, BlockHash] = {}
        """Block hash of every block sealed or installed here under a token key (read only:
        :meth:`_name` and :meth:`forget` keep it and :attr:`_named` in step)."""
        self._named: dict[tuple[str, BlockHash], set[bytes]] = {}
        """Per block hash, the keys naming it here: the directory records a pool's replicas by
        hash, so a hash is withdrawn only with the last key naming it."""
        self._seeds: dict[str, int] = {}

    def seed(self, namespace: str) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = content_seed(namespace, self.layout.fingerprint)
        return seed

    # ------------------------------------------------------------------ slots and references

    def free_blocks(self) -> int:
        return min(p.stats().pages_free // p.layers_per_block for p in self.pools)

    def allocate(self, count: int) -> list[Handles]:
        return [
            [pool.allocate_many(pool.layers_per_block) for pool in self.pools] for _ in range(count)
        ]

    def release(self, per_group: Handles) -> None:
        for pool, handles in zip(self.pools, per_group, strict=True):
            pool.release_many(handles)

    def reference(self, namespace: str, key: TokenKey) -> Handles | None:
        """References on every page of the block, or ``None`` and no reference when any group
        lacks it."""
        per_group = [pool.lookup(namespace, key) for pool in self.pools]
        if any(h is None for h in per_group):
            for pool, h in zip(self.pools, per_group, strict=True):
                if h is not None:
                    pool.release_many(list(h))
            return None
        return [list(h) for h in per_group if h is not None]

    def reference_pinned(self, namespace: str, key: TokenKey) -> tuple[Handles, PinnedBlock] | None:
        """:meth:`reference` and :meth:`pinned` in one pass over the block's pages (a lookup's
        pin takes every block of a prompt while the engine's scheduler waits)."""
        views = [pool.lookup_sealed(namespace, key) for pool in self.pools]
        if any(v is None for v in views):
            for pool, v in zip(self.pools, views, strict=True):
                if v is not None:
                    pool.release_many(list(v[0]))
            return None
        held = [v for v in views if v is not None]
        block = PinnedBlock(
            key,
            self.hashes[(namespace, key)],
            tuple(v[1] for v in held),
            tuple(v[2] for v in held),
        )
        return [list(v[0]) for v in held], block

    def contains(self, namespace: str, key: TokenKey) -> bool:
        return self.pools[0].contains(namespace, key)

    def resident_hash(self, namespace: str, key: TokenKey) -> BlockHash | None:
        return self.hashes.get((namespace, key)) if self.contains(namespace, key) else None

    def touch(self, namespace: str, key: TokenKey) -> None:
        """A hit that takes no reference still counts as a use in the eviction order."""
        for pool in self.pools:
            pool.touch_block(namespace, key)

    def oldest(self, limit: int) -> list[Key]:
        """Up to ``limit`` unreferenced named blocks, least recently used first."""
        return [
            (ns, bytes(key))
            for ns, key in self.pools[0].evictable_blocks(limit)
            if (ns, bytes(key)) in self.hashes
        ]

    def evict_unnamed(self, blocks: int) -> None:
        """Free pages no key can reach (worth nothing to a lookup), up to ``blocks`` blocks'."""
        for pool in self.pools:
            pool.evict_unnamed(blocks * pool.layers_per_block)

    # ------------------------------------------------------------------ writing and naming

    def seal(
        self, namespace: str, key: TokenKey, per_group: Handles, row: torch.Tensor
    ) -> StoredBlock:
        """Write one block's payload into its reserved pages, seal them (byte-verified dedup)
        and name the block; the references are released (a stored block waits in the LRU)."""
        offset, hashes, dedup, registered = 0, [], True, True
        first: PageHandle | None = None
        for pool, handles, nbytes in zip(self.pools, per_group, self.group_bytes, strict=True):
            data = row[offset : offset + nbytes].view(pool.layers_per_block, pool.page_bytes)
            offset += nbytes
            result = pool.seal_block(pool.write_many(handles, data), namespace, key)
            pool.release_many(list(result.handles))
            hashes.append(result.block_hash)
            dedup &= all(p.deduplicated for p in result.pages)
            registered &= result.token_key_registered
            first = first or result.handles[0]
        bh = BlockHash(
            hashes[0]
            if len(hashes) == 1
            else block_hash([ContentHash(h) for h in hashes], self.seed(namespace))
        )
        assert first is not None
        if registered:
            self._name(namespace, key, bh)
        return StoredBlock(
            key, bh, first.offset // first.length, first.generation, dedup, registered
        )

    def verify_row(
        self, row: torch.Tensor, block: PinnedBlock, namespace: str
    ) -> BlockFailure | None:
        """Whether a payload that arrived as bytes matches the owner's page content hashes."""
        view, offset, seed = row.numpy(), 0, self.seed(namespace)
        for g, pool in enumerate(self.pools):
            expected = block.content_hashes[g] if g < len(block.content_hashes) else ()
            if len(expected) != pool.layers_per_block:
                return BlockFailure(
                    FetchFailure.LAYOUT_MISMATCH,
                    f"block {block.token_key[:4].hex()}: wrong page count for group {g}",
                )
            for layer, want in enumerate(expected):
                page = view[offset : offset + pool.page_bytes]
                offset += pool.page_bytes
                if xxh3_128(memoryview(page.data), seed) != want:
                    return BlockFailure(
                        FetchFailure.HASH_MISMATCH,
                        f"block {block.token_key[:4].hex()}...: page {layer} of group {g} does "
                        "not match the owner's content hash; not installed",
                    )
        return None

    def name_fetched(
        self, namespace: str, held: Sequence[PinnedBlock], results: Sequence[PageFetchResult]
    ) -> list[StoredBlock | BlockFailure]:
        """Name the blocks whose every page a one-sided read fetched and verified (sealed by the
        read); per block its record or why it failed. Every reference is released: named blocks
        wait in the LRU, pages of failed blocks drain as unnamed."""
        pages = [{f.position: f.handle for f in r.fetched} for r in results]
        errors = [
            {
                f.position: BlockFailure(
                    FetchFailure(f.reason.value),
                    f"block {held[f.position // pool.layers_per_block].token_key[:4].hex()}...: "
                    f"{f.detail}",
                )
                for f in r.failed
            }
            for r, pool in zip(results, self.pools, strict=True)
        ]
        out: list[StoredBlock | BlockFailure] = []
        for i, block in enumerate(held):
            per_group: Handles = []
            error: BlockFailure | None = None
            for g, pool in enumerate(self.pools):
                span = range(i * pool.layers_per_block, (i + 1) * pool.layers_per_block)
                per_group.append([pages[g][p] for p in span if p in pages[g]])
                error = error or next((errors[g][p] for p in span if p in errors[g]), None)
            if error is None:
                registered = all(
                    pool.register_block(handles, namespace, block.token_key)
                    for pool, handles in zip(self.pools, per_group, strict=True)
                )
                first = per_group[0][0]
                slot = first.offset // first.length
                out.append(
                    StoredBlock(
                        block.token_key, block.block_hash, slot, first.generation, False, registered
                    )
                )
                if registered:
                    self._name(namespace, block.token_key, block.block_hash)
            else:
                out.append(error)
            self.release(per_group)
        return out

    # ------------------------------------------------------------------ reading

    def pinned(self, namespace: str, key: TokenKey, per_group: Handles) -> PinnedBlock:
        """What a reader needs of one held block: its pages' slots and content hashes."""
        return PinnedBlock(
            key,
            self.hashes[(namespace, key)],
            tuple(tuple(h.offset // h.length for h in hs) for hs in per_group),
            tuple(
                tuple(pool.content_hash_of(h) for h in hs)
                for pool, hs in zip(self.pools, per_group, strict=True)
            ),
        )

    def gather(self, blocks: Sequence[Handles], out: np.ndarray | None = None) -> np.ndarray:
        """The payloads of ``blocks``, ``[len(blocks), block_bytes]``: one gather per layer
        group over every block, not one per block, so a read of many blocks is one copy.
        ``out``: write them there (a reader's shared-memory slab) instead of a new array."""
        if out is None:
            out = np.empty((len(blocks), self.block_bytes), dtype=np.uint8)
        elif out.shape != (len(blocks), self.block_bytes):
            raise ValueError(f"out is {out.shape}, not {(len(blocks), self.block_bytes)}")
        if not blocks:
            return out
        dest, column = torch.from_numpy(out), 0
        for g, (pool, nbytes) in enumerate(zip(self.pools, self.group_bytes, strict=True)):
            idx = [h.offset // h.length for per_group in blocks for h in per_group[g]]
            index = torch.tensor(idx, dtype=torch.long, device=pool.data.device)
            into = dest[:, column : column + nbytes]
            if len(self.pools) == 1 and pool.data.device.type == "cpu":
                # One group fills whole rows: the gather writes straight into them.
                torch.index_select(pool.data, 0, index, out=dest.view(len(idx), -1))
            else:
                into.copy_(pool.data.index_select(0, index).reshape(len(blocks), nbytes))
            column += nbytes
        return out

    def intact(self, per_group: Handles) -> bool:
        """Whether every page still hashes to its seal."""
        return all(
            pool.verify(h) for pool, hs in zip(self.pools, per_group, strict=True) for h in hs
        )

    # ------------------------------------------------------------------ leaving memory

    def take_out(self, namespace: str, key: TokenKey) -> list[Leaving] | None:
        """Evict the block from memory with every key naming the same bytes here, each with
        its payload; ``None`` (nothing changed) when it is referenced or not held.

        Keys naming the same bytes leave together: the directory holds a pool's replicas by
        block hash, so one left behind would keep the others listed here. A layer group whose
        pages this block shares with other blocks keeps them for those blocks."""
        return self._remove(namespace, key, copy=True)

    def drop(self, namespace: str, key: TokenKey) -> list[Leaving] | None:
        """:meth:`take_out` without the payloads (rotten bytes are not copied anywhere)."""
        return self._remove(namespace, key, copy=False)

    def _remove(self, namespace: str, key: TokenKey, *, copy: bool) -> list[Leaving] | None:
        bh = self.hashes.get((namespace, key))
        if bh is None or not self.contains(namespace, key):
            return None
        named = self._named[(namespace, bh)]
        together = [TokenKey(k) for k in named if self.contains(namespace, TokenKey(k))]
        leaving = set(together)
        for pool in self.pools:
            for k in together:
                found = pool.block_names(namespace, k)
                # A block that stays for keys outside this set loses names only: references
                # on its pages do not matter. One that leaves must have none.
                if found is not None and found[1] and leaving.issuperset(found[0]):
                    return None
        payload: bytes | None = None
        if copy:
            # Read before evicting: pages the block shares with other blocks stay in the pool,
            # so the payload cannot be rebuilt from what leaves. One gather per group (one
            # device-to-host copy for a pool in GPU memory), not one read per page.
            per_group = self.reference(namespace, key)
            if per_group is not None:
                try:
                    payload = self.gather([per_group]).tobytes()
                finally:
                    self.release(per_group)
        for k in together:
            for pool in self.pools:
                pool.evict_block(namespace, k, copy_data=False)
        for name in list(named):  # keys naming these bytes without pages here go too
            self.forget(namespace, TokenKey(name))
        return [Leaving(k, bh, payload) for k in together]

    def _name(self, namespace: str, key: TokenKey, bh: BlockHash) -> None:
        self.forget(namespace, key)  # a key named again may name other bytes than before
        self.hashes[(namespace, key)] = bh
        self._named.setdefault((namespace, bh), set()).add(bytes(key))

    def forget(self, namespace: str, key: TokenKey) -> BlockHash | None:
        """Drop the hash entry of a key whose block left memory (evicted, dropped, or found
        gone by a reader); the hash to withdraw from the directory when no other key here
        names it, else ``None``."""
        bh = self.hashes.pop((namespace, key), None)
        if bh is None:
            return None
        named = self._named[(namespace, bh)]
        named.discard(bytes(key))
        if named:
            return None
        del self._named[(namespace, bh)]
        return bh

    def stats(self) -> GroupStats:
        stats = [p.stats() for p in self.pools]
        return GroupStats(
            pages_used=sum(s.pages_used for s in stats),
            pages_free=sum(s.pages_free for s in stats),
            dedup_hits=sum(s.dedup_hits for s in stats),
            bytes_saved_by_dedup=sum(s.bytes_saved_by_dedup for s in stats),
            collisions=sum(s.collisions for s in stats),
            evictions=sum(s.evictions for s in stats),
        )
