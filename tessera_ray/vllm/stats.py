"""What the connector costs the engine and what it moved, counted where it happens (no vLLM
import): the time its hooks take on the scheduler's and the workers' paths, the background
stores' time, and the blocks loaded, refused and saved.

vLLM asks each side for the counts since it last asked (``get_kv_connector_stats``), adds the
workers' to the scheduler's, and hands the sum to its stat loggers; ``reduce`` turns an
interval's sum into the per-step figures an operator reads (vLLM logs them as "KV Transfer
metrics"). The time on the forward path is the figure that says what the connector slows a
decode step by: it is measured inside the engine, so it holds on a machine whose run-to-run
speed varies far more than the connector costs.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

__all__ = ["ConnectorCounters", "counted", "reduce_counts", "sum_counts"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Counts:
    scheduler_steps: int = 0
    scheduler_s: float = 0.0
    """Time in the scheduler-side hooks (lookups answered, step plans built)."""
    worker_steps: int = 0
    forward_s: float = 0.0
    """Time in the worker-side hooks, all on the forward path (waits for loads, copies of
    loaded and saved rows)."""
    lookup_waits: int = 0
    """Scheduler answers of "ask again next step" while a tier lookup was on its way."""
    router_misses: int = 0
    """Lookups not made: the tier-aware router's own lookup had found none of the request's
    blocks (:mod:`~tessera_ray.vllm.router_word`)."""
    store_waits: int = 0
    """Scheduler answers of "ask again next step" while blocks this engine stores were on
    their way."""
    loaded_blocks: int = 0
    """Tier blocks read and verified for loading."""
    mapped_blocks: int = 0
    """Of those, the blocks read out of this node's pool's memory mapped in this process
    (the rest came over NIXL or in a Ray call's payload)."""
    in_place_blocks: int = 0
    """Of the mapped ones, the blocks copied into vLLM's cache straight from the pool's pinned
    pages (one copy; the others were copied out into staging memory first)."""
    failed_blocks: int = 0
    """Engine blocks whose load failed (vLLM recomputes them); for a hybrid model, requests."""
    load_s: float = 0.0
    """Wall time of hybrid loads (read, verify, copy into vLLM's caches), off the forward path:
    the request waits for them instead."""
    saved_blocks: int = 0
    store_s: float = 0.0
    """Wall time of the background stores (off the forward path)."""
    store_cpu_s: float = 0.0
    """CPU time of the background store thread. Not a bound on what it costs the engine: the
    contention it causes for cores and the interpreter lock is not in it."""
    tier_failures: int = 0
    """Tier calls that failed as the tier fails in normal operation (a pool or shard down or
    slow: :class:`~tessera_ray.errors.TierUnavailableError`); the blocks were recomputed."""
    hook_errors: int = 0
    """Other exceptions out of a connector hook (bugs): logged with their traceback and raised
    on to vLLM."""


COUNT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(_Counts))


class ConnectorCounters:
    """One connector's counts since vLLM last took them; updated from the engine's thread and
    the connector's own reader and writer threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = _Counts()

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._counts, name, getattr(self._counts, name) + amount)

    def add_time(self, seconds: str, elapsed_s: float, steps: str | None) -> None:
        with self._lock:
            counts = self._counts
            setattr(counts, seconds, getattr(counts, seconds) + elapsed_s)
            if steps is not None:
                setattr(counts, steps, getattr(counts, steps) + 1)

    def timed_store(self, store: Callable[[], int]) -> None:
        """Run one background store (returning the blocks it stored) and count it."""
        t0, c0 = time.perf_counter(), time.thread_time()
        blocks = store()
        # CPU clock read first: the wall interval then encloses the CPU one, so the counts
        # never show more CPU than wall time for one thread.
        cpu_s = time.thread_time() - c0
        self.add(saved_blocks=blocks, store_s=time.perf_counter() - t0, store_cpu_s=cpu_s)

    def take(self) -> dict[str, float] | None:
        """The counts since the last ``take`` (``None`` if nothing happened), reset to zero."""
        with self._lock:
            counts, self._counts = self._counts, _Counts()
        data = {k: getattr(counts, k) for k in COUNT_KEYS}
        return data if any(data.values()) else None


class _HasCounters(Protocol):
    counters: ConnectorCounters


F = TypeVar("F", bound=Callable[..., Any])


def counted(seconds: str, steps: str | None = None) -> Callable[[F], F]:
    """A connector hook whose wall time adds to ``seconds`` of ``self.counters`` (and each
    call one to ``steps``). Hooks are the connector's outermost frames (vLLM calls them): an
    exception leaving one is a bug (the tier's own failures are recomputed inside), so it is
    counted and logged here, once with its traceback, and raised on as vLLM expects."""
    if seconds not in COUNT_KEYS or (steps is not None and steps not in COUNT_KEYS):
        raise ValueError(f"unknown connector count {seconds!r} or {steps!r}")

    def wrap(hook: F) -> F:
        @functools.wraps(hook)
        def timed(self: _HasCounters, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return hook(self, *args, **kwargs)
            except Exception:
                self.counters.add(hook_errors=1)
                log.exception("tessera-ray connector hook %s failed", hook.__name__)
                raise
            finally:
                self.counters.add_time(seconds, time.perf_counter() - t0, steps)

        return timed  # type: ignore[return-value]

    return wrap


def sum_counts(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two intervals' (or two processes') counts added key by key."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in COUNT_KEYS if k in a or k in b}


def reduce_counts(data: Mapping[str, float]) -> dict[str, int | float]:
    """An interval's counts as the figures an operator reads: per-step hook time in
    microseconds, blocks moved, and the stores' time per block in milliseconds."""

    def per(total_s: float, n: float, scale: float) -> float:
        return round(total_s / n * scale, 1) if n else 0.0

    steps, saved = data.get("worker_steps", 0), data.get("saved_blocks", 0)
    return {
        "steps": int(steps),
        "forward_us_per_step": per(data.get("forward_s", 0.0), steps, 1e6),
        "scheduler_us_per_step": per(
            data.get("scheduler_s", 0.0), data.get("scheduler_steps", 0), 1e6
        ),
        "lookup_waits": int(data.get("lookup_waits", 0)),
        "store_waits": int(data.get("store_waits", 0)),
        "router_misses": int(data.get("router_misses", 0)),
        "loaded_blocks": int(data.get("loaded_blocks", 0)),
        "mapped_blocks": int(data.get("mapped_blocks", 0)),
        "failed_blocks": int(data.get("failed_blocks", 0)),
        "saved_blocks": int(saved),
        "store_ms_per_block": per(data.get("store_s", 0.0), saved, 1e3),
        "store_cpu_s": round(data.get("store_cpu_s", 0.0), 4),
        "tier_failures": int(data.get("tier_failures", 0)),
        "hook_errors": int(data.get("hook_errors", 0)),
    }
