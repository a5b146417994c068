"""Probe: can a reader hash pages while a NIXL READ lands them? Threads against processes.

Not a benchmark row (it writes no JSON): the evidence behind the ``fetch_full_path`` miss
reason in ``bench_transport.py``. Two processes, an owner holding 256 MLA pages (73,728 B)
registered with NIXL and a reader with as many slots, both agents made as the tier makes them
(progress thread paused 200 us between polls). The reader times, as medians of 15 rounds:

- ``read``: one READ of every page (one prepared request, busy completion check), and
  ``transfer_call``, the part of it spent inside ``transfer()`` (the binding copies there);
- ``hash``: xxh3-128 of as many other bytes, page by page, in the reader;
- ``read_and_hash_threads``: both at once, the READ on a second thread of the reader, a
  fresh one per round; ``read_and_hash_kept_thread``: the same on one thread kept for every
  READ, as the transport's I/O thread is (a fresh thread adds its own start-up cost);
- ``read_while_other_process_hashes``: the READ while a third process hashes its own pages,
  and that process's hashing time meanwhile;
- ``read_then_hash_landed``: the READ, then a hash of every page that landed, on one thread
  (what a verified fetch does, without the owner round trip or any bookkeeping), printed
  with its share of the READ alone: the most a fetch that verifies after reading can reach.

On this 2-core VM two threads take about the sum of both apart (a kept thread a little less:
3.65-4.10 ms against 3.0-3.2 ms of READ and 0.8-0.9 ms of hash in two runs), while the
separate process overlaps the READ almost fully (3.25-3.29 ms). The overlap is the READ's
only: in three later runs the other process's hash took 2.1-2.9 ms beside the READ against
1.0-1.2 ms alone, the two cores and the memory bus being shared, and READ then hash on one
thread ran at 0.69-0.71 of the READ alone (2.6-2.9 ms of READ). A verifier process fed the
landed chunks over a pipe (tried, not kept) did no better than hashing after the READ.
Run: ``python benchmarks/probe_nixl_overlap.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UCX_MODULES", "^ib")  # before anything loads UCX (REFERENCE.md)

PAGES = 256
PAGE_BYTES = 73_728
ROUNDS = 15
PROGRESS_DELAY_US = 200  # TransportConfig.nixl_progress_delay_us


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    from tessera_ray.transport.nixl import _new_agent

    return _new_agent(nixl_agent, name, nixl_agent_config(backends=["UCX"]), PROGRESS_DELAY_US)


def _random_pages() -> Any:
    import torch

    return torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8)


def _owner(conn: Connection) -> None:
    agent = _agent("probe-owner")
    pages = _random_pages()
    agent.register_memory(pages)
    conn.send((agent.get_agent_metadata(), pages.data_ptr()))
    conn.recv()  # hold the memory until the reader is done


def _hasher(conn: Connection) -> None:
    import xxhash

    rows = [memoryview(r.numpy()) for r in _random_pages()]
    while conn.recv():
        start = time.perf_counter()
        for row in rows:
            xxhash.xxh3_128_intdigest(row)
        conn.send(time.perf_counter() - start)


def main() -> None:
    import xxhash

    owner_end, owner_conn = mp.Pipe()
    hasher_end, hasher_conn = mp.Pipe()
    procs = [
        mp.Process(target=_owner, args=(owner_conn,)),
        mp.Process(target=_hasher, args=(hasher_conn,)),
    ]
    for p in procs:
        p.start()
    meta, remote_addr = owner_end.recv()
    agent = _agent("probe-reader")
    slots = _random_pages()
    agent.register_memory(slots)
    peer = agent.add_remote_agent(meta)
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        [(slots.data_ptr() + i * PAGE_BYTES, PAGE_BYTES, 0) for i in range(PAGES)],
        "DRAM",
    )
    remote = agent.prep_xfer_dlist(
        peer, [(remote_addr + i * PAGE_BYTES, PAGE_BYTES, 0) for i in range(PAGES)], "DRAM"
    )
    index = list(range(PAGES))
    rows = [memoryview(r.numpy()) for r in _random_pages()]

    def read() -> float:
        handle = agent.make_prepped_xfer("READ", local, index, remote, index)
        start = time.perf_counter()
        state = agent.transfer(handle)
        in_call = time.perf_counter() - start
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        agent.release_xfer_handle(handle)
        return in_call

    def hash_all() -> None:
        for row in rows:
            xxhash.xxh3_128_intdigest(row)

    landed = memoryview(slots.numpy()).cast("B")

    def read_then_hash_landed() -> None:
        read()
        for i in range(PAGES):
            xxhash.xxh3_128_intdigest(landed[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])

    def timed(fn: Any) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    io = ThreadPoolExecutor(max_workers=1)  # a thread kept for every READ, as the transport's
    for _ in range(3):  # warm every path
        read()
        hash_all()
        hasher_end.send(True)
        hasher_end.recv()
    samples: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        samples.setdefault(key, []).append(seconds)

    for _ in range(ROUNDS):
        start = time.perf_counter()
        add("transfer_call", read())
        add("read", time.perf_counter() - start)
        add("hash", timed(hash_all))

        def both() -> None:
            helper = threading.Thread(target=read)
            helper.start()
            hash_all()
            helper.join()

        def both_on_a_kept_thread() -> None:
            reading = io.submit(read)
            hash_all()
            reading.result()

        add("read_and_hash_threads", timed(both))
        add("read_and_hash_kept_thread", timed(both_on_a_kept_thread))
        hasher_end.send(True)
        add("hash_in_other_process_alone", hasher_end.recv())
        hasher_end.send(True)
        add("read_while_other_process_hashes", timed(read))
        add("other_process_hash_meanwhile", hasher_end.recv())
        add("read_then_hash_landed", timed(read_then_hash_landed))
    hasher_end.send(False)
    owner_end.send(True)
    for p in procs:
        p.join()
    print(f"{PAGES} pages of {PAGE_BYTES} B, medians of {ROUNDS} rounds:")
    for key, values in samples.items():
        print(f"  {key:34s} {statistics.median(values) * 1e3:6.2f} ms")
    share = statistics.median(samples["read"]) / statistics.median(samples["read_then_hash_landed"])
    print(f"  read_then_hash_landed runs at {share:.2f} of the READ alone")


if __name__ == "__main__":
    main()
