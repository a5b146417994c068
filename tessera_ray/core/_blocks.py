"""Blocks and token keys: which sealed pages form a token block, and which keys name it.

A token key resolves to a :class:`BlockRecord` holding the exact page records registered under
it (identity, not content hashes), so no hash collision can redirect a lookup. A page that is
evicted takes every block naming it, and those blocks' token keys, with it.
"""

from __future__ import annotations

from tessera_ray.core._records import BlockRecord, PageRecord

__all__ = ["BlockIndex", "blocks_of"]


class BlockIndex:
    """``page tuple -> block`` and ``token key -> block``; blocks are linked from their pages."""

    __slots__ = ("blocks", "token_keys")

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, ...], BlockRecord] = {}
        self.token_keys: dict[bytes, BlockRecord] = {}

    def register(
        self, ns: int, block_hash: int, pages: list[PageRecord], token_key: bytes | None
    ) -> bool:
        """Record the block (once per page tuple) and name it by ``token_key``. Returns False
        when the key already names another live block: first registration wins, so a live key
        is never redirected."""
        key = tuple(r.index for r in pages)
        block = self.blocks.get(key)
        if block is None:
            block = BlockRecord(
                namespace=ns, block_hash=block_hash, pages=tuple(pages), token_keys=[]
            )
            self.blocks[key] = block
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
        existing = self.token_keys.get(token_key)
        if existing is not None:
            return existing is block
        self.token_keys[token_key] = block
        block.token_keys.append(token_key)
        return True

    def find(self, ns: int, token_key: bytes) -> BlockRecord | None:
        """The block ``token_key`` names, if it was registered under namespace ``ns``."""
        block = self.token_keys.get(token_key)
        if block is None or block.namespace != ns:
            return None
        return block

    def drop_block(self, block: BlockRecord) -> None:
        """Forget ``block`` and its token keys; its pages stay (unlinked from it). A no-op for
        a block already forgotten."""
        key = tuple(r.index for r in block.pages)
        if self.blocks.get(key) is not block:
            return
        del self.blocks[key]
        for token_key in block.token_keys:
            del self.token_keys[token_key]
        for page in dict.fromkeys(block.pages):
            _unlink(page, block)

    def drop_page(self, rec: PageRecord) -> None:
        """Forget every block that names ``rec`` (it is being evicted), with its token keys."""
        for block in blocks_of(rec):
            del self.blocks[tuple(r.index for r in block.pages)]
            for key in block.token_keys:
                del self.token_keys[key]
            for other in dict.fromkeys(block.pages):
                if other is not rec:
                    _unlink(other, block)
        rec.blocks = None


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
