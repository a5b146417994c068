"""Where the connector's own threads run in a worker process (no vLLM import).

vLLM's CPU build pins every thread of a worker process to the worker's compute cores and keeps
``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores for its engine-core process. A connector thread started
in the worker inherits that pin, so its reads, landings and stores would take turns with the
forward pass on the very cores the model computes on. The connector's threads move to the cores
the worker's parent (the engine-core process) may use and the worker may not: the reserved
ones. Where there are none (a GPU worker is not pinned, or nothing is reserved), nothing moves.
"""

from __future__ import annotations

import logging
import os

__all__ = ["spare_cpus", "off_compute_cores"]

log = logging.getLogger(__name__)


def spare_cpus() -> set[int]:
    """The CPUs this process's parent may run on and the calling thread may not (empty where
    the platform cannot say)."""
    try:
        return set(os.sched_getaffinity(os.getppid())) - set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API here, or the parent is gone
        return set()


def off_compute_cores() -> None:
    """Move the calling thread to :func:`spare_cpus`, if there are any (a thread initializer:
    it must run on the new thread, which inherited its creator's pin)."""
    spare = spare_cpus()
    if not spare:
        return
    try:
        os.sched_setaffinity(0, spare)
    except OSError as exc:  # a cpuset that refuses: the thread stays where it was
        log.info("connector thread stays on the compute cores: %s", exc)
