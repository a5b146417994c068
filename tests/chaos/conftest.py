"""The chaos suite's tier and workload: three pools (one per simulated node, write-through to
their disk tiers), two directory shards, a tenant secret, and an agent fleet on the tiny MLA
model whose every served page is checked against the model's own recomputation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.demo.engine import Engine
from tessera_ray.demo.workload import DemoConfig, Fleet
from tests.chaos.ledger import Ledger, results_path
from tests.chaos.workload import Agents
from tests.conftest import SimCluster

SECRET = b"chaos-suite-tenant-secret-0123456789"
PADDED_BLOCKS = 10


@pytest.fixture(scope="session")
def ledger() -> Iterator[Ledger]:
    led = Ledger()
    began = time.monotonic()
    yield led
    led.write(results_path(), duration_s=time.monotonic() - began)


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine(PADDED_BLOCKS)


@pytest.fixture(scope="package")
def chaos_tier(
    tessera_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> Iterator[TesseraClient]:
    disk: Path = tmp_path_factory.mktemp("chaos-disk")
    config = TierConfig(
        model=engine.layout.model,
        pool=PoolServiceConfig(
            num_blocks=40,
            disk_root=disk,
            write_through=True,
            disk_capacity_bytes=1 << 30,
            lease_s=2.0,
        ),
        num_shards=2,
        ray_namespace="tessera-chaos",
        health_interval_s=0.5,
    )
    client = TesseraClient.start(
        config, layout=engine.layout, pools_on=tessera_cluster.node_ids, tenant_secret=SECRET
    )
    client.wait_rebuilt()
    yield client
    client.stop()


@pytest.fixture(scope="package")
def agents(chaos_tier: TesseraClient, engine: Engine, ledger: Ledger) -> Agents:
    config = DemoConfig(
        num_agents=6,
        num_rounds=4,
        num_documents=2,
        system_blocks=1,
        document_blocks=2,
        preamble_blocks=1,
        question_blocks=1,
        tail_tokens=10,
    )
    assert config.max_prompt_blocks() + 1 <= PADDED_BLOCKS
    fleet = Fleet(
        config,
        vocab_size=engine.model.config.vocab_size,
        block_tokens=engine.block_tokens,
        num_pools=len(chaos_tier.pools),
    )
    cred = chaos_tier.issue_credential("fleet")
    return Agents(chaos_tier, engine, fleet.requests(), cred, ledger)
