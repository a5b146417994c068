"""TesseraConnector against vLLM's real classes (config, factory, scheduler, requests), with the
in-process tier (``backend="local"``). See ``_engine.py`` for how a step is driven."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tessera_ray.errors import TierConfigError
from tessera_ray.serve.connector import (
    TesseraConnector,
    TesseraConnectorConfig,
    TesseraConnectorMetadata,
)
from tests.vllm._engine import BLOCK, LAYERS, Engine, fake_kv, vllm_config, write_model_dir

_names = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture
def extra() -> dict[str, Any]:
    # The model name is in the layout fingerprint, so each test gets its own in-process tier.
    return {"backend": "local", "model_name": f"tiny-mla-{next(_names)}", "local_num_blocks": 32}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def _store(model_dir: Path, extra: dict[str, Any], tokens: list[int], salt: str | None = None):
    """One engine runs ``tokens`` through prefill: its connector saves the full blocks."""
    engine = Engine(vllm_config(model_dir, extra))
    engine.scheduler.add_request(engine.request("A", tokens, cache_salt=salt))
    result = engine.step()
    assert result.load_errors == set()
    meta = result.output.kv_connector_metadata
    assert isinstance(meta, TesseraConnectorMetadata)
    assert sum(len(s.block_ids) for s in meta.plan.saves) == len(tokens) // BLOCK
    return engine


def test_factory_creates_both_roles(model_dir: Path, extra: dict[str, Any]) -> None:
    engine = Engine(vllm_config(model_dir, extra))
    assert isinstance(engine.connector, TesseraConnector)
    assert engine.connector.role == KVConnectorRole.SCHEDULER
    assert isinstance(engine.worker, TesseraConnector)
    assert engine.worker.role == KVConnectorRole.WORKER


def test_matched_tokens_are_the_stored_full_block_prefix(
    model_dir: Path, extra: dict[str, Any]
) -> None:
    stored = prompt(200)  # 3 full blocks and 8 tokens
    _store(model_dir, extra, stored)
    other = Engine(vllm_config(model_dir, extra))  # a second engine, sharing only the tier
    c = other.connector

    assert c.get_num_new_matched_tokens(other.request("B", stored[:192] + prompt(40, 1)), 0) == (
        192,
        False,
    )
    # Diverging inside block 2: only blocks 0 and 1 match.
    assert c.get_num_new_matched_tokens(other.request("C", stored[:150] + prompt(60, 2)), 0) == (
        128,
        False,
    )
    # A block-aligned prompt leaves its last block to vLLM (the last token must be computed).
    assert c.get_num_new_matched_tokens(other.request("D", stored[:192]), 0) == (128, False)
    # Tokens vLLM already has locally are not asked for again.
    assert c.get_num_new_matched_tokens(other.request("E", [*stored[:192], 9]), 64) == (128, False)
    assert c.get_num_new_matched_tokens(other.request("F", prompt(300, 3)), 0) == (0, False)


def test_another_cache_salt_matches_nothing(model_dir: Path, extra: dict[str, Any]) -> None:
    stored = prompt(200)
    _store(model_dir, extra, stored, salt="tenant-a")
    other = Engine(vllm_config(model_dir, extra))
    c = other.connector
    probe = [*stored[:192], 1]
    assert c.get_num_new_matched_tokens(other.request("A2", probe, "tenant-a"), 0) == (192, False)
    assert c.get_num_new_matched_tokens(other.request("B", probe, "tenant-b"), 0) == (0, False)
    assert c.get_num_new_matched_tokens(other.request("N", probe), 0) == (0, False)


def test_loaded_blocks_are_byte_identical_to_saved(model_dir: Path, extra: dict[str, Any]) -> None:
    stored = prompt(200)
    first = _store(model_dir, extra, stored)
    second = Engine(vllm_config(model_dir, extra))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))

    result = second.step()

    assert result.load_errors == set()
    meta = result.output.kv_connector_metadata
    (load,) = meta.plan.loads
    assert len(load.block_ids) == 3
    assert list(load.block_ids) == second.block_ids["B"][:3]
    for i, block_id in enumerate(load.block_ids):
        saved = first.block_bytes(first.block_ids["A"][i])
        loaded = second.block_bytes(block_id)
        for layer, (s, got) in enumerate(zip(saved, loaded, strict=True)):
            assert torch.equal(s, got)
            expected = fake_kv(stored[: (i + 1) * BLOCK], layer)[i * BLOCK :]
            assert torch.equal(got, expected.view(torch.uint8))
    assert second.scheduler.requests["B"].num_computed_tokens == len(tokens)


@pytest.mark.parametrize("fault", ["evicted", "corrupted"])
def test_failed_block_is_reported_and_nothing_partial_is_left(
    model_dir: Path, extra: dict[str, Any], fault: str
) -> None:
    stored = prompt(200)
    first = _store(model_dir, extra, stored)
    second = Engine(vllm_config(model_dir, extra))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))
    out = second.scheduler.schedule()  # lookup done, blocks allocated, load planned
    (load,) = out.kv_connector_metadata.plan.loads
    ids = list(load.block_ids)

    # Between the lookup and the load, block 1 leaves the tier or its bytes rot.
    pool = second.worker.tier.service.pools[0]
    key = load.token_keys[1]
    if fault == "evicted":
        assert pool.evict_block(load.namespace, key, copy_data=False) is not None
    else:
        handles = pool.lookup(load.namespace, key)
        slot = handles[-1].offset // handles[-1].length
        pool.data[slot, 1000:1016] ^= 0x5A
        pool.release_many(list(handles))
    before = {b: second.block_bytes(b) for b in ids}

    result = second.step(out)

    # Block 1 failed; block 2 follows it (vLLM recomputes from the first failed block).
    assert result.load_errors == {ids[1], ids[2]}
    for layer_bytes, want in zip(
        second.block_bytes(ids[0]), first.block_bytes(first.block_ids["A"][0]), strict=True
    ):
        assert torch.equal(layer_bytes, want)
    for b in ids[1:]:
        for got, was in zip(second.block_bytes(b), before[b], strict=True):
            assert torch.equal(got, was), f"block {b} was partly written"
    # vLLM's scheduler took the report: the request resumes at the first failed block.
    assert second.scheduler.requests["B"].num_computed_tokens == BLOCK

    result = second.step()  # vLLM recomputes blocks 1.. and the connector saves them again
    assert result.load_errors == set()
    for b in ids[1:]:
        i = ids.index(b)
        for got, want in zip(
            second.block_bytes(b), first.block_bytes(first.block_ids["A"][i]), strict=True
        ):
            assert torch.equal(got, want)
    # The tier holds good bytes for every block again (a rotten copy was reported, dropped by
    # its pool and saved afresh): another engine loads all three without a load error.
    third = Engine(vllm_config(model_dir, extra))
    probe = third.request("P", [*stored[:192], 1])
    assert third.connector.get_num_new_matched_tokens(probe, 0) == (192, False)
    third.scheduler.add_request(third.request("C", tokens))
    result = third.step()
    assert result.load_errors == set()
    assert third.scheduler.requests["C"].num_computed_tokens == len(tokens)


def test_consumer_saves_nothing_and_producer_loads_nothing(
    model_dir: Path, extra: dict[str, Any]
) -> None:
    stored = prompt(200)
    consumer = Engine(vllm_config(model_dir, extra, kv_role="kv_consumer"))
    consumer.scheduler.add_request(consumer.request("A", stored))
    assert consumer.step().output.kv_connector_metadata.plan.saves == ()

    _store(model_dir, extra, stored)
    producer = Engine(vllm_config(model_dir, extra, kv_role="kv_producer"))
    probe = producer.request("B", [*stored[:192], 1])
    assert producer.connector.get_num_new_matched_tokens(probe, 0) == (0, False)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"blocks": 3}, "unknown key.*blocks.*valid keys"),
        ({"local_num_blocks": "many"}, "local_num_blocks must be an int"),
        ({"backend": "redis"}, "backend must be one of"),
        ({"timeout_s": -1}, "timeout_s must be positive"),
    ],
)
def test_bad_extra_config_is_refused_by_name(
    model_dir: Path, extra: dict[str, Any], bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(TierConfigError, match=message):
        Engine(vllm_config(model_dir, {**extra, **bad}))


def test_layers_are_registered_in_model_order(model_dir: Path, extra: dict[str, Any]) -> None:
    engine = Engine(vllm_config(model_dir, extra))
    layers = engine.worker.mover._layers
    assert [layers[name][0] for name in LAYERS] == list(range(len(LAYERS)))


def test_deploy_example_settings_are_valid() -> None:
    import yaml
    from vllm.config import KVTransferConfig

    root = Path(__file__).resolve().parents[2]
    app = yaml.safe_load((root / "deploy" / "serve_llm_tessera.yaml").read_text())
    (llm,) = app["applications"][0]["args"]["llm_configs"]
    transfer = KVTransferConfig(**llm["engine_kwargs"]["kv_transfer_config"])
    assert transfer.kv_connector_module_path == "tessera_ray.serve.connector"
    assert transfer.kv_load_failure_policy == "recompute"
    cfg = TesseraConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
    assert cfg.backend == "ray"
    assert llm["engine_kwargs"]["block_size"] == BLOCK
