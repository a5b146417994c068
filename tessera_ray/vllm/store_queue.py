"""The background tier stores of a worker's connector (torch only, no vLLM import).

A step's save hands its staged tier blocks over and returns: the store runs on one thread, off
the forward path, at most ``max_pending`` steps behind (a tier slower than the engine holds
the next hand-over until one ends). Each step's stores are reported done, landed or not, so
the scheduler stops waiting for their blocks; a store the tier refuses is a later miss, and
anything else it raises is a bug, raised on the engine's thread by the next hand-over.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tessera_ray.core.results import TokenKey
from tessera_ray.errors import TierUnavailableError
from tessera_ray.vllm.backend import TierBackend
from tessera_ray.vllm.cpus import off_compute_cores
from tessera_ray.vllm.stats import ConnectorCounters

__all__ = ["StoreQueue", "StoreBatch"]

log = logging.getLogger(__name__)

StoreBatch = dict[str, tuple[list[TokenKey], list[int]]]
"""Per namespace, the keys to store and the rows of the staged blocks holding them."""


class StoreQueue:
    """One worker's stores in flight (see the module docstring)."""

    def __init__(
        self, tier: TierBackend, counters: ConnectorCounters, *, max_pending: int = 4
    ) -> None:
        self.tier = tier
        self.counters = counters
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="tessera-connector-save", initializer=off_compute_cores
        )
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._done: list[int] = []
        self._error: Exception | None = None
        self._closed = False

    def raise_error(self) -> None:
        """Raise, on the caller's thread, what a background store raised that is a bug."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def done(self, seq: int) -> None:
        """Step ``seq``'s stores ended (or there were none to run)."""
        with self._lock:
            self._done.append(seq)

    def take_done(self) -> list[int]:
        """The ``save_seq`` of every step whose stores ended since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def submit(self, batch: StoreBatch, rows: torch.Tensor, seq: int) -> None:
        """Store ``batch`` (its rows of ``rows``, uint8 ``[blocks, block_bytes]``) in the
        background; step ``seq`` is reported done when it ends."""
        self._slots.acquire()
        self._writer.submit(self._store, batch, rows, seq)

    def _store(self, batch: StoreBatch, rows: torch.Tensor, seq: int) -> None:
        def store() -> int:
            stored = 0
            for namespace, (keys, idx) in batch.items():
                try:
                    self.tier.store(namespace, keys, rows[idx].numpy())
                    stored += len(keys)
                except TierUnavailableError as exc:  # a save that fails is a later miss
                    self.counters.add(tier_failures=1)
                    log.warning("tier store of %d blocks failed: %s", len(keys), exc)
            return stored

        try:
            self.counters.timed_store(store)
        except Exception as exc:  # a bug: raised by the next step's hook, off this thread
            with self._lock:
                self._error = exc
        finally:
            self._slots.release()
            self.done(seq)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every store handed over so far is done; ``False`` on timeout."""
        if self._closed:
            return True  # close() waited for them
        try:
            self._writer.submit(lambda: None).result(timeout_s)
        except TimeoutError:
            return False
        except RuntimeError:
            # The interpreter is exiting (an in-process engine shut down by atexit): the writer
            # thread ran what was queued before it ended.
            return True
        return True

    def close(self) -> None:
        """Finish the stores handed over; idempotent."""
        if not self._closed:
            self._closed = True
            self._writer.shutdown(wait=True)
