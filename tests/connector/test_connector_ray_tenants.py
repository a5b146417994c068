"""The connector's Ray backend on a tier started with a tenant secret: with the secret file it
issues itself a credential per tenant namespace and round-trips blocks; without it every call
is refused; a missing or short secret file is a config error naming the key. (vLLM itself is
exercised in tests/vllm.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.messages import BlockCheck
from tessera_ray.core import token_key
from tessera_ray.errors import TenantError, TierConfigError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm.connector import TesseraConnectorConfig
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.ray_tier import RayTier
from tests.conftest import SimCluster

pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla-tenants", num_layers=2, num_heads=4))
SECRET = b"connector-test-tenant-secret-0123"
RAY_NS = "tessera-connector-tenants"


@pytest.fixture(scope="module")
def closed_tier(tessera_cluster: SimCluster) -> Iterator[TesseraClient]:
    config = TierConfig(
        model=LAYOUT.model,
        pool=PoolServiceConfig(num_blocks=8),
        num_shards=1,
        ray_namespace=RAY_NS,
    )
    client = TesseraClient.start(
        config, layout=LAYOUT, pools_on=tessera_cluster.node_ids[:1], tenant_secret=SECRET
    )
    yield client
    client.stop()


def test_ray_backend_issues_credentials_from_the_secret_file(
    closed_tier: TesseraClient, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    tier = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS, tenant_secret_file=str(secret)))
    ns = "vllm/tenant-x"
    keys = [token_key(ns, LAYOUT.fingerprint, None, [i] * 64) for i in range(2)]
    rows = np.random.default_rng(0).integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    tier.store(ns, keys, rows)
    hashes = [h.block_hash if h is not None else None for h in tier.lookup(ns, keys)]
    assert hashes == [payload_block_hash(LAYOUT, ns, r) for r in rows]
    got = tier.read(ns, keys)
    assert all(g is not None for g in got)
    assert np.array_equal(np.stack([g.payload for g in got if g is not None]), rows)
    assert [g.block_hash for g in got if g is not None] == hashes
    # Asked to check blocks a load could not verify, the pool finds its copies sound.
    assert tier.report_unverified(ns, keys) == [BlockCheck.INTACT] * 2
    # Another tenant namespace sees none of it, though it asks with the same keys.
    assert tier.lookup("vllm/tenant-y", keys) == [None, None]

    open_tier = RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS))
    with pytest.raises(TenantError, match="requires a tenant credential"):
        open_tier.lookup(ns, keys)


def test_secret_file_errors_name_the_key(closed_tier: TesseraClient, tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match=r"tenant_secret_file .* cannot be read"):
        RayTier(
            TesseraConnectorConfig(ray_namespace=RAY_NS, tenant_secret_file=str(tmp_path / "no"))
        )
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    with pytest.raises(TierConfigError, match="under 16 bytes"):
        RayTier(TesseraConnectorConfig(ray_namespace=RAY_NS, tenant_secret_file=str(short)))
