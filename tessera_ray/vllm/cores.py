"""Which CPUs the connector's own threads run on (no vLLM import).

vLLM's CPU build binds each worker's compute (its main thread and OpenMP threads) to a set of
cores and leaves the rest of what the engine was given to the engine core process, with one
more core held back when a KV connector is configured (``vllm/utils/ompmultiprocessing.py``).
A thread the connector starts inherits the affinity of the thread that started it, which in a
worker is vLLM's bound main thread: the connector's store, read and event-loop threads would
then take turns with the forward pass on its own cores, and an OpenMP barrier waits for the
slowest of its threads, so every slice of a core they take stalls the whole forward.

:func:`leave_engine_cores` moves the calling thread to the cores the engine process was given
but its compute was not bound to (the cores vLLM holds back). Where nothing was bound (a GPU
worker, an engine started with ``VLLM_CPU_OMP_THREADS_BIND=nobind``) or nothing is left over,
it changes nothing. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

__all__ = ["spare_cores", "leave_engine_cores"]

log = logging.getLogger(__name__)


@functools.cache
def spare_cores() -> frozenset[int]:
    """The cores this process's parent may run on and its main thread may not: what vLLM's CPU
    build holds back from a worker's bound compute (empty where nothing was bound). Read once
    per process: the main thread is bound before the connector starts any thread."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return frozenset()
    main = threading.main_thread().native_id
    try:
        # A worker's parent is the engine core process, which vLLM leaves unbound: its cores
        # are what the engine was given (a taskset on the whole server included).
        given = getaffinity(os.getppid())
        bound = getaffinity(main) if main is not None else given
    except OSError:  # the parent is gone or not ours to read: leave the threads as they are
        return frozenset()
    if not bound < given:
        return frozenset()
    return frozenset(given - bound)


def leave_engine_cores() -> None:
    """Move the calling thread off the cores vLLM bound this worker's compute to, onto
    :func:`spare_cores` (nothing to do where there are none). Called first thing by each
    thread the connector starts."""
    cores = spare_cores()
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)  # 0: the calling thread on Linux
    except OSError as exc:  # a cpuset that does not allow them: stay where vLLM put us
        log.debug("connector thread stays on the engine's cores: %s", exc)
