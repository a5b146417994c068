"""The single-process block pool: pages of one layer group in one contiguous tensor.

Lifecycle of a page: ``allocate`` (private, writable, refcount 1) -> ``write`` -> ``seal``
(immutable; hashed and deduplicated) -> ``share`` / lookups take references -> ``release``
drops them -> at refcount 0 a sealed page waits in the LRU, still findable, until ``evict``
hands it to the tier below and its slot returns to the free list.

Safety rule: pages are shared only after their bytes compare equal. A content-hash match is a
candidate, never proof, and the dedup index is scoped by tenant namespace, so neither an
accidental nor a crafted collision can hand one tenant's context to another. Token keys resolve
to the exact pages registered under them (page identity, not a hash), so a weak content hash
cannot redirect a lookup either.

Every public method validates all of its input before changing anything: a call that raises
leaves the pool as it was.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tessera_ray.core._blocks import BlockIndex
from tessera_ray.core._bytes import copy_rows
from tessera_ray.core._dedup import DedupIndex
from tessera_ray.core._pages import PageTable
from tessera_ray.core._records import SEALED, PageRecord
from tessera_ray.core._storage import HashPath, PageMemory
from tessera_ray.core._validate import (
    check_block_size,
    check_page_rows,
    check_raw_write,
    check_region_write,
    check_sealed_under,
    check_token_key,
)
from tessera_ray.core.config import PoolConfig
from tessera_ray.core.hashing import ContentHashFn, block_hash, xxh3_128
from tessera_ray.core.results import (
    BlockHash,
    BlockSealResult,
    ContentHash,
    EvictedPage,
    PageHandle,
    PageIndex,
    PoolStats,
    SealResult,
    TokenKey,
)
from tessera_ray.errors import (
    PageNotFreeableError,
    PageNotSealedError,
    PageSealedError,
    PageShapeError,
    PoolConfigError,
)
from tessera_ray.layout import LayerGroup, ModelLayout, PageSpec

__all__ = ["BlockPool"]

_REGION_IDS = itertools.count(1)
"""Process-wide region ids, so a handle of one pool is recognised as forged by another."""


class BlockPool:
    """Pages of one layer group: one ``uint8`` tensor ``[num_pages, page_bytes]``.

    A block is the ``layers_per_block`` pages (one per layer of the group) of one token block;
    its hash digests its pages' content hashes in layer order, and token keys name blocks.

    Made of parts that each own their state and change it only through their own methods: page
    memory (bytes, hashing), page table (records, free list, LRU, references), dedup index
    (namespaces, sealed pages by hash, the sealing decision), block index (blocks, token keys).
    The pool checks input and joins the parts for calls that span them (eviction, blocks).
    """

    def __init__(
        self,
        page: PageSpec,
        config: PoolConfig,
        *,
        fingerprint: str,
        layers_per_block: int = 1,
        content_hash: ContentHashFn = xxh3_128,
    ) -> None:
        if not fingerprint:
            raise PoolConfigError("fingerprint must be the layout's non-empty fingerprint")
        if isinstance(layers_per_block, bool) or layers_per_block <= 0:
            raise PoolConfigError(f"layers_per_block must be positive, got {layers_per_block}")
        self.page_spec = page
        self.config = config
        self.fingerprint = fingerprint
        self.layers_per_block = layers_per_block
        self.page_bytes = page.page_bytes
        self.region = next(_REGION_IDS)
        self.content_hash_fn = content_hash
        """The content hash this pool seals with (readers verify fetched pages with it)."""
        self._memory = PageMemory(page, config, content_hash)
        self.data = self._memory.data
        self.words = self._memory.words
        """``data``'s rows as 8-byte words when ``page_bytes`` allows (else ``data``): what a
        gather or scatter of whole pages moves, as wide elements copy faster on a device."""
        self._pages = PageTable(self.data, self.region, scrub=config.scrub_freed_pages)
        self._dedup = DedupIndex(fingerprint, self._pages, self._memory)
        self._blocks = BlockIndex()

    @classmethod
    def for_group(
        cls,
        layout: ModelLayout,
        group: LayerGroup | int,
        config: PoolConfig,
        *,
        content_hash: ContentHashFn = xxh3_128,
    ) -> BlockPool:
        """The pool of ``layout``'s layer group ``group`` (a group or its index)."""
        g = layout.groups[group] if isinstance(group, int) else group
        return cls(
            g.page,
            config,
            fingerprint=layout.fingerprint,
            layers_per_block=len(g.layers),
            content_hash=content_hash,
        )

    # ----------------------------------------------------------------- handles and views

    def slot(self, handle: PageHandle) -> PageIndex:
        """The page's row in the pool tensor (what a kernel's block table holds)."""
        return PageIndex(self._pages.resolve(handle).index)

    def read(self, handle: PageHandle) -> torch.Tensor:
        """A copy of the page's bytes (``uint8 [page_bytes]``, on the pool's device)."""
        return self.data[self._pages.resolve(handle).index].clone()

    def read_bytes(self, handle: PageHandle) -> bytes:
        return self._memory.buffer(self._pages.resolve(handle).index).tobytes()

    def is_sealed(self, handle: PageHandle) -> bool:
        return self._pages.resolve(handle).state == SEALED

    def writable_slots(self, handles: Sequence[PageHandle]) -> list[int]:
        """The rows of distinct writable pages ``handles`` (slots a caller reserved, checked in
        one pass); raises :class:`PageSealedError` if one is sealed."""
        recs = self._pages.distinct(handles)
        for r in recs:
            if r.state == SEALED:
                raise PageSealedError(f"page {r.index} is sealed; reserve writable pages")
        return [r.index for r in recs]

    def content_hash_of(self, handle: PageHandle) -> ContentHash:
        """The content hash a sealed page was sealed with (what a reader verifies after a copy)."""
        rec = self._pages.resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is not sealed; it has no content hash yet")
        return ContentHash(rec.digest)

    def verify(self, handle: PageHandle) -> bool:
        """Whether a sealed page's bytes still hash to the digest it was sealed with (memory
        is trusted between checks; a consumer that saw bad bytes asks the pool to look)."""
        rec = self._pages.resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is not sealed; it has no content hash yet")
        return self._dedup.verify(rec)

    def refcount(self, handle: PageHandle) -> int:
        return self._pages.resolve(handle).refcount

    def region_view(self, region: str) -> torch.Tensor:
        """Typed zero-copy view ``[num_pages, entries_per_page, columns]`` of one region."""
        return self._memory.region_view(region)

    def flashmla_view(self) -> torch.Tensor:
        """FlashMLA's ``[num_pages, block_tokens, 1, 576]`` bf16 view (mla-bf16 pages only)."""
        return self._memory.flashmla_view()

    # ----------------------------------------------------------------- allocate / write

    def allocate(self) -> PageHandle:
        """One private writable page (refcount 1, zeroed unless scrubbing is off)."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[PageHandle]:
        """``n`` writable pages, all or none."""
        return self._pages.allocate(n)

    def write(self, handle: PageHandle, data: torch.Tensor, *, offset: int = 0) -> PageHandle:
        """Copy ``data`` (``uint8``, 1-D) into the page at byte ``offset``.

        Writing to a sealed page forks it (copy-on-write): the caller's reference moves to a
        fresh private copy, whose handle is returned; every other holder keeps the old bytes.
        """
        rec = self._pages.resolve(handle)
        check_raw_write(data, offset, self.page_bytes)
        target = self._pages.writable(rec)
        self.data[target.index, offset : offset + data.numel()].copy_(data)
        return handle if target is rec else self._pages.handle(target)

    def write_many(self, handles: Sequence[PageHandle], data: torch.Tensor) -> list[PageHandle]:
        """Write whole pages: ``data[i]`` (``uint8 [n, page_bytes]``) into ``handles[i]``.

        Copy-on-write as :meth:`write`; returns the handles to use from now on. All checks,
        including enough free pages for the forks, happen before any byte moves.
        """
        recs = self._pages.distinct(handles)
        check_page_rows(data, len(recs), self.page_bytes)
        targets = self._pages.writable_many(recs)
        copy_rows(self.data, [r.index for r in targets], data)
        handle = self._pages.handle
        return [h if t is r else handle(t) for h, r, t in zip(handles, recs, targets, strict=True)]

    def write_region(
        self, handle: PageHandle, region: str, data: torch.Tensor, *, start_entry: int = 0
    ) -> PageHandle:
        """Write entries ``start_entry ..`` of one region: ``data`` is ``[n, columns]`` of the
        region's dtype (see :meth:`region_view`). Copy-on-write as :meth:`write`."""
        rec = self._pages.resolve(handle)
        check_region_write(self.page_spec, region, data, start_entry)
        target = self._pages.writable(rec)
        end = start_entry + data.shape[0]
        self._memory.region_view(region)[target.index, start_entry:end].copy_(data)
        return handle if target is rec else self._pages.handle(target)

    def fork(self, handle: PageHandle) -> PageHandle:
        """A new private writable copy of a page; the source and its references are untouched."""
        src = self._pages.resolve(handle)
        self._pages.need_free(1)
        return self._pages.handle(self._pages.fork(src))

    # ----------------------------------------------------------------- seal / dedup

    def seal(self, handle: PageHandle, namespace: str) -> SealResult:
        """Make a writable page immutable under ``namespace``, sharing an equal page if any.

        Hash the bytes; for every stored page of the namespace with that hash compare the
        bytes. Equal: take a reference on the stored page and free the candidate. None equal:
        install the candidate, counting a collision if the hash had matched.
        """
        rec = self._pages.resolve(handle)
        if rec.state == SEALED:
            raise PageSealedError(f"page {rec.index} is already sealed")
        return self._dedup.seal_page(rec, namespace, handle)

    def seal_many(self, handles: Sequence[PageHandle], namespace: str) -> list[SealResult]:
        """:meth:`seal` for many pages, all checked before any is sealed."""
        return self._dedup.seal_many(self._pages.unsealed(handles), handles, namespace)

    def hash_pages(self, slots: Sequence[int], seed: int) -> list[int]:
        """Content hashes, keyed by ``seed`` (:func:`content_seed`), of the bytes now in pages
        ``slots``, whatever their state. Reads page memory only, so a transport may call it on
        its own thread for slots it just wrote and nobody else touches (their bytes are then
        hashed while the copy left them in the CPU's cache)."""
        return self._memory.hash_rows(slots, seed)

    @property
    def hash_path(self) -> HashPath:
        """How this pool hashes pages: ``host`` (in place), ``triton`` or ``torch`` (the
        default hash on the device, into the digest the host computes), ``staged`` (a device
        pool with an injected hash: pages copied to the host first)."""
        return self._memory.hash_path

    def seal_verified(
        self,
        handles: Sequence[PageHandle],
        namespace: str,
        expected: Sequence[int],
        digests: Sequence[int] | None = None,
    ) -> tuple[list[SealResult | None], list[int]]:
        """Seal the pages whose content hash equals ``expected[i]`` (what their owner sealed
        them with), hashing each page once; a page that differs is left writable and unsealed.

        For bytes that arrived from another pool: verification and sealing share one hash
        pass. ``digests`` are the pages' content hashes when the caller already computed them
        over the bytes now in the pages (:meth:`hash_pages` with this namespace's seed, as a
        transport does where they land); they are then not hashed again. Returns per page its
        :class:`SealResult` or ``None``, and the positions that did not match (the caller
        releases those pages).
        """
        if len(expected) != len(handles):
            raise PageShapeError(f"{len(expected)} expected hashes for {len(handles)} pages")
        if digests is not None and len(digests) != len(handles):
            raise PageShapeError(f"{len(digests)} digests for {len(handles)} pages")
        recs = self._pages.unsealed(handles)
        return self._dedup.seal_verified(recs, handles, namespace, expected, digests)

    def share(self, handle: PageHandle) -> PageHandle:
        """Take one more reference on a sealed page (taking it off the LRU if unreferenced)."""
        rec = self._pages.resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is writable; seal it before sharing")
        self._pages.incref(rec)
        return handle

    def release(self, handle: PageHandle) -> None:
        """Drop one reference. A writable page is freed; a sealed one goes to the LRU at 0."""
        rec = self._pages.resolve(handle)
        if rec.refcount == 0:
            raise PageNotFreeableError(f"page {rec.index} holds no reference to release")
        self._pages.decref(rec)

    def release_many(self, handles: Sequence[PageHandle]) -> None:
        resolve = self._pages.resolve
        self._pages.release_all([resolve(h) for h in handles])

    # ----------------------------------------------------------------- blocks / token keys

    def seal_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey | None = None
    ) -> BlockSealResult:
        """Seal the layer pages of one token block (layer order) and register the block,
        under ``token_key`` if given. A live token key is never redirected."""
        check_block_size(handles, self.layers_per_block)
        check_token_key(token_key)
        results = tuple(self.seal_many(handles, namespace))
        ns = self._dedup.known(namespace)
        pages = [self._pages.resolve(res.handle) for res in results]
        bh = block_hash([res.content_hash for res in results], self._dedup.seed(ns))
        return BlockSealResult(bh, results, self._blocks.register(ns, bh, pages, token_key))

    def register_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey
    ) -> bool:
        """Name already-sealed pages of ``namespace`` as one block under ``token_key``.
        False when the key already names a different live block (first registration wins)."""
        check_block_size(handles, self.layers_per_block)
        # Not distinct: two layers of a block may hold one deduplicated page, as in seal_block.
        recs = [self._pages.resolve(h) for h in handles]
        check_token_key(token_key)
        ns = self._dedup.known(namespace)
        check_sealed_under(recs, ns, namespace)
        bh = block_hash([ContentHash(r.digest) for r in recs], self._dedup.seed(ns))
        return self._blocks.register(ns, bh, recs, token_key)

    def lookup(self, namespace: str, token_key: TokenKey) -> tuple[PageHandle, ...] | None:
        """The block's page handles, with one reference taken on each; ``None`` on a miss."""
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        return None if block is None else self._pages.share(block.pages)

    def lookup_sealed(
        self, namespace: str, token_key: TokenKey
    ) -> tuple[tuple[PageHandle, ...], tuple[int, ...], tuple[ContentHash, ...]] | None:
        """:meth:`lookup`, with each page's slot and content hash: what a pin hands its reader,
        read off the block's records rather than resolved again from every handle."""
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        if block is None:
            return None
        pages = block.pages
        return (
            self._pages.share(pages),
            tuple(r.index for r in pages),
            tuple(ContentHash(r.digest) for r in pages),
        )

    def lookup_many(
        self, namespace: str, token_keys: Sequence[TokenKey]
    ) -> list[tuple[PageHandle, ...] | None]:
        return [self.lookup(namespace, k) for k in token_keys]

    def contains(self, namespace: str, token_key: TokenKey) -> bool:
        return self._blocks.find(self._dedup.known(namespace), token_key) is not None

    def block_hash_of(self, namespace: str, token_key: TokenKey) -> BlockHash | None:
        """The block hash ``token_key`` maps to (what the cluster directory indexes)."""
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        return None if block is None else BlockHash(block.block_hash)

    # ----------------------------------------------------------------- eviction

    def evict(self, max_pages: int, *, copy_data: bool = True) -> list[EvictedPage]:
        """Evict up to ``max_pages`` unreferenced sealed pages, least recently released first.

        Returns what left (with a copy of the bytes for the tier below). Blocks that named an
        evicted page are dropped with their token keys. Referenced pages are never evicted.
        """
        if max_pages < 0:
            raise PoolConfigError(f"cannot evict {max_pages} pages")
        return [self._evict_page(rec, copy_data) for rec in self._pages.pop_oldest(max_pages)]

    def evict_unnamed(self, max_pages: int) -> int:
        """Evict up to ``max_pages`` unreferenced sealed pages that belong to no block, oldest
        first; returns how many left. Such pages are sealed but unreachable by any token key
        (a block dropped with a shared page, a fetch that failed part-way, a key registered
        first elsewhere), so freeing them loses nothing a lookup could find."""
        orphans = self._blocks.unnamed(self._pages.evictable(), max_pages)
        self._pages.take_from_lru(orphans)
        for rec in orphans:
            self._evict_page(rec, copy_data=False)
        return len(orphans)

    def evict_block(
        self, namespace: str, token_key: TokenKey, *, copy_data: bool = True
    ) -> list[EvictedPage] | None:
        """Evict ``token_key``'s name for its block, now, out of LRU order.

        For callers that choose victims by block (the pool actor evicts blocks with replicas
        elsewhere first). The key is forgotten. A block other keys still name (the same bytes
        stored under several keys, as the zero tail of records in one layer group) stays whole
        for them, so evicting one key never takes another key's block with it. The last name's
        block leaves with its pages, except pages that other blocks also name (a deduplicated
        page: layer-0 KV of the same tokens at the same positions under another prefix).
        Returns the pages that left (none while other keys name the block), or ``None`` (and
        changes nothing) when the key names no block, or its block would leave and any of its
        pages is referenced.
        """
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        if block is None:
            return None
        if len(block.token_keys) > 1:
            self._blocks.unname(block, token_key)
            return []
        if any(r.refcount for r in block.pages):
            return None
        victims = self._blocks.only_in(block)
        self._pages.take_from_lru(victims)
        out = [self._evict_page(rec, copy_data) for rec in victims]
        self._blocks.drop_block(block)  # when every page was shared, it is still named
        return out

    def block_names(
        self, namespace: str, token_key: TokenKey
    ) -> tuple[tuple[TokenKey, ...], bool] | None:
        """The token keys naming the block ``token_key`` names (it among them) and whether any
        of its pages is referenced; ``None`` when the key names no block."""
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        if block is None:
            return None
        names = tuple(TokenKey(k) for k in block.token_keys)
        return names, any(r.refcount for r in block.pages)

    def evictable_blocks(self, limit: int) -> list[tuple[str, TokenKey]]:
        """Up to ``limit`` ``(namespace, token key)`` pairs of unreferenced blocks, oldest first.

        The order is the page LRU's, the one :meth:`evict` follows, so a caller that evicts by
        block (:meth:`evict_block`) picks the same victims page eviction would, instead of
        keeping a second recency order that drifts from it. A block comes when the walk from
        the LRU's front first meets one of its pages, with all of its token keys; blocks with
        a referenced page are skipped (they cannot be evicted).
        """
        if limit < 0:
            raise PoolConfigError(f"cannot list {limit} evictable blocks")
        return self._blocks.evictable(self._pages.evictable(), limit, self._dedup.names)

    def touch_block(self, namespace: str, token_key: TokenKey) -> bool:
        """Record a use of the block without taking a reference: its unreferenced pages move
        to the young end of the LRU (in page order), so a block that is read (probed, copied
        out to a peer) is not evicted as if idle. Returns whether the key names a block."""
        block = self._blocks.find(self._dedup.known(namespace), token_key)
        if block is None:
            return False
        self._pages.touch(block.pages)
        return True

    def _evict_page(self, rec: PageRecord, copy_data: bool) -> EvictedPage:
        """Evict one unreferenced sealed page already taken off the LRU: each index forgets
        it, then its slot returns to the free list."""
        data = self._memory.buffer(rec.index).tobytes() if copy_data else None
        namespace = self._dedup.remove(rec)
        evicted = EvictedPage(namespace, ContentHash(rec.digest), PageIndex(rec.index), data)
        self._blocks.drop_page(rec)
        self._pages.free_evicted(rec)
        return evicted

    # ----------------------------------------------------------------- stats / checks

    def stats(self) -> PoolStats:
        pages, total, free = self._pages, self._pages.num_pages, self._pages.num_free
        return PoolStats(
            page_bytes=self.page_bytes,
            pages_total=total,
            pages_free=free,
            pages_used=total - free,
            pages_sealed=pages.sealed,
            pages_shared=pages.shared,
            pages_evictable=pages.num_evictable,
            blocks=self._blocks.num_blocks,
            token_keys=self._blocks.num_token_keys,
            dedup_hits=self._dedup.hits,
            bytes_saved_by_dedup=self._dedup.hits * self.page_bytes,
            collisions=self._dedup.collisions,
            evictions=pages.evictions,
        )

    def check_consistency(self) -> None:
        """Walk every structure and raise ``AssertionError`` on any broken invariant (an
        offline check in the spirit of fsck; O(pages)): each part checks its own state, the
        indexes also against the pages."""
        self._pages.check()
        self._dedup.check([r for r in self._pages if r.state == SEALED])
        self._blocks.check(self._pages)
