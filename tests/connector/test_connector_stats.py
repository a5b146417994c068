"""The connector's own counts (what vLLM logs as its "KV Transfer metrics"): hook time lands in
the count it is declared for, each interval is taken once, and the reduced figures are per
step and per block."""

from __future__ import annotations

import time

import pytest

from tessera_ray.vllm.stats import (
    ConnectorCounters,
    counted,
    reduce_counts,
    sum_counts,
)


class _Hooks:
    def __init__(self) -> None:
        self.counters = ConnectorCounters()

    @counted("forward_s", "worker_steps")
    def step(self, sleep_s: float) -> str:
        time.sleep(sleep_s)
        return "done"

    @counted("scheduler_s")
    def fails(self) -> None:
        raise RuntimeError("boom")


def test_hook_time_and_steps_land_where_declared_and_are_taken_once() -> None:
    hooks = _Hooks()
    assert hooks.counters.take() is None  # nothing happened yet
    assert hooks.step(0.01) == "done"
    assert hooks.step(0.0) == "done"
    with pytest.raises(RuntimeError, match="boom"):
        hooks.fails()  # a hook that raises is still counted, and the error passes through
    counts = hooks.counters.take()
    assert counts is not None
    assert counts["worker_steps"] == 2
    assert 0.01 <= counts["forward_s"] < 1.0
    assert counts["scheduler_s"] > 0 and counts["scheduler_steps"] == 0
    assert hooks.counters.take() is None


def test_background_store_counts_blocks_wall_and_cpu_time() -> None:
    counters = ConnectorCounters()

    def store() -> int:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:  # CPU work, so the thread's CPU time moves
            pass
        return 3

    counters.timed_store(store)
    counts = counters.take()
    assert counts is not None and counts["saved_blocks"] == 3
    assert counts["store_s"] >= counts["store_cpu_s"] >= 0.015


def test_unknown_count_names_are_refused_when_a_hook_is_declared() -> None:
    with pytest.raises(ValueError, match="forward_ms"):
        counted("forward_ms")


def test_intervals_add_and_reduce_to_per_step_figures() -> None:
    a = {"worker_steps": 4, "forward_s": 0.0002, "saved_blocks": 1, "store_s": 0.03}
    b = {"worker_steps": 6, "forward_s": 0.0003, "scheduler_steps": 10, "scheduler_s": 0.0004}
    total = sum_counts(a, b)
    assert total["worker_steps"] == 10 and total["scheduler_steps"] == 10
    reduced = reduce_counts(total)
    assert reduced["steps"] == 10
    assert reduced["forward_us_per_step"] == pytest.approx(50.0)
    assert reduced["scheduler_us_per_step"] == pytest.approx(40.0)
    assert reduced["store_ms_per_block"] == pytest.approx(30.0)
    assert reduce_counts({})["forward_us_per_step"] == 0.0  # no step: no division by zero
