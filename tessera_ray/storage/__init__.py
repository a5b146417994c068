"""Tiers below the pool: pinned host memory and the checksummed filesystem disk tier.

Imports neither Ray nor :mod:`tessera_ray.core`: tiers store page payload bytes keyed by
content hash.
"""

from tessera_ray.storage.config import DiskTierConfig, HostTierConfig
from tessera_ray.storage.disk import DiskTier, DiskTierStats
from tessera_ray.storage.fsck import FsckReport, fsck
from tessera_ray.storage.host import HostMemoryTier
from tessera_ray.storage.keys import (
    KEY_BYTES,
    ContentHasher,
    content_hasher,
    is_key_hex,
    normalize_key,
)
from tessera_ray.storage.tier import StorageTier, TierCapabilities

__all__ = [
    "StorageTier",
    "TierCapabilities",
    "DiskTier",
    "DiskTierConfig",
    "DiskTierStats",
    "HostMemoryTier",
    "HostTierConfig",
    "KEY_BYTES",
    "ContentHasher",
    "content_hasher",
    "normalize_key",
    "is_key_hex",
    "fsck",
    "FsckReport",
]
