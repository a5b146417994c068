"""Probe: how large should the requests be of a NIXL read that hashes the pages it lands?

Not a benchmark row (it writes no JSON): the evidence behind ``TransportConfig.hash_chunk_bytes``.
Two processes: an owner pool of 256 MLA pages (73,728 B) sealed, pinned and exported once, and
a reader pool with the tier's NIXL transport. The reader times ``fetch_verified`` of all 256
pages with its read posted in requests of 0 (one request, every page hashed after it), 256 KiB,
512 KiB, 1 MiB and 2 MiB, each request's pages hashed on the I/O thread as soon as it lands;
and a raw READ of the same bytes with bare NIXL calls (the ceiling). One transport serves every
size (set between fetches through its config): an agent per size would add a progress thread
each, and five on 2 cores drowned the differences in noise. Interleaved rounds, each step after
a 96 MiB scratch fill (cold caches, as ``bench_transport.py``); medians.

A page hashed right after a request of at most the core's L2 (1 MiB here) is still in cache;
after one 18 MB request it has left it. In 6 runs on this 2-core VM: 512 KiB 0.43-0.51 of raw,
one request 0.41-0.48, 256 KiB 0.37-0.48 (more requests), 1 MiB 0.41-0.51, 2 MiB 0.42-0.50.
Run: ``python benchmarks/probe_fetch_hashing.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_transport's page spec and payload
os.environ.setdefault("UCX_MODULES", "^ib")  # before anything loads UCX (REFERENCE.md)

PAGES = 256
ROUNDS = 25
NAMESPACE = "probe"
WAYS = {
    "one_request": 0,
    "256_kib": 256 << 10,
    "512_kib": 512 << 10,
    "1_mib": 1 << 20,
    "2_mib": 2 << 20,
}


def _node(name: str) -> tuple[Any, Any]:
    """A pool of ``PAGES`` MLA pages with its tier transport (registered)."""
    from bench_transport import MLA_PAGE_BYTES, page_spec

    from tessera_ray.core import BlockPool, PoolConfig
    from tessera_ray.transport import TransportConfig, make_transport

    page, fingerprint = page_spec(MLA_PAGE_BYTES)
    pool = BlockPool(page, PoolConfig(num_pages=PAGES), fingerprint=fingerprint)
    config = TransportConfig(kind="nixl", timeout_s=30, fetch_chunk_bytes=0)
    transport = make_transport(config, name=name)
    transport.register(pool)
    return pool, transport


def _set_way(transport: Any, hash_chunk_bytes: int) -> None:
    """Read with requests of ``hash_chunk_bytes`` from the next fetch on."""
    import dataclasses

    transport.config = dataclasses.replace(transport.config, hash_chunk_bytes=hash_chunk_bytes)


def _owner(conn: Connection) -> None:
    from bench_transport import payload

    from tessera_ray.transport import export_pages

    pool, transport = _node("probe-owner")
    handles = pool.write_many(pool.allocate_many(PAGES), payload(PAGES, pool.page_bytes))
    pinned = [r.handle for r in pool.seal_many(handles, NAMESPACE)]  # the writer's refs pin
    export = export_pages(pool, pinned, namespace=NAMESPACE, peer=transport.name)
    conn.send((transport.peer_info(), export))
    conn.recv()  # hold the pages until the reader is done


@contextmanager
def owner_and_reader(name: str) -> Iterator[tuple[Any, Any, Any, Any]]:
    """An owner process holding the exported pages and a reader node ``name`` that knows it as
    a peer: ``(reader pool, reader transport, owner PeerInfo, export)``; the owner lets go of
    its pages and exits when the block ends."""
    end, child = mp.Pipe()
    owner = mp.Process(target=_owner, args=(child,))
    owner.start()
    try:
        info, export = end.recv()
        pool, transport = _node(name)
        transport.add_peers([info])
        yield pool, transport, info, export
    finally:
        with suppress(BrokenPipeError):  # an owner that died already needs no release
            end.send(True)
        owner.join()


def main() -> None:
    with owner_and_reader("probe-reader") as (pool, transport, info, export):
        _measure(pool, transport, info, export)


def _measure(pool: Any, transport: Any, info: Any, export: Any) -> None:
    import torch

    from tessera_ray.transport import fetch_verified

    agent = transport._agent  # the raw READ drives the reader's agent with bare calls
    local_dlist, remote_dlist = transport._local, transport._remote[info.name]
    remote = list(export.slots)
    scratch = torch.empty(96 << 20, dtype=torch.uint8)

    def raw() -> None:
        handles = pool.allocate_many(PAGES)
        slots = [h.offset // h.length for h in handles]
        scratch.fill_(1)
        start = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", local_dlist, slots, remote_dlist, remote)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        samples["raw"].append(time.perf_counter() - start)
        assert state == "DONE", state
        pool.release_many(handles)

    def fetch(way: str) -> None:
        _set_way(transport, WAYS[way])
        scratch.fill_(1)
        start = time.perf_counter()
        res = fetch_verified(transport, export, timeout_s=30)
        samples[way].append(time.perf_counter() - start)
        assert res.ok and len(res.fetched) == PAGES
        pool.release_many([f.handle for f in res.fetched])
        pool.evict(PAGES, copy_data=False)

    samples: dict[str, list[float]] = {"raw": [], **{way: [] for way in WAYS}}
    for _ in range(ROUNDS + 2):
        raw()
        for way in WAYS:
            fetch(way)
    medians = {k: statistics.median(v[2:]) for k, v in samples.items()}  # 2 warm-up rounds
    print(f"{PAGES} MLA pages, medians of {ROUNDS} interleaved rounds:")
    for key, seconds in medians.items():
        print(f"  {key:16s} {seconds * 1e3:6.2f} ms  {medians['raw'] / seconds:5.2f} of raw")


if __name__ == "__main__":
    main()
