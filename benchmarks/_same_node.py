"""The same-node rows of ``bench_transport.py``: two pool processes on one Ray node, the owner's
pool in a shared-memory slab (``PoolConfig.shared_memory_dir``), the reader's transports told
they share its node.

In the reader actor, interleaved and each after the reader wrote a scratch buffer larger than
the last-level cache (so no step finds the bytes where the step before left them):

- ``verified_fetch_same_node``: the verified fetch through the mapped slab (copy each request's
  pages into reserved slots, hash them there, compare with the export, seal);
- ``memcpy_from_mapped_slab``: the same pages copied from the same mapping into the same slots
  and nothing else (runs of consecutive pages as one ``memmove``): the ceiling. Target >= 0.8;
- ``verified_fetch_nixl_same_node``: the verified fetch of the same export over NIXL between
  the same two processes (a second transport of the reader on the same pool, told never to
  map), what the tier did on one node before the mapped path;
- ``hash_after_copy_same_node``: hashing the landed pages alone (to split the fetch's cost);
- ``copy_and_hash_floor_same_node``: what any verified read out of the slab pays here, with
  nothing of the fetch around it: the same pages copied in the mapped read's chunks, each
  chunk's pages hashed with xxh3-128 right after they land. The verified fetch cannot beat it.

The owner pins the pages once for the whole run (a pin is the same Ray or channel round trip
whatever carries the bytes, and ``fetch_owner_call`` rows measure it).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Any

GB = 1e9


class SameNodeNode:
    """One pool in shared memory, with a transport that maps same-node peers and (reader
    side) another that never does."""

    def __init__(self, name: str, page_bytes: int, num_pages: int, shm_dir: str) -> None:
        import ray
        from bench_transport import page_spec

        from tessera_ray.actors._heap import freeze_startup_heap
        from tessera_ray.core import BlockPool, PoolConfig
        from tessera_ray.transport import TransportConfig, make_transport

        page, fingerprint = page_spec(page_bytes)
        config = PoolConfig(num_pages=num_pages, shared_memory_dir=shm_dir)
        self.pool = BlockPool(page, config, fingerprint=fingerprint)
        node = ray.get_runtime_context().get_node_id()
        self.mapped = make_transport(
            TransportConfig(kind="nixl", timeout_s=30), name=name, node=node
        )
        self.info = self.mapped.register(self.pool)
        self.nixl = make_transport(
            TransportConfig(kind="nixl", timeout_s=30, same_node="backend"),
            name=f"{name}-backend",
            node=node,
        )
        self.nixl.register(self.pool)
        self.slab: Any = None
        freeze_startup_heap()

    def peer(self) -> Any:
        return self.info

    def connect(self, info: Any) -> None:
        from tessera_ray.core.shm import SlabMapping

        self.mapped.add_peers([info])
        self.nixl.add_peers([info])
        assert self.mapped.carrier(info.name) == "mapped"
        assert self.nixl.carrier(info.name) == "nixl"
        self.slab = SlabMapping(info.mappings[0])

    def fill(self, n: int) -> Any:
        """Owner: ``n`` random sealed pages, pinned for the run; their export."""
        from bench_transport import payload

        from tessera_ray.transport import export_pages

        handles = self.pool.write_many(self.pool.allocate_many(n), payload(n, self.pool.page_bytes))
        sealed = [r.handle for r in self.pool.seal_many(handles, "bench")]
        return export_pages(self.pool, sealed, namespace="bench", peer=self.mapped.name)

    def measure(self, export: Any, reps: int) -> dict[str, float]:
        """Reader: the module docstring's rows, GB/s (and ms of hashing)."""
        import torch

        from tessera_ray.core import content_seed
        from tessera_ray.transport import fetch_verified
        from tessera_ray.transport._mapped_reads import MIN_COPY_BYTES
        from tessera_ray.transport._rows import gather_rows

        pool, n = self.pool, len(export.slots)
        remote = list(export.slots)
        scratch = torch.empty(96 << 20, dtype=torch.uint8)
        seed = content_seed("bench", pool.fingerprint)
        times: dict[str, list[float]] = {
            "mapped": [],
            "nixl": [],
            "memcpy": [],
            "floor": [],
            "hash": [],
        }
        step = max(self.mapped.config.hash_chunk_bytes, MIN_COPY_BYTES) // pool.page_bytes

        def fetched(res: Any) -> list[int]:
            assert res.ok and len(res.fetched) == n, res.failed[:1]
            local = [int(pool.slot(f.handle)) for f in res.fetched]
            pool.release_many([f.handle for f in res.fetched])
            pool.evict(n, copy_data=False)
            return local

        for rep in range(reps + 1):  # the first round warms every path up, untimed
            scratch.fill_(1)
            reserved = pool.allocate_many(n)
            t = time.perf_counter()
            res = fetch_verified(self.mapped, export, local=reserved, timeout_s=30)
            mapped = time.perf_counter() - t
            local = fetched(res)

            scratch.fill_(1)
            reserved = pool.allocate_many(n)
            t = time.perf_counter()
            res = fetch_verified(self.nixl, export, local=reserved, timeout_s=30)
            nixl = time.perf_counter() - t
            fetched(res)

            scratch.fill_(1)
            t = time.perf_counter()
            gather_rows(pool.data, local, self.slab.address, remote)
            copy = time.perf_counter() - t
            t = time.perf_counter()
            pool.hash_pages(local, seed)
            hashing = time.perf_counter() - t

            scratch.fill_(1)
            t = time.perf_counter()
            for a in range(0, n, step):
                gather_rows(pool.data, local[a : a + step], self.slab.address, remote[a : a + step])
                pool.hash_pages(local[a : a + step], seed)
            floor = time.perf_counter() - t
            if rep:
                for key, value in zip(times, (mapped, nixl, copy, floor, hashing), strict=True):
                    times[key].append(value)
        nbytes = n * pool.page_bytes
        out = {k: nbytes / statistics.median(v) / GB for k, v in times.items() if k != "hash"}
        out["hash_ms"] = statistics.median(times["hash"]) * 1e3
        return out

    def close(self) -> None:
        if self.slab is not None:
            self.slab.close()
        self.nixl.close()
        self.mapped.close()


def run_same_node(page_bytes: int, n: int, reps: int) -> dict[str, float]:
    """Start an owner and a reader actor on this (single) node, measure, stop both."""
    import ray

    shm_dir = tempfile.mkdtemp(prefix="tessera-bench-", dir="/dev/shm")
    node: Any = ray.remote(SameNodeNode).options(num_cpus=0)
    owner = node.remote(f"same-owner-{page_bytes}", page_bytes, n, shm_dir)
    reader = node.remote(f"same-reader-{page_bytes}", page_bytes, n, shm_dir)
    try:
        ray.get(reader.connect.remote(ray.get(owner.peer.remote())))
        export = ray.get(owner.fill.remote(n))
        out: dict[str, float] = ray.get(reader.measure.remote(export, reps))
        ray.get([a.close.remote() for a in (reader, owner)])
    finally:
        for actor in (owner, reader):
            ray.kill(actor)
        # Killed owners never unlink their slabs, and no later pool starts here to sweep them.
        shutil.rmtree(shm_dir, ignore_errors=True)
    return out


def same_node_rows(r: dict[str, float], label: str, note: str, nbytes: int) -> list[Any]:
    """The rows of one case from :func:`run_same_node`'s figures."""
    from common import Row

    fetch_ms = nbytes / r["mapped"] / 1e6
    copy_ms = nbytes / r["memcpy"] / 1e6
    floor_ms = nbytes / r["floor"] / 1e6
    why = (
        f"the fetch copies each chunk of pages and then hashes it: the copy and the hash alone "
        f"take {floor_ms:.2f} ms (row copy_and_hash_floor_same_node_{label}, "
        f"{r['floor'] / r['memcpy']:.2f} of memcpy) against {copy_ms:.2f} ms for the bare copy "
        f"and {fetch_ms:.2f} ms for the whole verified fetch (reservation, digest compare and "
        "seal of every page on top); xxh3-128 holds the GIL between pages, so hashing on a "
        "second thread while the next chunk is copied hands the GIL back and forth per page "
        "and was slower here (docs/same-node.md)"
    )
    base = f"memcpy_from_mapped_slab_{label}"
    return [
        Row(name=base, value=r["memcpy"], unit="GB/s", note=f"{note}; owner's slab, mapped"),
        Row(
            name=f"verified_fetch_same_node_{label}",
            value=r["mapped"],
            unit="GB/s",
            baseline=base,
            baseline_value=r["memcpy"],
            target_ratio=0.8,
            note=f"{note}; two pool processes of one node: copy out of the mapped slab, hash, "
            "verify, seal",
            miss_reason=why,
        ),
        Row(
            name=f"verified_fetch_nixl_same_node_{label}",
            value=r["nixl"],
            unit="GB/s",
            baseline=base,
            baseline_value=r["memcpy"],
            note=f"{note}; the same fetch over NIXL between the same two processes",
        ),
        Row(
            name=f"copy_and_hash_floor_same_node_{label}",
            value=r["floor"],
            unit="GB/s",
            baseline=base,
            baseline_value=r["memcpy"],
            note=f"{note}; the mapped read's chunked copy and xxh3-128 of each chunk, nothing else",
        ),
        Row(
            name=f"hash_after_copy_same_node_{label}",
            value=r["hash_ms"],
            unit="ms",
            note=f"{note}; xxh3-128 of the landed pages alone",
        ),
    ]
