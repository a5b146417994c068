"""``tessera-ray status`` against the shared cluster shows every pool and shard."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import ray

from tessera_ray._cli_status import render_status, status_json
from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.cli import main
from tessera_ray.core import token_key
from tessera_ray.layout import MLAConfig, build_layout
from tests.conftest import SimCluster, kill_and_wait


def _wait_gone(name: str, timeout_s: float = 30.0) -> None:
    """Until Ray has removed the killed actor ``name`` (``ray.kill`` returns before it is
    dead, and a call sent in between may still be answered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} still named {timeout_s} s after ray.kill")


pytestmark = pytest.mark.ray

LAYOUT = build_layout(MLAConfig(name="tiny-mla", num_layers=2, num_heads=4))
NAMESPACE = "tessera-test-status"


def test_status_lists_every_pool_and_shard(
    tessera_cluster: SimCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TierConfig(
        model="tiny-mla",
        pool=PoolServiceConfig(num_blocks=4),
        num_shards=3,
        ray_namespace=NAMESPACE,
    )
    tier = TesseraClient.start(config, layout=LAYOUT, pools_on=tessera_cluster.node_ids)
    try:
        keys = [token_key("t", LAYOUT.fingerprint, None, [i] * 64) for i in range(2)]
        data = np.zeros((2, LAYOUT.block_bytes), dtype=np.uint8)  # two equal blocks: dedup
        tier.store("t", keys, data, pool=tier.pools[0])
        capsys.readouterr()
        assert main(["status", "--ray-namespace", NAMESPACE]) == 0
        out = capsys.readouterr().out
        assert "pools: 3 up, 0 down" in out and "directory shards: 3 up, 0 down" in out
        for name in tier.pools:
            assert name in out
        for s in range(3):
            assert f"shard {s}" in out
        row = next(line for line in out.splitlines() if line.startswith(tier.pools[0]))
        # 2 zero blocks x 2 zero pages: 4 seals onto 1 page, ratio 4.00, 1 of 8 pages in use.
        assert "1/8" in row and "4.00" in row and row.split()[-1] == "ok"
        assert main(["status", "--json", "--ray-namespace", NAMESPACE]) == 0
        snapshot = json.loads(capsys.readouterr().out)
        first = next(p for p in snapshot["pools"] if p["name"] == tier.pools[0])
        assert first["blocks_in_memory"] == 2 and first["pages_used"] == {"memory": 1}
        assert sorted(s["shard"] for s in snapshot["shards"]) == [0, 1, 2]
        # Until its process is gone (a call sent before then may still be answered), and its
        # name with it.
        kill_and_wait(tier.pool(tier.pools[2]))
        _wait_gone(tier.pools[2])
        # A client that knew the pool reports it down; a fresh `status` no longer finds it by
        # name (killed actors leave Ray's name table) and counts only what is alive.
        text = render_status(*tier.status())
        assert "pools: 2 up, 1 down" in text and f"{tier.pools[2]}: down" in text
        down = json.loads(status_json(*tier.status()))["pools"]
        assert sum("down" in p for p in down) == 1
        assert main(["status", "--ray-namespace", NAMESPACE]) == 0
        out = capsys.readouterr().out
        assert "pools: 2 up" in out and tier.pools[2] not in out
    finally:
        tier.stop()
