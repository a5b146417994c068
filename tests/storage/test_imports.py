"""``tessera_ray.storage`` sits below the actors: it never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import torch

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.layout import preset_layout
from tessera_ray.storage.keys import content_hasher, payload_view


def test_storage_does_not_import_ray() -> None:
    code = (
        "import sys, tessera_ray.storage; "
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


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
