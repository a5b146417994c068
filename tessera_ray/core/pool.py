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

from tessera_ray.core._blocks import BlockIndex, blocks_of
from tessera_ray.core._bytes import copy_rows, equal_bytes, zero_row
from tessera_ray.core._dedup import DedupIndex
from tessera_ray.core._records import FREE, SEALED, WRITABLE, PageList, PageRecord
from tessera_ray.core._validate import check_handle, check_raw_write, check_region_write
from tessera_ray.core._views import flashmla_view, region_views
from tessera_ray.core.config import PoolConfig, check_fits
from tessera_ray.core.hashing import (
    TOKEN_KEY_BYTES,
    ContentHashFn,
    block_hash,
    xxh3_128,
)
from tessera_ray.core.hostmem import aligned_host_zeros
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
    PoolExhaustedError,
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
        check_fits(config, self.page_bytes)
        pinned = config.resolved_pin_memory()
        if config.is_cuda or pinned:  # device and pinned allocations are page-aligned already
            self.data = torch.zeros(
                (config.num_pages, self.page_bytes),
                dtype=torch.uint8,
                device=config.device,
                pin_memory=pinned,
            )
        else:
            self.data = aligned_host_zeros(config.num_pages, self.page_bytes)
        # A flat memoryview of host memory lets xxh3 read a page in place, without a copy;
        # slicing it is cheaper than building a numpy row per page.
        self._host = None if config.is_cuda else self.data.numpy().reshape(-1).data
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
        if n < 0:
            raise PoolConfigError(f"cannot allocate {n} pages")
        self._need_free(n)
        out = []
        for _ in range(n):
            rec = self._free.pop_front()
            assert rec is not None and rec.state == FREE
            rec.state, rec.refcount = WRITABLE, 1
            out.append(self._handle(rec))
        return out

    def _need_free(self, n: int) -> None:
        if len(self._free) < n:
            raise PoolExhaustedError(
                f"need {n} free pages, {len(self._free)} left of {len(self._records)} "
                f"({len(self._lru)} evictable); call evict() or release references"
            )

    def write(self, handle: PageHandle, data: torch.Tensor, *, offset: int = 0) -> PageHandle:
        """Copy ``data`` (``uint8``, 1-D) into the page at byte ``offset``.

        Writing to a sealed page forks it (copy-on-write): the caller's reference moves to a
        fresh private copy, whose handle is returned; every other holder keeps the old bytes.
        """
        rec = self._resolve(handle)
        check_raw_write(data, offset, self.page_bytes)
        target = self._writable(rec)
        self.data[target.index, offset : offset + data.numel()].copy_(data)
        return handle if target is rec else self._handle(target)

    def write_many(self, handles: Sequence[PageHandle], data: torch.Tensor) -> list[PageHandle]:
        """Write whole pages: ``data[i]`` (``uint8 [n, page_bytes]``) into ``handles[i]``.

        Copy-on-write as :meth:`write`; returns the handles to use from now on. All checks,
        including enough free pages for the forks, happen before any byte moves.
        """
        recs = self._distinct(handles)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            raise PageDTypeError("write_many takes a uint8 tensor [pages, page_bytes]")
        if tuple(data.shape) != (len(recs), self.page_bytes):
            raise PageShapeError(
                f"write_many of {len(recs)} pages takes [{len(recs)}, {self.page_bytes}], "
                f"got {tuple(data.shape)}"
            )
        for r in recs:
            if r.state == SEALED and r.refcount == 0:
                raise PageNotFreeableError(f"page {r.index} holds no reference to write through")
        self._need_free(sum(r.state == SEALED for r in recs))
        targets = [self._writable(r) for r in recs]
        copy_rows(self.data, [r.index for r in targets], data)
        return [
            h if t is r else self._handle(t) for h, r, t in zip(handles, recs, targets, strict=True)
        ]

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
        rec = self._resolve(handle)
        check_region_write(self.page_spec, region, data, start_entry)
        end = start_entry + data.shape[0]
        target = self._writable(rec)
        self.region_view(region)[target.index, start_entry:end].copy_(data)
        return handle if target is rec else self._handle(target)

    def fork(self, handle: PageHandle) -> PageHandle:
        """A new private writable copy of a page; the source and its references are untouched."""
        src = self._resolve(handle)
        self._need_free(1)
        return self._handle(self._copy_of(src))

    def _copy_of(self, src: PageRecord) -> PageRecord:
        rec = self._free.pop_front()
        assert rec is not None
        rec.state, rec.refcount = WRITABLE, 1
        self.data[rec.index].copy_(self.data[src.index])
        return rec

    def _writable(self, rec: PageRecord) -> PageRecord:
        if rec.state == WRITABLE:
            return rec
        if rec.refcount == 0:
            raise PageNotFreeableError(
                f"page {rec.index} holds no reference to write through; share() it first"
            )
        self._need_free(1)
        copy = self._copy_of(rec)
        self._decref(rec)
        return copy

    # ----------------------------------------------------------------- seal / dedup

    def _page_buffer(self, index: int) -> memoryview:
        if self._host is not None:
            pb = self.page_bytes
            return self._host[index * pb : (index + 1) * pb]
        return self.data[index].cpu().numpy().data

    def seal(self, handle: PageHandle, namespace: str) -> SealResult:
        """Make a writable page immutable under ``namespace``, sharing an equal page if any.

        Hash the bytes; for every stored page of the namespace with that hash compare the
        bytes. Equal: take a reference on the stored page and free the candidate. None equal:
        install the candidate, counting a collision if the hash had matched.
        """
        rec = self._resolve(handle)
        if rec.state == SEALED:
            raise PageSealedError(f"page {rec.index} is already sealed")
        return self._seal(rec, self._dedup.namespace(namespace), handle)

    def seal_many(self, handles: Sequence[PageHandle], namespace: str) -> list[SealResult]:
        """:meth:`seal` for many pages, all checked before any is sealed."""
        recs = self._distinct(handles)
        for r in recs:
            if r.state == SEALED:
                raise PageSealedError(f"page {r.index} is already sealed")
        ns = self._dedup.namespace(namespace)
        return [self._seal(r, ns, h) for r, h in zip(recs, handles, strict=True)]

    def hash_pages(self, slots: Sequence[int], seed: int) -> list[int]:
        """Content hashes, keyed by ``seed`` (:func:`content_seed`), of the bytes now in pages
        ``slots``, whatever their state. Reads page memory only, so a transport may call it on
        its own thread for slots it just wrote and nobody else touches (their bytes are then
        hashed while the copy left them in the CPU's cache)."""
        fn, host, pb = self._hash, self._host, self.page_bytes
        if host is None:
            return [fn(self._page_buffer(s), seed) for s in slots]
        return [fn(host[s * pb : (s + 1) * pb], seed) for s in slots]

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
        recs = self._distinct(handles)
        for r in recs:
            if r.state == SEALED:
                raise PageSealedError(f"page {r.index} is already sealed")
        ns = self._dedup.namespace(namespace)
        if digests is None:
            digests = self.hash_pages([r.index for r in recs], self._dedup.seeds[ns])
        out: list[SealResult | None] = []
        mismatched: list[int] = []
        for pos, (rec, handle, want, digest) in enumerate(
            zip(recs, handles, expected, digests, strict=True)
        ):
            if digest != want:
                mismatched.append(pos)
                out.append(None)
            else:
                out.append(self._seal(rec, ns, handle, digest))
        return out, mismatched

    def _seal(
        self, rec: PageRecord, ns: int, handle: PageHandle, digest: int | None = None
    ) -> SealResult:
        i = rec.index
        if digest is None:
            host, pb = self._host, self.page_bytes
            page = host[i * pb : (i + 1) * pb] if host is not None else self._page_buffer(i)
            digest = self._hash(page, self._dedup.seeds[ns])
        index = self._dedup.buckets[ns]
        if digest not in index:
            # Fresh content, the common case: one dict probe, no candidate to compare. Kept
            # lean because sealing must run near raw xxh3 speed (bench_pool, >= 0.8).
            index[digest] = rec
            rec.state, rec.namespace, rec.digest = SEALED, ns, digest
            self._sealed += 1
            return SealResult(handle, ContentHash(digest), False, False)
        candidates = self._dedup.candidates(ns, digest)
        for cand in candidates:
            if equal_bytes(self.data, cand.index, i):
                self._incref(cand)
                self._decref(rec)
                self._dedup_hits += 1
                return SealResult(self._handle(cand), ContentHash(digest), True, False)
        self._collisions += 1
        self._dedup.insert(ns, digest, rec)
        rec.state, rec.namespace, rec.digest = SEALED, ns, digest
        self._sealed += 1
        return SealResult(handle, ContentHash(digest), False, True)

    def share(self, handle: PageHandle) -> PageHandle:
        """Take one more reference on a sealed page (taking it off the LRU if unreferenced)."""
        rec = self._resolve(handle)
        if rec.state != SEALED:
            raise PageNotSealedError(f"page {rec.index} is writable; seal it before sharing")
        self._incref(rec)
        return handle

    def release(self, handle: PageHandle) -> None:
        """Drop one reference. A writable page is freed; a sealed one goes to the LRU at 0."""
        rec = self._resolve(handle)
        if rec.refcount == 0:
            raise PageNotFreeableError(f"page {rec.index} holds no reference to release")
        self._decref(rec)

    def release_many(self, handles: Sequence[PageHandle]) -> None:
        recs = [self._resolve(h) for h in handles]
        counts: dict[int, int] = {}
        for r in recs:
            counts[r.index] = counts.get(r.index, 0) + 1
            if counts[r.index] > r.refcount:
                raise PageNotFreeableError(f"page {r.index} released more often than referenced")
        for r in recs:
            self._decref(r)

    def _incref(self, rec: PageRecord) -> None:
        if rec.refcount == 0:
            self._lru.remove(rec)
        rec.refcount += 1
        if rec.refcount == 2:
            self._shared += 1

    def _decref(self, rec: PageRecord) -> None:
        rec.refcount -= 1
        if rec.refcount == 1:
            self._shared -= 1
        elif rec.refcount == 0:
            if rec.state == SEALED:
                self._lru.push_back(rec)
            else:
                self._free_slot(rec)

    def _free_slot(self, rec: PageRecord) -> None:
        rec.state, rec.refcount, rec.namespace, rec.digest = FREE, 0, -1, 0
        rec.generation += 1
        if self.config.scrub_freed_pages:
            zero_row(self.data, rec.index)
        self._free.push_back(rec)

    # ----------------------------------------------------------------- blocks / token keys

    def seal_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey | None = None
    ) -> BlockSealResult:
        """Seal the layer pages of one token block (layer order) and register the block,
        under ``token_key`` if given. A live token key is never redirected."""
        self._block_size(handles)
        self._check_token_key(token_key)
        results = tuple(self.seal_many(handles, namespace))
        ns = self._dedup.ids[namespace]
        pages = [self._records[self.slot(res.handle)] for res in results]
        bh = block_hash([res.content_hash for res in results], self._dedup.seeds[ns])
        registered = self._block_index.register(ns, bh, pages, token_key)
        return BlockSealResult(bh, results, registered)

    def register_block(
        self, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey
    ) -> bool:
        """Name already-sealed pages of ``namespace`` as one block under ``token_key``.
        False when the key already names a different live block (first registration wins)."""
        self._block_size(handles)
        # Not _distinct: two layers of a block may hold one deduplicated page, as in seal_block.
        recs = [self._resolve(h) for h in handles]
        self._check_token_key(token_key)
        ns = self._dedup.known(namespace)
        for r in recs:
            if r.state != SEALED or r.namespace != ns:
                raise PageNotSealedError(f"page {r.index} is not sealed under {namespace!r}")
        bh = block_hash([ContentHash(r.digest) for r in recs], self._dedup.seeds[ns])
        return self._block_index.register(ns, bh, recs, token_key)

    def _block_size(self, handles: Sequence[PageHandle]) -> None:
        if len(handles) != self.layers_per_block:
            raise PageShapeError(
                f"a block has {self.layers_per_block} pages (one per layer), got {len(handles)}"
            )

    @staticmethod
    def _check_token_key(token_key: TokenKey | None) -> None:
        if token_key is not None and (
            not isinstance(token_key, bytes) or len(token_key) != TOKEN_KEY_BYTES
        ):
            raise PageShapeError(f"a token key is {TOKEN_KEY_BYTES} bytes (see token_key())")

    def lookup(self, namespace: str, token_key: TokenKey) -> tuple[PageHandle, ...] | None:
        """The block's page handles, with one reference taken on each; ``None`` on a miss."""
        block = self._block_index.find(self._dedup.known(namespace), token_key)
        if block is None:
            return None
        for r in block.pages:
            assert r.state == SEALED
            self._incref(r)
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
        if max_pages < 0:
            raise PoolConfigError(f"cannot evict {max_pages} pages")
        out: list[EvictedPage] = []
        while len(out) < max_pages:
            rec = self._lru.pop_front()
            if rec is None:
                break
            out.append(self._evict_page(rec, copy_data))
        return out

    def evict_unnamed(self, max_pages: int) -> int:
        """Evict up to ``max_pages`` unreferenced sealed pages that belong to no block, oldest
        first; returns how many left. Such pages are sealed but unreachable by any token key
        (a block dropped with a shared page, a fetch that failed part-way, a key registered
        first elsewhere), so freeing them loses nothing a lookup could find."""
        orphans = [rec for rec in self._lru if rec.blocks is None][: max(max_pages, 0)]
        for rec in orphans:
            self._lru.remove(rec)
            self._evict_page(rec, copy_data=False)
        return len(orphans)

    def _evict_page(self, rec: PageRecord, copy_data: bool) -> EvictedPage:
        """Evict one unreferenced sealed page already taken off the LRU."""
        assert rec.state == SEALED and rec.refcount == 0
        data = self._page_buffer(rec.index).tobytes() if copy_data else None
        evicted = EvictedPage(
            self._dedup.names[rec.namespace], ContentHash(rec.digest), PageIndex(rec.index), data
        )
        self._unindex(rec)
        self._free_slot(rec)  # pushes onto the free list; the record is off the LRU already
        self._evictions += 1
        return evicted

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
        block = self._block_index.find(self._dedup.known(namespace), token_key)
        if block is None or any(r.refcount for r in block.pages):
            return None
        out: list[EvictedPage] = []
        for rec in dict.fromkeys(block.pages):  # a deduplicated page may repeat in a block
            if any(b is not block for b in blocks_of(rec)):
                continue
            self._lru.remove(rec)
            out.append(self._evict_page(rec, copy_data))
        self._block_index.drop_block(block)  # when every page was shared, it is still named
        return out

    def _unindex(self, rec: PageRecord) -> None:
        self._dedup.remove(rec)
        self._block_index.drop_page(rec)
        self._sealed -= 1

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
