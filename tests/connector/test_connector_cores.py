"""The connector's threads leave the cores vLLM's CPU build binds a worker's compute to
(:mod:`tessera_ray.vllm.cores`): a child process binds its main thread to one core as vLLM
does, and the connector's event-loop and store threads it then starts run on the others."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's"
)


class _AffinityTier:
    """A tier whose store records the CPUs the calling thread may run on."""

    def __init__(self) -> None:
        self.cores: set[int] | None = None

    def store(self, namespace: str, keys: Any, payloads: np.ndarray) -> None:
        self.cores = os.sched_getaffinity(0)


def _bound_worker(queue: Any) -> None:
    """As a vLLM CPU worker: the main thread bound to one core, then the connector's threads."""
    from tessera_ray.vllm.cores import spare_cores
    from tessera_ray.vllm.loop import run_on_loop
    from tessera_ray.vllm.stats import ConnectorCounters
    from tessera_ray.vllm.store_queue import StoreQueue

    given = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {given[0]})

    async def loop_cores() -> set[int]:
        return os.sched_getaffinity(0)

    on_loop = run_on_loop(loop_cores(), 10.0)
    tier = _AffinityTier()
    stores = StoreQueue(tier, ConnectorCounters())  # type: ignore[arg-type]
    stores.submit({"ns": ([], [0])}, torch.zeros((1, 8), dtype=torch.uint8), seq=1)
    stores.close()
    queue.put(
        (
            given,
            sorted(spare_cores()),
            sorted(on_loop),
            sorted(tier.cores or ()),
            sorted(os.sched_getaffinity(0)),
        )
    )


def test_the_connectors_threads_run_on_the_cores_vllm_leaves_free() -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_bound_worker, args=(queue,))
    child.start()
    given, spare, on_loop, store_thread, main = queue.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    assert main == given[:1]  # the bound compute stays where it was put
    # On one core there is nothing to leave for; everywhere else the threads leave it.
    assert spare == given[1:]
    assert on_loop == store_thread == (given[1:] or given[:1])


def test_a_process_whose_main_thread_is_not_bound_keeps_its_threads_where_they_are() -> None:
    """A GPU worker, or an engine started with ``VLLM_CPU_OMP_THREADS_BIND=nobind``: its main
    thread may run where its parent may, so there are no spare cores and nothing moves."""
    script = (
        "import os\n"
        "from tessera_ray.vllm.cores import leave_engine_cores, spare_cores\n"
        "before = os.sched_getaffinity(0)\n"
        "leave_engine_cores()\n"
        "print(sorted(spare_cores()), os.sched_getaffinity(0) == before)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert run.stdout.split() == ["[]", "True"]
