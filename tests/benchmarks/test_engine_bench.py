"""bench_engine.py's comparisons, without engines: the engines it compares differ only in the
connector, its warm-up request touches no tier block, a peer counts only with a full-prefix
hit, and the decode row's verdict follows a bootstrap interval over paired starts."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm.records import NewScheduled
from tessera_ray.vllm.scheduler import SchedulerPlanner
from tests.benchmarks.contract import ROOT
from tests.connector.test_connector_config import _Request, _Tier

sys.path.insert(0, str(ROOT / "benchmarks"))
import _engine_rows
import bench_engine

sys.path.pop(0)

TIER = {"backend": "ray", "ray_address": "127.0.0.1:1"}


def test_decode_engines_differ_only_in_the_connector() -> None:
    base = bench_engine.engine_base("/models/tiny", 4096)
    plain, with_tier = bench_engine.decode_specs(base, TIER, 3)
    differ = {k for k in {*plain, *with_tier} if plain.get(k) != with_tier.get(k)}
    assert differ == {"connector", "connector_stats"}
    # Stat logging is on in both (the connector's counts need it; the other must pay it too).
    assert plain["log_stats"] is True and with_tier["log_stats"] is True
    assert plain["env"] == with_tier["env"] == bench_engine.ENV


def test_the_warm_up_request_is_neither_looked_up_nor_stored() -> None:
    """Through the connector's own planner on the benchmark's tier block: the warm-up asks the
    tier nothing and stores nothing, so a fresh engine's first hit pays the first contact."""
    layout = build_layout(MLAConfig(name="bench-tiny-mla-4", num_layers=4, num_heads=4))
    assert layout.block_tokens == bench_engine.TIER_BLOCK
    tier = _Tier()
    planner = SchedulerPlanner(
        tier,
        layout,
        namespace="app",
        model_name="m",
        block_tokens=16,  # vLLM's CPU block for MLA
        can_load=True,
        can_save=True,
    )
    warm = bench_engine.WARM
    assert planner.matched_tokens(_Request("warm", warm), 0) == 0
    plan = planner.build([NewScheduled("warm", [1, 2, 3], 0, len(warm))], [])
    assert tier.calls == 0 and plan.saves == ()
    # The same planner does look up and store a prompt one tier block longer.
    longer = [*warm, *range(1, bench_engine.TIER_BLOCK + 1)]
    assert planner.matched_tokens(_Request("long", longer), 0) == 0
    assert tier.calls == 1
    blocks = list(range(10, 10 + -(-len(longer) // 16)))
    assert planner.build([NewScheduled("long", blocks, 0, len(longer))], []).saves


def _hit(cached: list[int]) -> dict[str, Any]:
    return {"seconds": [0.2, 0.21, 0.19], "cached": cached[0], "cached_runs": cached}


def test_a_peer_counts_only_where_every_run_loaded_the_whole_prefix() -> None:
    full = bench_engine.peer_row("mooncake", 4096, _hit([4096, 4096, 4096]))
    assert full.value == pytest.approx(0.2) and full.name == "ttft_mooncake_hit_4k"
    for partial in ([2048, 4096, 4096], [4096, 4096, 0]):
        row = bench_engine.peer_row("mooncake", 4096, _hit(partial))
        assert row.value is None and row.note is not None
        assert row.note.startswith("not available: not a full 4096-token prefix hit")


COUNTS = {"worker_steps": 100, "forward_s": 0.002, "scheduler_s": 0.001, "store_cpu_s": 0.0}


def test_decode_cost_is_the_ratio_of_medians_with_a_verdict_from_a_paired_interval() -> None:
    steady = [0.0100, 0.0101, 0.0099, 0.0100, 0.0102, 0.0100, 0.0101, 0.0100, 0.0099]
    cost, hooks = bench_engine.decode_rows("", steady, [s * 1.02 for s in steady], COUNTS)
    assert cost.target_ratio == 0.95 and cost.verdict == "met"
    assert cost.ratio == pytest.approx(1 / 1.02)
    assert cost.derived_from is None
    slow = bench_engine.decode_rows("", steady, [s * 1.2 for s in steady], COUNTS)[0]
    assert slow.verdict == "MISSED" and "lower bound" in slow.to_json()["note"]
    # Pairs whose ratio lands on both sides of the target decide nothing.
    plain = [0.0100] * 9
    mixed = [0.0100, 0.0110, 0.0100, 0.0110, 0.0105, 0.0100, 0.0110, 0.0105, 0.0108]
    vague = bench_engine.decode_rows("", plain, mixed, COUNTS)[0]
    ratio, lo, hi = _engine_rows.paired_interval(plain, mixed)
    assert lo < 0.95 < hi and ratio == pytest.approx(0.0100 / 0.0105)
    assert vague.verdict == "inconclusive" and not vague.missed
    assert "inconclusive on this machine" in vague.to_json()["note"]
    with pytest.raises(ValueError, match="do not pair"):
        _engine_rows.paired_interval(plain, mixed[:-1])
    # The self-timed hook row has no target, is derived, and calls itself a lower bound.
    assert hooks.target_ratio is None and hooks.derived_from and "lower bound" in hooks.note
    assert hooks.to_json()["derived"] is True
