"""TesseraConnector over the Ray tier (``backend="ray"``): one small local Ray on 127.0.0.1, one
pool actor, one directory shard; two vLLM engines share prefix blocks through it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.errors import LayoutError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.transport.config import TransportConfig
from tests.vllm._engine import BLOCK, NUM_LAYERS, Engine, vllm_config, write_model_dir

RAY_NS = "tessera-vllm-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-mla-ray"))


@pytest.fixture(scope="module")
def tier() -> Iterator[TesseraClient]:
    import ray

    for attempt in range(3):
        try:
            ray.init(
                address="local",  # a Ray of its own, never one already running on the machine
                num_cpus=2,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                object_store_memory=128 << 20,
                namespace=RAY_NS,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
            break
        except Exception:
            # Ray gives its raylet a fixed 30 s to register; a loaded 2-core machine can miss
            # that once. Anything else fails the same way again and is raised.
            ray.shutdown()
            if attempt == 2:
                raise
    # The tier's layout is the engine's cache geometry: 2 MLA layers, 64-token bf16 pages.
    layout = build_layout(MLAConfig(name="tiny-mla", num_layers=NUM_LAYERS, num_heads=4))
    client = TesseraClient.start(
        TierConfig(
            model="tiny-mla",
            pool=PoolServiceConfig(num_blocks=32, transport=TransportConfig(kind="ray")),
            num_shards=1,
            ray_namespace=RAY_NS,
        ),
        layout=layout,
        quiet=True,
    )
    try:
        yield client
    finally:
        client.stop()
        ray.shutdown()


def _extra(**more: Any) -> dict[str, Any]:
    return {
        "backend": "ray",
        "ray_namespace": RAY_NS,
        "model_name": "tiny-mla",
        "lookup_wait_s": 10.0,  # deterministic answers; the None path is tested in-process
        **more,
    }


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 104729 + i * 17) % 1000 + 1 for i in range(n)]


def test_two_engines_share_a_prefix_through_the_ray_tier(
    model_dir: Path, tier: TesseraClient
) -> None:
    stored = prompt(200)
    first = Engine(vllm_config(model_dir, _extra()))
    first.scheduler.add_request(first.request("A", stored))
    assert first.step().load_errors == set()

    second = Engine(vllm_config(model_dir, _extra()))
    tokens = stored[:192] + prompt(30, 1)
    request = second.request("B", tokens)
    assert second.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    salted = second.request("S", tokens, cache_salt="someone-else")
    assert second.connector.get_num_new_matched_tokens(salted, 0) == (0, False)

    second.scheduler.add_request(request)
    result = second.step()
    assert result.load_errors == set()
    (load,) = result.output.kv_connector_metadata.plan.loads
    assert (load.rows.start, load.rows.stop) == (0, 192)
    for want, got in zip(first.rows("A", 0, 192), second.rows("B", 0, 192), strict=True):
        assert torch.equal(want, got)
    assert second.scheduler.requests["B"].num_computed_tokens == len(tokens)
    status, _ = tier.status()
    assert status[0].blocks_in_memory >= len(stored) // BLOCK  # type: ignore[union-attr]


def test_engine_geometry_other_than_the_tier_is_refused(
    tmp_path: Path, tier: TesseraClient
) -> None:
    from tests.vllm import _engine

    config = dict(_engine.TINY_MLA_CONFIG, num_hidden_layers=3, first_k_dense_replace=3)
    other = tmp_path / "three-layers"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(LayoutError, match="2 layers"):
        Engine(vllm_config(other, _extra()))


def test_a_lookup_of_what_this_nodes_pool_holds_asks_no_directory(
    model_dir: Path, tier: TesseraClient
) -> None:
    """The scheduler's lookup is answered by this node's pool first: when the pool holds the
    whole run, the directory is not asked; a run the pool does not hold still goes to the
    directory, every key of it (the shards count the keys they were asked)."""
    stored = prompt(200, 2)
    first = Engine(vllm_config(model_dir, _extra()))
    first.scheduler.add_request(first.request("A", stored))
    assert first.step().load_errors == set()

    def directory_keys_asked() -> int:
        return sum(s.lookups for s in tier.status()[1] if not isinstance(s, str))

    second = Engine(vllm_config(model_dir, _extra()))
    before = directory_keys_asked()
    request = second.request("B", stored[:192] + prompt(30, 3))
    assert second.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    assert directory_keys_asked() == before
    unknown = second.request("C", prompt(200, 4))
    assert second.connector.get_num_new_matched_tokens(unknown, 0) == (0, False)
    assert directory_keys_asked() == before + 3  # the pool held none of its blocks
