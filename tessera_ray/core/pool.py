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
import xxhash

from tessera_ray.core import _evict, _refs, _register, _seal, _write
from tessera_ray.core._blocks import BlockIndex
from tessera_ray.core._dedup import DedupIndex
from tessera_ray.core._records import FREE, SEALED, PageList, PageRecord
from tessera_ray.core._staging import DeviceHasher
from tessera_ray.core._storage import page_storage
from tessera_ray.core._validate import check_handle
from tessera_ray.core._views import flashmla_view, region_views
from tessera_ray.core.config import PoolConfig
from tessera_ray.core.hashing import ContentHashFn, xxh3_128
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
    PageDTypeError,
    PageNotFreeableError,
    PageNotSealedError,
    PageSealedError,
    PageShapeError,
    PoolConfigError,
    UnknownNameError,
)
from tessera_ray.layout import LayerGroup, ModelLayout, PageSpec

__all__ = ["BlockPool"]

_REGION_IDS = itertools.count(1)
"""Process-wide region ids, so a handle of one pool is recognised as forged by another."""


class BlockPool:
    """Pages of one layer group: one ``uint8`` tensor ``[num_pages, page_bytes]``.

    A block is the ``layers_per_block`` pages (one per layer of the group) of one token block;
    its hash digests its pages' content hashes in layer order, and token keys name blocks.
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
        # The default hash is called straight from the C extension: one Python frame less per
        # page is a measurable share of sealing (see bench_pool.py).
        self._hash: ContentHashFn = (
            xxhash.xxh3_128_intdigest if content_hash is xxh3_128 else content_hash
        )
        self.content_hash_fn = content_hash
        """The content hash this pool seals with (readers verify fetched pages with it)."""
        self.data, self._host = page_storage(config, self.page_bytes)
        self._hasher: DeviceHasher | None = None
        self._num_pages = config.num_pages
        self._records = [PageRecord(index=i) for i in range(config.num_pages)]
        self._free = PageList()
        self._lru = PageList()
        for rec in self._records:
            self._free.push_back(rec)
        self._dedup = DedupIndex(fingerprint)
        self._block_index = BlockIndex()
        self._views: dict[str, torch.Tensor] | None = None
        self._sealed = 0
        self._shared = 0
        self._dedup_hits = 0
        self._collisions = 0
        self._evictions = 0

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

    def _handle(self, rec: PageRecord) -> PageHandle:
        pb = self.page_bytes
        return PageHandle(self.region, rec.index * pb, pb, rec.generation)

    def _resolve(self, handle: PageHandle) -> PageRecord:
        """O(1): check every field of ``handle`` against the slot table."""
        # Fast path for a valid handle; anything unusual goes to the checks that say why.
        if type(handle) is PageHandle and handle.region == self.region:
            index, rem = divmod(handle.offset, self.page_bytes)
            if not rem and 0 <= index < self._num_pages and handle.length == self.page_bytes:
                rec = self._records[index]
                if rec.generation == handle.generation and rec.state != FREE:
                    return rec
        return check_handle(handle, self.region, self.page_bytes, self._records)

    def slot(self, handle: PageHandle) -> PageIndex:
        """The page's row in the pool tensor (what a kernel's block table holds)."""
        return PageIndex(self._resolve(handle).index)

    def read(self, handle: PageHandle) -> torch.Tensor:
        """A copy of the page's bytes (``uint8 [page_bytes]``, on the pool's device)."""
        return self.data[self._resolve(handle).index].clone()

    def read_bytes(self, handle: PageHandle) -> bytes:
        return self._page_buffer(self._resolve(handle).index).tobytes()

    def is_sealed(self, handle: PageHandle) -> bool:
        return self._resolve(handle).state == SEALED

    def writable_slots(self, handles: Sequence[PageHandle]) -> list[int]:
        """The rows of distinct writable pages ``handles`` (slots a caller reserved, checked in
        one pass); raises :class:`PageSealedError` if one is sealed."""
        recs = self._distinct(handles)
        for r in recs:
            if r.state == SEALED:
                raise PageSealedError(f"page {r.index} is sealed; reserve writable pages")
        return [r.index for r in recs]

    def content_hash_of(self, handle: PageHandle) -> ContentHash:
        """The content hash a sealed page was sealed with (what a reader verifies after a copy)."""
        rec = self._resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is not sealed; it has no content hash yet")
        return ContentHash(rec.digest)

    def verify(self, handle: PageHandle) -> bool:
        """Whether a sealed page's bytes still hash to the digest it was sealed with (memory
        is trusted between checks; a consumer that saw bad bytes asks the pool to look)."""
        rec = self._resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is not sealed; it has no content hash yet")
        seed = self._dedup.seeds[rec.namespace]
        return bool(self._hash(self._page_buffer(rec.index), seed) == rec.digest)

    def refcount(self, handle: PageHandle) -> int:
        return self._resolve(handle).refcount

    def region_view(self, region: str) -> torch.Tensor:
        """Typed zero-copy view ``[num_pages, entries_per_page, columns]`` of one region."""
        if self._views is None:
            self._views = region_views(self.data, self.page_spec)
        try:
            return self._views[region]
        except KeyError:
            raise UnknownNameError(
                f"no region {region!r}; this page has {', '.join(self._views)}"
            ) from None

    def flashmla_view(self) -> torch.Tensor:
        """FlashMLA's ``[num_pages, block_tokens, 1, 576]`` bf16 view (mla-bf16 pages only)."""
        try:
            return flashmla_view(self.data, self.page_spec)
        except ValueError as e:
            raise PageDTypeError(str(e)) from None

    # ----------------------------------------------------------------- allocate / write

    def allocate(self) -> PageHandle:
        """One private writable page (refcount 1, zeroed unless scrubbing is off)."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[PageHandle]:
        """``n`` writable pages, all or none."""
        return _refs.allocate(self, n)

    def write(self, handle: PageHandle, data: torch.Tensor, *, offset: int = 0) -> PageHandle:
        """Copy ``data`` (``uint8``, 1-D) into the page at byte ``offset``.

        Writing to a sealed page forks it (copy-on-write): the caller's reference moves to a
        fresh private copy, whose handle is returned; every other holder keeps the old bytes.
        """
        return _write.write(self, handle, data, offset)

    def write_many(self, handles: Sequence[PageHandle], data: torch.Tensor) -> list[PageHandle]:
        """Write whole pages: ``data[i]`` (``uint8 [n, page_bytes]``) into ``handles[i]``.

        Copy-on-write as :meth:`write`; returns the handles to use from now on. All checks,
        including enough free pages for the forks, happen before any byte moves.
        """
        return _write.write_many(self, handles, data)

    def _distinct(self, handles: Sequence[PageHandle]) -> list[PageRecord]:
        recs = [self._resolve(h) for h in handles]
        if len({r.index for r in recs}) != len(recs):
            raise PageShapeError("the same page is named twice in one call")
        return recs

    def write_region(
        self, handle: PageHandle, region: str, data: torch.Tensor, *, start_entry: int = 0
    ) -> PageHandle:
        """Write entries ``start_entry ..`` of one region: ``data`` is ``[n, columns]`` of the
        region's dtype (see :meth:`region_view`). Copy-on-write as :meth:`write`."""
        return _write.write_region(self, handle, region, data, start_entry)

    def fork(self, handle: PageHandle) -> PageHandle:
        """A new private writable copy of a page; the source and its references are untouched."""
        return _write.fork(self, handle)

    # ----------------------------------------------------------------- seal / dedup

    def _page_buffer(self, index: int) -> memoryview:
        if self._host is not None:
            pb = self.page_bytes
            return self._host[index * pb : (index + 1) * pb]
        return self.data[index].cpu().numpy().data

    def _device_hasher(self) -> DeviceHasher:
        if self._hasher is None:
            self._hasher = DeviceHasher(self.data, self._hash)
        return self._hasher

    def seal(self, handle: PageHandle, namespace: str) -> SealResult:
        """Make a writable page immutable under ``namespace``, sharing an equal page if any.

        Hash the bytes; for every stored page of the namespace with that hash compare the
        bytes. Equal: take a reference on the stored page and free the candidate. None equal:
        install the candidate, counting a collision if the hash had matched.
        """
        rec = self._resolve(handle)
        if rec.state == SEALED:
            raise PageSealedError(f"page {rec.index} is already sealed")
        return _seal.seal_page(self, rec, self._dedup.namespace(namespace), handle)

    def seal_many(self, handles: Sequence[PageHandle], namespace: str) -> list[SealResult]:
        """:meth:`seal` for many pages, all checked before any is sealed."""
        return _seal.seal_many(self, handles, namespace)

    def hash_pages(self, slots: Sequence[int], seed: int) -> list[int]:
        """Content hashes, keyed by ``seed`` (:func:`content_seed`), of the bytes now in pages
        ``slots``, whatever their state. Reads page memory only, so a transport may call it on
        its own thread for slots it just wrote and nobody else touches (their bytes are then
        hashed while the copy left them in the CPU's cache)."""
        return _seal.hash_pages(self, slots, seed)

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
        return _seal.seal_verified(self, handles, namespace, expected, digests)

    def share(self, handle: PageHandle) -> PageHandle:
        """Take one more reference on a sealed page (taking it off the LRU if unreferenced)."""
        rec = self._resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is writable; seal it before sharing")
        _refs.incref(self, rec)
        return handle

    def release(self, handle: PageHandle) -> None:
        """Drop one reference. A writable page is freed; a sealed one goes to the LRU at 0."""
        rec = self._resolve(handle)
        if rec.refcount == 0:
            raise PageNotFreeableError(f"page {rec.index} holds no reference to release")
        _refs.decref(self, rec)

    def release_many(self, handles: Sequence[PageHandle]) -> None:
        _refs.release_all(self, [self._resolve(h) for h in handles])

    # ----------------------------------------------------------------- blocks / token keys

    def seal_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey | None = None
    ) -> BlockSealResult:
        """Seal the layer pages of one token block (layer order) and register the block,
        under ``token_key`` if given. A live token key is never redirected."""
        return _register.seal_block(self, handles, namespace, token_key)

    def register_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey
    ) -> bool:
        """Name already-sealed pages of ``namespace`` as one block under ``token_key``.
        False when the key already names a different live block (first registration wins)."""
        return _register.register_block(self, handles, namespace, token_key)

    def lookup(self, namespace: str, token_key: TokenKey) -> tuple[PageHandle, ...] | None:
        """The block's page handles, with one reference taken on each; ``None`` on a miss."""
        block = self._block_index.find(self._dedup.known(namespace), token_key)
        if block is None:
            return None
        for r in block.pages:
            assert r.state == SEALED
            _refs.incref(self, r)
        return tuple(self._handle(r) for r in block.pages)

    def lookup_many(
        self, namespace: str, token_keys: Sequence[TokenKey]
    ) -> list[tuple[PageHandle, ...] | None]:
        return [self.lookup(namespace, k) for k in token_keys]

    def contains(self, namespace: str, token_key: TokenKey) -> bool:
        return self._block_index.find(self._dedup.known(namespace), token_key) is not None

    def block_hash_of(self, namespace: str, token_key: TokenKey) -> BlockHash | None:
        """The block hash ``token_key`` maps to (what the cluster directory indexes)."""
        block = self._block_index.find(self._dedup.known(namespace), token_key)
        return None if block is None else BlockHash(block.block_hash)

    # ----------------------------------------------------------------- eviction

    def evict(self, max_pages: int, *, copy_data: bool = True) -> list[EvictedPage]:
        """Evict up to ``max_pages`` unreferenced sealed pages, least recently released first.

        Returns what left (with a copy of the bytes for the tier below). Blocks that named an
        evicted page are dropped with their token keys. Referenced pages are never evicted.
        """
        return _evict.evict(self, max_pages, copy_data)

    def evict_unnamed(self, max_pages: int) -> int:
        """Evict up to ``max_pages`` unreferenced sealed pages that belong to no block, oldest
        first; returns how many left. Such pages are sealed but unreachable by any token key
        (a block dropped with a shared page, a fetch that failed part-way, a key registered
        first elsewhere), so freeing them loses nothing a lookup could find."""
        return _evict.evict_unnamed(self, max_pages)

    def evict_block(
        self, namespace: str, token_key: TokenKey, *, copy_data: bool = True
    ) -> list[EvictedPage] | None:
        """Evict the block ``token_key`` names, now, out of LRU order.

        For callers that choose victims by block (the pool actor evicts blocks with replicas
        elsewhere first). The block and its token keys are forgotten; its pages leave, except
        pages that other blocks also name (a deduplicated page: layer-0 KV of the same tokens
        at the same positions under another prefix), which stay for those blocks, so evicting
        one block never takes another with it. Returns the pages that left, or ``None`` (and
        changes nothing) when the key names no block or any of its pages is referenced.
        """
        return _evict.evict_block(self, namespace, token_key, copy_data)

    def evictable_blocks(self, limit: int) -> list[tuple[str, TokenKey]]:
        """Up to ``limit`` ``(namespace, token key)`` pairs of unreferenced blocks, oldest first.

        The order is the page LRU's, the one :meth:`evict` follows, so a caller that evicts by
        block (:meth:`evict_block`) picks the same victims page eviction would, instead of
        keeping a second recency order that drifts from it. A block comes when the walk from
        the LRU's front first meets one of its pages, with all of its token keys; blocks with
        a referenced page are skipped (they cannot be evicted).
        """
        return _evict.evictable_blocks(self, limit)

    def touch_block(self, namespace: str, token_key: TokenKey) -> bool:
        """Record a use of the block without taking a reference: its unreferenced pages move
        to the young end of the LRU (in page order), so a block that is read (probed, copied
        out to a peer) is not evicted as if idle. Returns whether the key names a block."""
        return _evict.touch_block(self, namespace, token_key)

    # ----------------------------------------------------------------- stats / checks

    def stats(self) -> PoolStats:
        total, free = len(self._records), len(self._free)
        return PoolStats(
            page_bytes=self.page_bytes,
            pages_total=total,
            pages_free=free,
            pages_used=total - free,
            pages_sealed=self._sealed,
            pages_shared=self._shared,
            pages_evictable=len(self._lru),
            blocks=len(self._block_index.blocks),
            token_keys=len(self._block_index.token_keys),
            dedup_hits=self._dedup_hits,
            bytes_saved_by_dedup=self._dedup_hits * self.page_bytes,
            collisions=self._collisions,
            evictions=self._evictions,
        )

    def check_consistency(self) -> None:
        """Walk every structure and raise ``AssertionError`` on any broken invariant (an
        offline check in the spirit of fsck; O(pages))."""
        from tessera_ray.core._check import check_pool

        check_pool(self)
