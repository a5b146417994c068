"""bench_engine_cpu.py's and bench_serve_idle.py's verdicts, without engines: the paired
decode verdict can miss, meet or stay inconclusive by its bootstrap interval; the idle rows
are judged against an upper bound; the machine's CPU is counted per process kind."""

from __future__ import annotations

import os
import sys
from typing import Any

from tests.benchmarks.contract import ROOT
from tests.engine._proc_cpu import cpu_between, cpu_seconds, process_kind

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_engine_cpu
from common import Row
from render import render

sys.path.pop(0)


def _round(step_ms: float, idle: dict[str, float]) -> dict[str, Any]:
    return {"step_s": step_ms / 1e3, "cpu_per_step_s": 0.01, "idle_cores": idle}


def _decode(plain_ms: list[float], tier_ms: list[float]) -> Row:
    plain = [_round(ms, {"ray gcs": 0.01}) for ms in plain_ms]
    tier = [_round(ms, {"ray gcs": 0.01}) for ms in tier_ms]
    return next(r for r in bench_engine_cpu.rows_of(plain, tier) if r.name == "decode_step_paired")


def test_the_paired_decode_verdict_can_miss_meet_or_stay_inconclusive() -> None:
    noisy = [5.0, 9.0, 6.0, 8.0, 5.5, 7.5, 6.5, 9.5, 5.2]
    slower = [x * 1.3 for x in noisy]  # every round 30% slower with the connector
    assert _decode(noisy, slower).verdict == "MISSED"
    assert _decode(noisy, [x * 0.99 for x in noisy]).verdict == "met"
    # Pairs that disagree: the interval holds the target, whatever the medians say.
    mixed = [x * (0.9 if i % 2 else 1.12) for i, x in enumerate(noisy)]
    row = _decode(noisy, mixed)
    assert row.verdict == "inconclusive" and "interval" in (row.inconclusive or "")


def test_paired_ratio_is_the_ratio_of_medians_inside_its_interval() -> None:
    plain = [1.0, 2.0, 3.0, 4.0, 5.0]
    ratio, low, high = bench_engine_cpu.paired_ratio(plain, [2 * x for x in plain])
    assert ratio == low == high == 0.5  # every resample keeps the same ratio


def test_idle_row_is_met_only_within_its_bound() -> None:
    plain = [_round(5.0, {"ray gcs": 0.05, "vllm worker": 0.01})] * 3
    near = [_round(5.0, {"ray gcs": 0.05, "vllm worker": 0.015})] * 3
    far = [_round(5.0, {"ray gcs": 0.05, "vllm worker": 0.25})] * 3
    idle = {r.name: r for r in bench_engine_cpu.rows_of(plain, near)}["idle_cpu_connector"]
    assert idle.verdict == "met" and abs(idle.value - 0.5) < 1e-9  # type: ignore[operator]
    idle = {r.name: r for r in bench_engine_cpu.rows_of(plain, far)}["idle_cpu_connector"]
    assert idle.verdict == "MISSED" and "vllm worker 25.0% (without 1.0%)" in (idle.note or "")
    doc = {
        "benchmark": "engine_cpu",
        "machine": {"cpus": 2},
        "command": "python benchmarks/bench_engine_cpu.py",
        "rows": [idle.to_json()],
    }
    page = render([doc])
    assert "| engine_cpu | idle_cpu_connector | 24 | <= 1 % of a core | MISSED |" in page


def test_cpu_is_counted_per_process_kind() -> None:
    assert process_kind("gcs_server", "/x/gcs_server --flag") == "ray gcs"
    assert process_kind("ray::PoolActor", "ray::PoolActor.ready") == "tier pool"
    assert process_kind("VLLM::Worker", "") == "vllm worker"
    assert process_kind("bash", "bash -c true") == "other"
    before = {1: ("ray gcs", 10.0), 2: ("vllm worker", 3.0)}
    after = {1: ("ray gcs", 10.5), 2: ("vllm worker", 3.0), 3: ("tier pool", 0.25)}
    assert cpu_between(before, after) == {"ray gcs": 0.5, "tier pool": 0.25}
    # This very process is seen, and its CPU only grows.
    mine = cpu_seconds()[os.getpid()]
    sum(i * i for i in range(200_000))
    assert cpu_seconds()[os.getpid()][1] >= mine[1]
