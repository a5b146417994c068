"""The connector's edge with the tier is typed: a tier backend raises
:class:`TierUnavailableError` when the tier cannot answer, and the connector recomputes and
counts exactly that; any other exception is a bug, raised on to vLLM from the hook, logged
there once with its traceback and counted."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryUnavailableError, PoolUnavailableError, TierUnavailableError
from tessera_ray.vllm.backend import TierBackend, TierHit, tier_call
from tessera_ray.vllm.records import BlockLoad, StepPlan, TokenRows
from tessera_ray.vllm.scheduler import SchedulerPlanner
from tessera_ray.vllm.stats import ConnectorCounters, counted
from tessera_ray.vllm.worker import WorkerMover
from tests.connector.test_connector_config import LAYOUT, ROW_VALUES, _Request


class _FailingTier(TierBackend):
    """Every call raises ``error`` (lookups through their future, as a real backend does)."""

    def __init__(self, error: Exception) -> None:
        self.layout = LAYOUT
        self.timeout_s = 5.0
        self.error = error
        self.reads = 0

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        future: concurrent.futures.Future[list[TierHit | None]] = concurrent.futures.Future()
        future.set_exception(self.error)
        return future

    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        self.reads += 1
        raise self.error

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        raise self.error

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        raise self.error


def _planner(tier: TierBackend) -> SchedulerPlanner:
    return SchedulerPlanner(
        tier,
        LAYOUT,
        namespace="app",
        model_name="m",
        block_tokens=64,
        can_load=True,
        can_save=False,
    )


def test_a_tier_that_cannot_answer_a_lookup_is_a_counted_miss() -> None:
    planner = _planner(_FailingTier(TierUnavailableError("shard 0 did not answer")))
    assert planner.matched_tokens(_Request("a", list(range(1, 201))), 0) == 0
    counts = planner.counters.take()
    assert counts is not None and counts["tier_failures"] == 1


def test_a_bug_behind_a_lookup_is_not_taken_for_a_tier_that_is_down() -> None:
    planner = _planner(_FailingTier(KeyError("a bug")))
    with pytest.raises(KeyError, match="a bug"):
        planner.matched_tokens(_Request("a", list(range(1, 201))), 0)


def _mover(tier: TierBackend) -> tuple[WorkerMover, dict[str, torch.Tensor], StepPlan]:
    caches = {
        f"layer.{i}": torch.zeros((4, 64, ROW_VALUES), dtype=torch.bfloat16)
        for i in range(LAYOUT.num_layers)
    }
    mover = WorkerMover(tier, LAYOUT, engine_tokens=64, can_save=False, timeout_s=5.0)
    mover.register(caches, lambda name: int(name.split(".")[1]))
    key = TokenKey(b"k" * 32)
    load = BlockLoad("r", "ns", (key,), (TierHit(BlockHash(1)),), 0, TokenRows((2,), 0, 0, 64))
    return mover, caches, StepPlan(loads=(load,))


def test_a_read_the_tier_cannot_answer_recomputes_and_counts() -> None:
    tier = _FailingTier(TierUnavailableError("pool down"))
    mover, caches, plan = _mover(tier)
    mover.start(plan)
    for name in caches:
        mover.wait_layer(plan, name)
    mover.finish(plan)
    assert mover.take_load_errors() == {2}
    counts = mover.counters.take()
    assert counts is not None and counts["tier_failures"] == 1 and tier.reads == 1
    assert all(not kv.any() for kv in caches.values())  # nothing was copied in


def test_a_bug_in_a_read_reaches_the_hook() -> None:
    mover, caches, plan = _mover(_FailingTier(AttributeError("a bug in the read")))
    mover.start(plan)
    with pytest.raises(AttributeError, match="a bug in the read"):
        mover.wait_layer(plan, next(iter(caches)))


class _Hooks:
    def __init__(self) -> None:
        self.counters = ConnectorCounters()

    @counted("forward_s")
    def hook(self, error: Exception | None) -> int:
        if error is not None:
            raise error
        return 1


def test_an_exception_leaving_a_hook_is_logged_once_counted_and_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = _Hooks()
    assert hooks.hook(None) == 1
    with caplog.at_level(logging.ERROR), pytest.raises(ZeroDivisionError):
        hooks.hook(ZeroDivisionError("bug"))
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "hook" in records[0].getMessage()
    counts = hooks.counters.take()
    assert counts is not None and counts["hook_errors"] == 1


@pytest.mark.parametrize(
    "error",
    [PoolUnavailableError("gone"), DirectoryUnavailableError("slow"), TimeoutError("late")],
)
def test_the_tiers_own_failures_leave_a_backend_as_one_type(error: Exception) -> None:
    with pytest.raises(TierUnavailableError) as caught:
        with tier_call("tier read"):
            raise error
    assert caught.value.__cause__ is error


def test_a_backend_lets_a_bug_through_untranslated() -> None:
    with pytest.raises(ValueError, match="bug"):
        with tier_call("tier read"):
            raise ValueError("bug")
