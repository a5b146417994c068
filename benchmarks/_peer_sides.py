"""The two ends of each peer system, run as Ray actors by ``bench_peers.py``.

Every system moves the same rows (``bench_transport.payload``) from an owner process to a
reader process; each method times one batch and returns seconds. The owner writes (SET, put),
the reader reads (GET, get, batch get), so every byte crosses a process boundary:

- Redis: both ends are clients of one redis-server; a batch is one MSET and one MGET (one round
  trip each: measured here, MGET beats a pipeline of GETs and single GETs), redis-py with its
  hiredis parser (twice the pure-Python parser's speed here). GET ends with a ``bytes`` per key
  in the reader; nothing more is copied (generous to Redis: tessera lands in pool slots).
- Mooncake Store: the owner mounts the only memory segment (so the reader cannot be served by a
  local memcpy); the reader mounts none and registers its destination buffer once.
  ``batch_get_into`` lands every key in that buffer in one call; ``get`` returns ``bytes`` per
  key; the owner's ``put_batch`` writes a batch.
- Ray object store: the owner ``ray.put``s each row; the reader ``ray.get``s the references and
  copies the rows into its buffer (on one node ``ray.get`` maps shared memory, so without the
  copy nothing would have moved).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["RedisSide", "MooncakeSide", "RaySide"]


class _Side:
    """Rows to write (owner) or a buffer to read into (reader), one object size at a time."""

    rows: np.ndarray
    dst: np.ndarray

    def prepare(self, rows: np.ndarray) -> int:
        self.rows = rows  # read-only when it came through the object store: only read from
        self.dst = np.zeros_like(rows)
        return int(rows.shape[0])

    def _keys(self, tag: int) -> list[str]:
        n, size = self.rows.shape
        return [f"bench-{size}-{tag}-{i}" for i in range(n)]


class RedisSide(_Side):
    def __init__(self, address: str) -> None:
        import redis

        host, port = address.rsplit(":", 1)
        self.client = redis.Redis(host=host, port=int(port))
        self.client.ping()

    def prepare(self, rows: np.ndarray) -> int:
        self.client.flushall()  # only this size's keys stay in the server's memory
        return super().prepare(rows)

    def put(self, tag: int) -> float:
        start = time.perf_counter()
        values = {k: memoryview(r) for k, r in zip(self._keys(tag), self.rows, strict=True)}
        assert self.client.mset(values)
        return time.perf_counter() - start

    def get(self, tag: int) -> float:
        start = time.perf_counter()
        values = self.client.mget(self._keys(tag))
        elapsed = time.perf_counter() - start
        assert all(v is not None and len(v) == self.rows.shape[1] for v in values)
        return elapsed


class MooncakeSide(_Side):
    def __init__(self, master: str, *, segment_bytes: int, buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.registered: int | None = None

    def prepare(self, rows: np.ndarray) -> int:
        n = super().prepare(rows)
        if self.registered is not None:
            self.store.unregister_buffer(self.registered)
        # Registered once per size, as a pool's memory is registered once, never per transfer.
        self.registered = int(self.dst.ctypes.data)
        rc = self.store.register_buffer(self.registered, self.dst.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")
        return n

    def put(self, tag: int) -> float:
        keys = self._keys(tag)
        start = time.perf_counter()
        rc = self.store.put_batch(keys, [memoryview(r) for r in self.rows])
        elapsed = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"put_batch returned {rc}")
        return elapsed

    def drop(self, tag: int) -> None:
        """Remove a batch the reader is done with, so the segment never fills up."""
        self.store.batch_remove(self._keys(tag), True)

    def get(self, tag: int) -> float:
        keys = self._keys(tag)
        start = time.perf_counter()
        values = [self.store.get(k) for k in keys]
        elapsed = time.perf_counter() - start
        assert all(len(v) == self.rows.shape[1] for v in values), "mooncake get came back short"
        return elapsed

    def batch_get_into(self, tag: int) -> float:
        n, size = self.dst.shape
        assert self.registered is not None, "prepare() registers the buffer first"
        ptrs = [self.registered + i * size for i in range(n)]
        start = time.perf_counter()
        got = self.store.batch_get_into(self._keys(tag), ptrs, [size] * n)
        elapsed = time.perf_counter() - start
        assert list(got) == [size] * n, f"batch_get_into returned {list(got)[:4]}..."
        return elapsed

    def matches(self) -> bool:
        """The reader's buffer holds the owner's rows (checked once, untimed)."""
        return bool(np.array_equal(self.dst, self.rows))

    def close(self) -> None:
        # Unmount before the actor dies, or the master would keep placing puts on a dead segment.
        self.store.close()


class RaySide(_Side):
    def __init__(self) -> None:
        self.refs: list[Any] = []

    def put(self, tag: int) -> tuple[float, list[Any]]:
        import ray

        start = time.perf_counter()
        self.refs = [ray.put(r) for r in self.rows]
        return time.perf_counter() - start, self.refs

    def get(self, refs: list[Any]) -> float:
        import ray

        start = time.perf_counter()
        for i, row in enumerate(ray.get(refs)):
            self.dst[i] = row
        return time.perf_counter() - start
