"""``tessera_ray.storage`` sits below the actors: it never imports Ray."""

from __future__ import annotations

import torch

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.layout import preset_layout
from tessera_ray.storage.keys import content_hasher, payload_view
from tests._imports import assert_loads_without


def test_storage_does_not_import_ray() -> None:
    assert_loads_without(("tessera_ray.storage",), ("ray",))


def test_tier_key_equals_the_pools_content_hash() -> None:
    """A page spilled from the pool is stored under the same hash the pool sealed it with."""
    layout = preset_layout("deepseek-v2-lite")
    pool = BlockPool.for_group(layout, 0, PoolConfig(num_pages=2))
    handle = pool.allocate()
    data = torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8)
    handle = pool.write(handle, data)
    sealed = pool.seal(handle, "tenant-a")
    digest = content_hasher("tenant-a", layout.fingerprint)(payload_view(data))
    assert digest == int(sealed.content_hash).to_bytes(16, "big")
    assert digest != content_hasher("tenant-b", layout.fingerprint)(payload_view(data))
