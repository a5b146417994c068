"""What the connector's tests against a running tier share: a tier with one pool on this
process's node (the head) and one on another simulated node, and random blocks to store."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.core import token_key
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import TransportConfig
from tests.conftest import SimCluster

__all__ = ["two_pool_tier", "random_blocks"]


def two_pool_tier(
    cluster: SimCluster, layout: ModelLayout, ray_namespace: str, *, num_blocks: int, shards: int
) -> Iterator[TesseraClient]:
    """A module fixture's body: the tier, NIXL between its pools, stopped afterwards."""
    config = TierConfig(
        model=layout.model,
        pool=PoolServiceConfig(num_blocks=num_blocks, transport=TransportConfig(kind="nixl")),
        num_shards=shards,
        ray_namespace=ray_namespace,
    )
    client = TesseraClient.start(config, layout=layout, pools_on=cluster.node_ids[:2])
    yield client
    client.stop()


def random_blocks(
    layout: ModelLayout, namespace: str, n: int, seed: int
) -> tuple[list[bytes], np.ndarray]:
    """``n`` token keys (one run of blocks per ``seed``) and random payloads for them."""
    keys = [token_key(namespace, layout.fingerprint, None, [seed, i] * 32) for i in range(n)]
    rows = np.random.default_rng(seed).integers(0, 256, (n, layout.block_bytes), dtype=np.uint8)
    return keys, rows
