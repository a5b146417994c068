"""One step's loads landing in vLLM's cache ahead of the forward pass (no vLLM import).

The worker's read thread reads and verifies the step's tier blocks, hands the outcome to the
forward thread, then lands the verified runs one layer at a time, in layer order, while the
forward computes the layers before. A layer's attention waits only for its own layer (an event);
on a device, the forward's stream also waits for the copies the read thread queued on its own.
Why not land on the forward thread when each layer asks: every layer after the first then paid
its whole copy on the forward's path; here only the first layer's copy can be, and a read that
finishes early hides that one too.

A landing that misses its deadline, or a step that ends before its copies do, is stopped: the
copy in progress finishes, no other starts, and the caller reports the step's loads as failed
(vLLM recomputes them), so nothing lands in the cache after vLLM was told it would not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tessera_ray.vllm.loads import LoadOutcome

__all__ = ["StepLanding"]

LandLayer = Callable[[int, LoadOutcome], None]
"""Land layer ``index``'s share of the outcome's runs in its cache."""


class StepLanding:
    """One step's read, then its landing layer by layer (see the module docstring)."""

    def __init__(self, num_layers: int) -> None:
        self._outcome: Future[LoadOutcome] = Future()
        self._landed = [threading.Event() for _ in range(num_layers)]
        self._device_events: list[Any] = [None] * num_layers
        self._lock = threading.Lock()  # held while a layer lands, so stop() waits for it
        self._stopping = False  # read by the read thread before each layer: no copy starts
        self.failed = False
        """A layer did not land in time (or the landing raised): the step's loads failed."""

    def run(
        self,
        read: Callable[[], LoadOutcome],
        land: LandLayer,
        order: Sequence[int],
        device: torch.device,
    ) -> None:
        """On the read thread: read and verify, publish the outcome, land layer by layer."""
        try:
            outcome = read()
        except BaseException as exc:  # the forward thread raises it where it waits
            self._outcome.set_exception(exc)
            return
        self._outcome.set_result(outcome)
        try:
            for index in order:
                with self._lock:
                    if self._stopping:
                        return
                    if outcome.runs:
                        land(index, outcome)
                        if device.type == "cuda":  # the copies were only queued
                            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                            event.record()
                            self._device_events[index] = event
                self._landed[index].set()
        except BaseException:
            self.failed = True
            raise
        finally:
            for done in self._landed:  # a waiter of a layer never landed stops waiting
                done.set()

    def outcome(self, timeout_s: float) -> LoadOutcome:
        """The verified outcome (raises ``TimeoutError`` when the read is late)."""
        return self._outcome.result(timeout_s)

    def wait_layer(self, index: int, timeout_s: float) -> bool:
        """Whether layer ``index`` landed in time; if not, the landing is stopped and the
        step's loads count as failed."""
        if not self._landed[index].wait(timeout_s):
            self.stop()
        ok = not self._stopping and not self.failed and self._landed[index].is_set()
        event = self._device_events[index]
        if ok and event is not None:
            torch.cuda.current_stream().wait_event(event)
        if not ok:
            self.failed = True
        return ok

    def stop(self) -> None:
        """No copy starts after this returns (one in progress finishes first)."""
        self._stopping = True  # before the lock: the read thread may not take it again first
        with self._lock:  # a copy in progress ends before this returns
            pass

    def finish(self, timeout_s: float) -> bool:
        """Wait for every layer to land (then nothing of this step is written any more);
        ``False``, with the landing stopped, when it did not in time or failed."""
        if self._stopping:  # stopped already (a late read or layer): wait for no deadline again
            self.stop()
            return False
        landed = all(done.wait(timeout_s) for done in self._landed)
        self.stop()
        return landed and not self.failed
