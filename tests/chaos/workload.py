"""The agent workload the faults hit: each turn fetches what the tier has of its prompt, reads
those pages back, checks every one against the tiny model's recomputation of the same tokens,
and stores the blocks the tier did not have. A call that meets a dead or restarting actor is
retried after the actor answers again; a block the tier cannot serve is recomputed, never
guessed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import ray

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.tenancy import Credential
from tessera_ray.demo.engine import Engine
from tessera_ray.demo.workload import Request
from tessera_ray.errors import PoolExhaustedError
from tests.chaos.ledger import Ledger

__all__ = ["Agents", "process_of", "wait_alive"]

T = TypeVar("T")
_TRANSIENT = (ray.exceptions.RayError, PoolExhaustedError, TimeoutError, ConnectionError)


def process_of(client: TesseraClient, pool: str) -> int:
    """The process id of ``pool``'s actor now: a restart runs it in a new process."""
    return int(ray.get(client.pool(pool).__ray_call__.remote(_pid), timeout=60))


def _pid(actor: object) -> int:
    return os.getpid()


def wait_alive(
    client: TesseraClient, pool: str, timeout_s: float = 60.0, *, killed: int | None = None
) -> bool:
    """Block until ``pool`` answers (a restarted actor answers once its process is back).
    ``killed``: the process id it had when it was killed; only another process counts, since
    ``ray.kill`` returns before the old process is gone, and that one may still answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(client.pool(pool).ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
            if killed is None or process_of(client, pool) != killed:
                return True
        except ray.exceptions.RayError:
            pass  # the restart is under way
        time.sleep(0.2)
    return False


class Agents:
    def __init__(
        self,
        client: TesseraClient,
        engine: Engine,
        requests: list[Request],
        cred: Credential,
        ledger: Ledger,
    ) -> None:
        self.client = client
        self.engine = engine
        self.requests = requests
        self.cred = cred
        self.ledger = ledger
        self.turns = 0
        self.errors: list[str] = []
        self._next = 0

    def _retry(self, pool: str, call: Callable[[], T], attempts: int = 4) -> T | None:
        for _ in range(attempts):
            try:
                return call()
            except _TRANSIENT as exc:
                with self.ledger.lock:
                    self.ledger.retries += 1
                if isinstance(exc, ray.exceptions.RayError):
                    wait_alive(self.client, pool, 30.0)
        return None

    def turn(self, req: Request | None = None) -> None:
        if req is None:
            req = self.requests[self._next % len(self.requests)]
            self._next += 1
        ns = self.cred.namespace
        pool = self.client.pools[req.agent % len(self.client.pools)]  # every pool serves
        keys = self.engine.keys(ns, req.tokens)
        truth = self.engine.payloads(self.engine.prefill(req.tokens), range(len(keys)))
        got = self._retry(pool, lambda: self.client.fetch(self.cred, keys, into=pool))
        have = [k for k in keys if got is not None and k in got.available]
        rows = (
            self._retry(pool, lambda: self.client.read(self.cred, have, pool=pool)) if have else []
        )
        served = set()
        for key, row in zip(have, rows or [], strict=False):
            if self.ledger.check(ns, key, row, truth[keys.index(key)]):
                served.add(key)
        missing = [i for i, k in enumerate(keys) if k not in served]
        if missing:
            stored = self._retry(
                pool,
                lambda: self.client.store(
                    self.cred, [keys[i] for i in missing], truth[missing], pool=pool
                ),
            )
            for s in stored or []:
                if s.registered:
                    self.ledger.acknowledge(ns, s.token_key, truth[keys.index(s.token_key)])
        self.turns += 1

    def run_until(self, stop: threading.Event) -> None:
        """Turns back to back until ``stop`` is set (in a background thread)."""
        while not stop.is_set():
            try:
                self.turn()
            except Exception as exc:  # recorded; the test asserts there were none
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    def background(self) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        thread = threading.Thread(target=self.run_until, args=(stop,), daemon=True)
        thread.start()
        return thread, stop


def flip_bytes(path: object, offsets: list[int]) -> None:
    """Corrupt a file in place: invert the byte at each offset."""
    with open(str(path), "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
