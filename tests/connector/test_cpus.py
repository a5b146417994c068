"""The connector's threads in a pinned worker move to the cores its parent may use and it may
not (vLLM's CPU build pins a worker's threads to its compute cores and reserves the rest)."""

from __future__ import annotations

import os
import threading

import pytest

from tessera_ray.vllm.cpus import off_compute_cores, spare_cpus


def _on_thread(pin: set[int]) -> tuple[set[int], set[int]]:
    """On a new thread pinned to ``pin`` (as vLLM pins a worker): the spare CPUs it sees, and
    where it runs after :func:`off_compute_cores`."""
    seen: dict[str, set[int]] = {}

    def body() -> None:
        os.sched_setaffinity(0, pin)
        seen["spare"] = spare_cpus()
        off_compute_cores()
        seen["after"] = set(os.sched_getaffinity(0))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    return seen["spare"], seen["after"]


def test_a_thread_pinned_to_compute_cores_moves_to_the_parents_other_cores() -> None:
    parent = set(os.sched_getaffinity(os.getppid()))
    mine = set(os.sched_getaffinity(0))
    if len(parent & mine) < 2:
        pytest.skip("needs two CPUs this process and its parent may both use")
    compute = {min(parent & mine)}
    spare, after = _on_thread(compute)
    assert spare == parent - compute
    assert after == parent - compute
    assert set(os.sched_getaffinity(0)) == mine  # the caller's own thread did not move


def test_a_thread_not_pinned_apart_from_its_parent_stays_where_it_is() -> None:
    parent = set(os.sched_getaffinity(os.getppid()))
    mine = set(os.sched_getaffinity(0))
    if not parent <= mine:
        pytest.skip("this process may use fewer CPUs than its parent")
    spare, after = _on_thread(mine)
    assert spare == set() and after == mine
