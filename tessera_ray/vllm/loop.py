"""The vLLM connector's private event-loop thread (no Ray import).

vLLM calls the connector from plain threads that may or may not already run a loop of their
own, so the tier backends run their coroutines on one daemon loop thread per process, started
on first use; the one thread also serialises every use of a shared in-process tier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tessera_ray.vllm.cpus import off_compute_cores

__all__ = ["submit_on_loop", "run_on_loop"]

_T = TypeVar("_T")


class _LoopThread:
    """One daemon thread running an event loop, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_run_forever, args=(loop,), name="tessera-connector-loop", daemon=True
                )
                thread.start()
                self._loop = loop
            return self._loop


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    off_compute_cores()
    loop.run_forever()


_LOOP = _LoopThread()


def submit_on_loop(coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """Start ``coro`` on the connector's loop thread; its future, for a caller that must not
    wait long (vLLM's scheduler thread)."""
    return asyncio.run_coroutine_threadsafe(coro, _LOOP.loop())


def run_on_loop(coro: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
    """Run ``coro`` on the connector's loop thread and wait for it (at most ``timeout_s``)."""
    future = submit_on_loop(coro)
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise
