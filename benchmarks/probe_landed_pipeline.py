"""Probe: can a verified fetch hide its hash pass by hashing landed pages on the second core
while NIXL lands the next ones? Not a benchmark row (it writes no JSON): the evidence behind
the ``verified_read_floor`` rows of ``bench_transport.py`` being a floor.

Two processes, as ``probe_fetch_hashing.py``: an owner with 256 MLA pages (73,728 B) sealed
and exported, a reader pool with the tier's NIXL transport. Every READ runs on one thread kept
for it (as the transport's I/O thread) in requests of ``TransportConfig.hash_chunk_bytes``
(512 KiB); each step after a 96 MiB scratch fill (cold caches); medians of interleaved rounds:

- ``read``: the same bytes in one request, nothing else (the ceiling);
- ``read_then_hash``: each request's pages hashed on the I/O thread as soon as it lands, then
  the next request (what the tier's fetch does: row ``verified_read_floor``);
- ``pipelined_python``: the I/O thread posts the requests back to back, and the waiting thread
  hashes each request's pages as soon as it is done (a queue between them);
- ``pipelined_native``: the same with the waiting thread in ``_landed_hash.c`` (built here with
  ``cc``), the GIL released, spinning on a counter the I/O thread raises after each request:
  nothing of Python between the hasher and the copy.

Each line also gives ``in_transfer``, the time the I/O thread spent inside NIXL's
``transfer()`` calls (the copy runs there, over UCX's cma). Both pipelined digests are checked
against the pool's own hash before anything is timed.

On this 2-core VM (four runs, 2026-12-03) neither pipeline beat hashing after each request:
read_then_hash ran at 0.65-0.72 of the READ alone, pipelined_python at 0.57-0.62 and
pipelined_native at 0.59-0.62. With the other core hashing, the copy itself slowed (in_transfer
2.7-3.6 ms against 2.5-2.9 ms) and so did the I/O thread's work between requests, on a machine
whose second core the progress threads also need. So a verified fetch here costs the READ plus
one hash pass over its bytes, before any owner round trip or bookkeeping.
Run: ``python benchmarks/probe_landed_pipeline.py``.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("UCX_MODULES", "^ib")  # before anything loads UCX (REFERENCE.md)

from probe_fetch_hashing import NAMESPACE, PAGES, owner_and_reader  # noqa: E402

ROUNDS = 25
SOURCE = Path(__file__).with_name("_landed_hash.c")


def _native(build_dir: str) -> tuple[Any, int] | str:
    """``(library, address of the xxhash extension's XXH3-128 function)``, or why not."""
    import xxhash

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler on PATH"
    lib_path = os.path.join(build_dir, "liblanded_hash.so")
    done = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", lib_path],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return f"{cc} failed: {done.stderr.strip()[:200]}"
    lib = ctypes.CDLL(lib_path)
    lib.landed_hash.restype = ctypes.c_int64
    ptr, u64 = ctypes.c_void_p, ctypes.c_uint64
    # fn, base, page_bytes, slots, n, seed, landed, out, timeout_s
    lib.landed_hash.argtypes = [ptr, ptr, u64, ptr, ctypes.c_int64, u64, ptr, ptr, ctypes.c_double]
    lib.landed_publish.argtypes = [ptr, ctypes.c_int64]
    try:
        ext = ctypes.CDLL(xxhash._xxhash.__file__)
        fn = ctypes.cast(ext.XXH3_128bits_withSeed_dispatch, ctypes.c_void_p).value
    except (AttributeError, OSError) as e:
        return f"the xxhash extension exports no XXH3-128 function here: {e}"
    assert fn is not None
    return lib, fn


def main() -> None:
    with owner_and_reader("pipeline-reader") as (pool, transport, info, export):
        _measure(pool, transport, info, export)


def _measure(pool: Any, transport: Any, info: Any, export: Any) -> None:
    import numpy as np
    import torch

    from tessera_ray.core import content_seed

    agent, local_dlist = transport._agent, transport._local
    remote_dlist, remote = transport._remote[info.name], list(export.slots)
    seed = content_seed(NAMESPACE, pool.fingerprint)
    step = max(1, transport.config.hash_chunk_bytes // pool.page_bytes)
    scratch = torch.empty(96 << 20, dtype=torch.uint8)
    handles = pool.allocate_many(PAGES)
    slots = [h.offset // h.length for h in handles]
    in_transfer = [0.0]

    def read(local: list[int], far: list[int]) -> None:
        xfer = agent.make_prepped_xfer("READ", local_dlist, local, remote_dlist, far)
        t = time.perf_counter()
        state = agent.transfer(xfer)
        in_transfer[0] += time.perf_counter() - t
        while state == "PROC":
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        assert state == "DONE", state

    chunks = [(a, min(a + step, PAGES)) for a in range(0, PAGES, step)]
    landed_q: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    counter = np.zeros(1, dtype=np.int64)

    def requests(after: Callable[[int, int], None]) -> None:
        for a, b in chunks:
            read(slots[a:b], remote[a:b])
            after(a, b)

    jobs = ThreadPoolExecutor(max_workers=1)  # kept for every READ, as the transport's thread
    with tempfile.TemporaryDirectory() as build:
        native = _native(build)

        def pipelined_python() -> list[int]:
            io = jobs.submit(requests, lambda a, b: landed_q.put((a, b)))
            digests: list[int] = []
            for _ in chunks:
                a, b = landed_q.get()
                digests += pool.hash_pages(slots[a:b], seed)
            io.result()
            return digests

        def pipelined_native() -> list[int]:
            assert not isinstance(native, str)
            lib, fn = native
            out = np.zeros(2 * PAGES, dtype=np.uint64)
            table = np.asarray(slots, dtype=np.int64)
            lib.landed_publish(counter.ctypes.data, 0)
            io = jobs.submit(requests, lambda a, b: lib.landed_publish(counter.ctypes.data, b))
            hashed = lib.landed_hash(
                fn,
                pool.data.data_ptr(),
                pool.page_bytes,
                table.ctypes.data,
                PAGES,
                seed,
                counter.ctypes.data,
                out.ctypes.data,
                30.0,
            )
            io.result()
            assert hashed == PAGES, hashed
            return [int(out[2 * i]) | int(out[2 * i + 1]) << 64 for i in range(PAGES)]

        ways: dict[str, Callable[[], object]] = {
            "read": lambda: jobs.submit(read, slots, remote).result(),
            "read_then_hash": lambda: jobs.submit(
                requests, lambda a, b: pool.hash_pages(slots[a:b], seed)
            ).result(),
            "pipelined_python": pipelined_python,
        }
        if not isinstance(native, str):
            ways["pipelined_native"] = pipelined_native
        jobs.submit(read, slots, remote).result()
        want = pool.hash_pages(slots, seed)
        for name in ("pipelined_python", "pipelined_native"):
            if name in ways:
                assert ways[name]() == want, f"{name} hashed other digests than the pool"
        samples: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(ROUNDS + 1):  # the first round warms up, untimed
            for way, run in ways.items():
                scratch.fill_(1)
                in_transfer[0] = 0.0
                t = time.perf_counter()
                run()
                samples[way].append((time.perf_counter() - t, in_transfer[0]))
        jobs.shutdown()
    pool.release_many(handles)
    total = {w: statistics.median(s for s, _ in v[1:]) for w, v in samples.items()}
    copy = {w: statistics.median(c for _, c in v[1:]) for w, v in samples.items()}
    print(f"{PAGES} MLA pages in requests of {step} pages, medians of {ROUNDS} rounds:")
    for way, seconds in total.items():
        print(
            f"  {way:18s} {seconds * 1e3:6.2f} ms  {total['read'] / seconds:5.2f} of read  "
            f"in_transfer {copy[way] * 1e3:5.2f} ms"
        )
    if isinstance(native, str):
        print(f"  pipelined_native   not available: {native}")


if __name__ == "__main__":
    main()
