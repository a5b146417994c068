"""The vLLM connector's parts that need no vLLM: the module imports without it, its config
parser refuses bad input by name, and the scheduler-side planner and the load verification
agree with the tier (vLLM itself is exercised in tests/vllm, ``make test-vllm``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LayoutError, TierConfigError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.serve import connector
from tessera_ray.serve._connector_plan import (
    BlockLoad,
    NewScheduled,
    SchedulerPlanner,
    StepPlan,
)
from tessera_ray.serve._connector_tier import LocalTier, payload_block_hash
from tessera_ray.serve._connector_worker import WorkerMover
from tessera_ray.serve.connector import TesseraConnectorConfig, tenant_namespace

LAYOUT = build_layout(MLAConfig(name="tiny-mla-connector", num_layers=2, num_heads=4))


def test_module_imports_without_vllm_and_names_it_when_the_class_is_asked_for() -> None:
    assert "TesseraConnector" in connector.__all__
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs vLLM"):
            _ = connector.TesseraConnector
    with pytest.raises(AttributeError):
        _ = connector.NoSuchThing  # type: ignore[attr-defined]


def test_config_defaults_and_a_valid_mapping() -> None:
    assert TesseraConnectorConfig.from_extra_config(None) == TesseraConnectorConfig()
    cfg = TesseraConnectorConfig.from_extra_config(
        {"backend": "local", "local_num_blocks": 8, "timeout_s": 5, "pool": None}
    )
    assert (cfg.backend, cfg.local_num_blocks, cfg.timeout_s, cfg.pool) == ("local", 8, 5, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"namespce": "x"}, r"unknown key\(s\) namespce.*valid keys: backend"),
        ({"backend": "redis"}, "backend must be one of 'ray', 'local'"),
        ({"local_num_blocks": True}, "local_num_blocks must be an int"),
        ({"local_num_blocks": 0}, "local_num_blocks must be a positive integer"),
        ({"timeout_s": "10"}, "timeout_s must be a float"),
        ({"namespace": ""}, "namespace must be a non-empty string"),
        ({"pool": 3}, "pool must be a str or null"),
        (["backend"], "must be a mapping"),
    ],
)
def test_config_refuses_bad_input_by_name(extra: Any, message: str) -> None:
    with pytest.raises(TierConfigError, match=message):
        TesseraConnectorConfig.from_extra_config(extra)


def test_cache_salt_picks_a_tenant_namespace_without_revealing_the_salt() -> None:
    assert tenant_namespace("app", None) == tenant_namespace("app", "") == "app"
    a, b = tenant_namespace("app", "secret-a"), tenant_namespace("app", "secret-b")
    assert a != b and a.startswith("app/") and "secret" not in a


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class _Tier:
    def __init__(self) -> None:
        self.held: dict[tuple[str, TokenKey], BlockHash] = {}
        self.calls = 0

    def lookup(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockHash | None]:
        self.calls += 1
        return [self.held.get((namespace, k)) for k in keys]


def _planner(tier: _Tier) -> SchedulerPlanner:
    return SchedulerPlanner(
        tier,
        LAYOUT,
        namespace="app",
        model_name="m",
        block_tokens=64,
        can_load=True,
        can_save=True,
    )


def test_planner_saves_full_blocks_and_matches_them_in_one_lookup() -> None:
    tier, tokens = _Tier(), list(range(1, 201))
    writer = _planner(tier)
    writer.matched_tokens(_Request("a", tokens), 0)
    plan = writer.build([NewScheduled("a", list(range(10, 14)), 0, 200)], [])
    (save,) = plan.saves
    assert save.block_ids == (10, 11, 12) and len(set(save.token_keys)) == 3
    for i, key in enumerate(save.token_keys):
        tier.held[(save.namespace, key)] = BlockHash(i + 1)

    reader = _planner(tier)
    tier.calls = 0
    assert reader.matched_tokens(_Request("b", [*tokens[:192], 7]), 0) == 192
    assert tier.calls == 1
    assert reader.matched_tokens(_Request("c", tokens[:192]), 0) == 128  # last token computed
    assert reader.matched_tokens(_Request("d", [*tokens[:192], 7], "other"), 0) == 0


def test_planner_refuses_a_block_size_other_than_the_tiers() -> None:
    with pytest.raises(LayoutError, match="block_size=64"):
        SchedulerPlanner(
            _Tier(),
            LAYOUT,
            namespace="a",
            model_name="m",
            block_tokens=16,
            can_load=True,
            can_save=True,
        )


def test_load_verification_hash_is_the_pools_block_hash() -> None:
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rows = np.random.default_rng(0).integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(bytes([i]) * 32) for i in range(2)]
    tier.store("ns", keys, rows)
    hashes = tier.lookup("ns", keys)
    assert hashes == [payload_block_hash(LAYOUT, "ns", row) for row in rows]
    read = tier.read("ns", keys)
    assert all(
        r is not None and np.array_equal(r.payload, w) and r.block_hash == h
        for r, w, h in zip(read, rows, hashes, strict=True)
    )
    flipped = rows[1].copy()
    flipped[5] ^= 1
    assert payload_block_hash(LAYOUT, "ns", flipped) != hashes[1]
    assert payload_block_hash(LAYOUT, "other", rows[1]) != hashes[1]


def _mover(tier: LocalTier, num_blocks: int) -> tuple[WorkerMover, dict[str, torch.Tensor]]:
    """A worker mover over ``num_blocks``-block bf16 caches of LAYOUT, one per layer."""
    page = LAYOUT.groups[0].page
    values = page.page_bytes // 2 // page.block_tokens
    caches = {
        f"layer.{i}": torch.zeros((num_blocks, page.block_tokens, values), dtype=torch.bfloat16)
        for i in range(LAYOUT.num_layers)
    }
    mover = WorkerMover(tier, LAYOUT, can_save=False, timeout_s=10.0)
    mover.register(caches, lambda name: int(name.split(".")[1]))
    return mover, caches


def test_load_takes_other_valid_bytes_under_a_key_and_refuses_rotten_ones() -> None:
    """Under one token key the pool may hold other valid bytes than the lookup saw (an engine
    whose KV is not bitwise reproducible stored it): loaded, not recomputed on every request.
    Bytes that no longer match the pool's own seal are refused, nothing of them lands, and
    the pool, told so, drops its rotten copy so that the next save replaces it."""
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(bytes([7 + i]) * 32) for i in range(2)]
    tier.store("ns", keys, rows)
    other = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
    seen_by_lookup = payload_block_hash(LAYOUT, "ns", other)  # what another pool sealed
    hashes = tier.lookup("ns", keys)
    load = BlockLoad("r", "ns", (2, 0), tuple(keys), (seen_by_lookup, hashes[1]))
    mover, caches = _mover(tier, 3)
    plan = StepPlan(loads=(load,))
    mover.start(plan)
    mover.finish(plan)
    assert mover.take_load_errors() == set()
    for name, kv in caches.items():
        i, page = int(name.split(".")[1]), LAYOUT.groups[0].page.page_bytes
        for block_id, row in ((2, rows[0]), (0, rows[1])):
            got = kv[block_id].reshape(-1).view(torch.uint8).numpy()
            assert np.array_equal(got, row[i * page : (i + 1) * page])

    # The pool's copy of the first block rots: its load fails, and so does the one after it
    # (vLLM recomputes from the first failed block); neither block of vLLM's cache is touched.
    pool = tier.service.pools[0]
    handles = pool.lookup("ns", keys[0])
    assert handles is not None
    slot = handles[0].offset // handles[0].length
    pool.data[slot, 100] ^= 0x10
    pool.release_many(list(handles))
    mover, caches = _mover(tier, 3)
    plan = StepPlan(loads=(load,))
    mover.start(plan)
    mover.finish(plan)
    assert mover.take_load_errors() == {2, 0}
    assert all(not kv.any() for kv in caches.values())
    # The connector reported the block; the pool proved it rotten and dropped it, so the save
    # that follows vLLM's recompute stores it afresh and the next request loads it.
    assert tier.service.status().rotten_blocks == 1
    assert tier.lookup("ns", keys) == [None, hashes[1]]
    tier.store("ns", keys[:1], rows[:1])
    mover, caches = _mover(tier, 3)
    plan = StepPlan(loads=(load,))
    mover.start(plan)
    mover.finish(plan)
    assert mover.take_load_errors() == set()
