"""Registering sealed pages as token blocks: the checks and the block hash.

A block is ``layers_per_block`` sealed pages of one namespace, in layer order; its hash digests
their content hashes, so any pool holding the same bytes computes the same block hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tessera_ray.core._records import SEALED
from tessera_ray.core.hashing import TOKEN_KEY_BYTES, block_hash
from tessera_ray.core.results import BlockSealResult, ContentHash, PageHandle, TokenKey
from tessera_ray.errors import PageNotSealedError, PageShapeError

if TYPE_CHECKING:
    from tessera_ray.core.pool import BlockPool

__all__ = ["seal_block", "register_block"]


def seal_block(
    pool: BlockPool, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey | None
) -> BlockSealResult:
    """Seal one block's pages and register it (under ``token_key`` if given)."""
    _check_size(pool, handles)
    _check_token_key(token_key)
    results = tuple(pool.seal_many(handles, namespace))
    ns = pool._dedup.ids[namespace]
    pages = [pool._records[pool.slot(res.handle)] for res in results]
    bh = block_hash([res.content_hash for res in results], pool._dedup.seeds[ns])
    registered = pool._block_index.register(ns, bh, pages, token_key)
    return BlockSealResult(bh, results, registered)


def register_block(
    pool: BlockPool, handles: Sequence[PageHandle], namespace: str, token_key: TokenKey
) -> bool:
    """Name pages already sealed under ``namespace`` as one block under ``token_key``."""
    _check_size(pool, handles)
    # Not _distinct: two layers of a block may hold one deduplicated page, as in seal_block.
    recs = [pool._resolve(h) for h in handles]
    _check_token_key(token_key)
    ns = pool._dedup.known(namespace)
    for r in recs:
        if r.state != SEALED or r.namespace != ns:
            raise PageNotSealedError(f"page {r.index} is not sealed under {namespace!r}")
    bh = block_hash([ContentHash(r.digest) for r in recs], pool._dedup.seeds[ns])
    return pool._block_index.register(ns, bh, recs, token_key)


def _check_size(pool: BlockPool, handles: Sequence[PageHandle]) -> None:
    if len(handles) != pool.layers_per_block:
        raise PageShapeError(
            f"a block has {pool.layers_per_block} pages (one per layer), got {len(handles)}"
        )


def _check_token_key(token_key: TokenKey | None) -> None:
    if token_key is not None and (
        not isinstance(token_key, bytes) or len(token_key) != TOKEN_KEY_BYTES
    ):
        raise PageShapeError(f"a token key is {TOKEN_KEY_BYTES} bytes (see token_key())")
