"""The single-process engine: a block pool per layer group.

No Ray here (a test pins it): actors wrap these classes.
"""

from tessera_ray.core.config import PoolConfig, available_memory_bytes
from tessera_ray.core.hashing import ContentHashFn, block_hash, content_seed, token_key, xxh3_128
from tessera_ray.core.pool import BlockPool
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

__all__ = [
    "BlockPool",
    "PoolConfig",
    "available_memory_bytes",
    "PageHandle",
    "PageIndex",
    "ContentHash",
    "BlockHash",
    "TokenKey",
    "SealResult",
    "BlockSealResult",
    "EvictedPage",
    "PoolStats",
    "ContentHashFn",
    "xxh3_128",
    "content_seed",
    "token_key",
    "block_hash",
]
