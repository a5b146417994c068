"""Blocks and token keys: which sealed pages form a token block, and which keys name it.

A token key resolves to a :class:`BlockRecord` holding the exact page records registered under
it (identity, not content hashes), so no hash collision can redirect a lookup. A page that is
evicted takes every block naming it, and those blocks' token keys, with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tessera_ray.core._records import FREE, SEALED, BlockRecord, PageRecord
from tessera_ray.core.results import TokenKey

__all__ = ["BlockIndex", "blocks_of"]


class BlockIndex:
    """``page tuple -> block`` and ``token key -> block``; blocks are linked from their pages
    (``PageRecord.blocks``, a field only this index writes)."""

    __slots__ = ("_blocks", "_token_keys")

    def __init__(self) -> None:
        self._blocks: dict[tuple[int, ...], BlockRecord] = {}
        self._token_keys: dict[bytes, BlockRecord] = {}

    def register(
        self, ns: int, block_hash: int, pages: list[PageRecord], token_key: bytes | None
    ) -> bool:
        """Record the block (once per page tuple) and name it by ``token_key``. Returns False
        when the key already names another live block: first registration wins, so a live key
        is never redirected."""
        key = tuple(r.index for r in pages)
        block = self._blocks.get(key)
        if block is None:
            block = BlockRecord(
                namespace=ns, block_hash=block_hash, pages=tuple(pages), token_keys=[]
            )
            self._blocks[key] = block
            # dict.fromkeys: two layers of one block may hold the same (deduplicated) page.
            for r in dict.fromkeys(pages):
                if r.blocks is None:
                    r.blocks = block
                elif isinstance(r.blocks, list):
                    r.blocks.append(block)
                else:
                    r.blocks = [r.blocks, block]
        if token_key is None:
            return True
        existing = self._token_keys.get(token_key)
        if existing is not None:
            return existing is block
        self._token_keys[token_key] = block
        block.token_keys.append(token_key)
        return True

    def find(self, ns: int, token_key: bytes) -> BlockRecord | None:
        """The block ``token_key`` names, if it was registered under namespace ``ns``."""
        block = self._token_keys.get(token_key)
        if block is None or block.namespace != ns:
            return None
        return block

    def drop_block(self, block: BlockRecord) -> None:
        """Forget ``block`` and its token keys; its pages stay (unlinked from it). A no-op for
        a block already forgotten."""
        key = tuple(r.index for r in block.pages)
        if self._blocks.get(key) is not block:
            return
        del self._blocks[key]
        for token_key in block.token_keys:
            del self._token_keys[token_key]
        for page in dict.fromkeys(block.pages):
            _unlink(page, block)

    def unname(self, block: BlockRecord, token_key: bytes) -> None:
        """Forget one of ``block``'s token keys; the block stays, for its other keys."""
        del self._token_keys[token_key]
        block.token_keys.remove(token_key)

    def drop_page(self, rec: PageRecord) -> None:
        """Forget every block that names ``rec`` (it is being evicted), with its token keys."""
        for block in blocks_of(rec):
            del self._blocks[tuple(r.index for r in block.pages)]
            for key in block.token_keys:
                del self._token_keys[key]
            for other in dict.fromkeys(block.pages):
                if other is not rec:
                    _unlink(other, block)
        rec.blocks = None

    def only_in(self, block: BlockRecord) -> list[PageRecord]:
        """The distinct pages of ``block`` that no other block names (what evicting the block
        frees; a page another block also names stays for that block)."""
        # dict.fromkeys: a deduplicated page may repeat in a block.
        return [r for r in dict.fromkeys(block.pages) if all(b is block for b in blocks_of(r))]

    def unnamed(self, oldest_first: Iterable[PageRecord], limit: int) -> list[PageRecord]:
        """The first ``limit`` pages of ``oldest_first`` that no block names."""
        return [r for r in oldest_first if r.blocks is None][: max(limit, 0)]

    def evictable(
        self, oldest_first: Iterable[PageRecord], limit: int, names: Sequence[str]
    ) -> list[tuple[str, TokenKey]]:
        """``(namespace, token key)`` of unreferenced blocks, at most ``limit``, in the order of
        the unreferenced pages ``oldest_first`` (the page LRU); ``names`` maps namespace ids.

        A block is as old as its oldest page on the LRU: it is listed when the walk first meets
        one of its pages, and only if none of its pages is referenced (a referenced block
        cannot be evicted).
        """
        out: list[tuple[str, TokenKey]] = []
        seen: set[int] = set()  # id() of blocks already met: records compare by identity
        for rec in oldest_first:
            if len(out) >= limit:
                break
            for block in blocks_of(rec):
                if id(block) in seen:
                    continue
                seen.add(id(block))
                if any(p.refcount for p in block.pages):
                    continue
                out.extend((names[block.namespace], TokenKey(k)) for k in block.token_keys)
        return out[:limit]

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_token_keys(self) -> int:
        return len(self._token_keys)

    def check(self, records: Iterable[PageRecord]) -> None:
        """Raise ``AssertionError`` naming the first broken link between ``records`` (every
        page of the pool), the blocks and the token keys."""
        for rec in records:
            assert not isinstance(rec.blocks, list) or len(rec.blocks) >= 2, "degenerate block list"
            assert rec.state != FREE or rec.blocks is None, f"free page {rec.index} in a block"
            for block in blocks_of(rec):
                assert self._blocks.get(tuple(r.index for r in block.pages)) is block
        for key, block in self._blocks.items():
            assert key == tuple(r.index for r in block.pages)
            for r in block.pages:
                assert r.state == SEALED and r.namespace == block.namespace
                assert any(b is block for b in blocks_of(r))
        for token, block in self._token_keys.items():
            assert self._blocks.get(tuple(r.index for r in block.pages)) is block
            assert token in block.token_keys


def blocks_of(rec: PageRecord) -> list[BlockRecord]:
    """The blocks that name ``rec``."""
    if rec.blocks is None:
        return []
    return list(rec.blocks) if isinstance(rec.blocks, list) else [rec.blocks]


def _unlink(rec: PageRecord, block: BlockRecord) -> None:
    if rec.blocks is block:
        rec.blocks = None
    elif isinstance(rec.blocks, list):
        rec.blocks.remove(block)
        if len(rec.blocks) == 1:
            rec.blocks = rec.blocks[0]
