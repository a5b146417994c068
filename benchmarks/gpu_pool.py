"""Pools in GPU memory: hashing, sealing and verifying pages on the device, and verified fetches,
against raw device copies; NIXL reads between two pools' device memory (VRAM to VRAM) on one GPU.

    python benchmarks/gpu_pool.py [--quick] [--out FILE]   # run by benchmarks/gpu_check.py

Rows (GB/s of page bytes, against a raw ``index_select`` + ``index_copy_`` of the same pages
between two device tensors, on 8-byte words as the pool's own copies, measured in the same run):

- ``hash_gpu_pages``: the content hashes of pages already in a device pool (``hash_pages``: the
  device hash, ``core/_xxh3.py``; the note says which form ran, the Triton kernel or torch);
- ``seal_gpu_pages``: write and seal fresh pages of a device pool (hashed on the device, then
  the dedup index);
- ``verify_gpu_pages``: verify-on-arrival alone: seal pages that have landed in a device pool
  against the hashes their owner exported (``seal_verified``: hash, compare, seal);
- ``verified_fetch_gpu_local``: a verified fetch between two device pools of one process (the
  read is a device copy; every page is hashed and compared before it is sealed);
- ``verified_fetch_gpu_nixl``: the same over NIXL, VRAM to VRAM between two agents, and
  ``nixl_read_gpu``: NIXL's raw READ of the same slots with nothing verified;
- ``verified_fetch_gpu_same_node``: a verified fetch between two processes' device pools on
  one node, through the owner's CUDA IPC share, against ``cuda_ipc_gather`` (the same pages
  gathered from the same opened handle, nothing verified; target >= 0.5), and
  ``verified_fetch_gpu_nixl_same_node`` beside it (NIXL between the same two processes; the
  mapped fetch aims at >= 100x it, row ``same_node_vs_nixl_gpu``).

The first four aim at half the rate of the device copy (``TARGET``; 0.8 would make hashing
nearly free beside the copy that brings the pages). Every fetched page is also compared with
the owner's bytes, after each timed fetch and outside its timing: a row is written only for a
fetch that delivered exactly what was exported. Without a CUDA device it records every row,
with its target, as "not run: no GPU" (nothing measured, nothing estimated) and exits 77
(skipped).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from common import Row, parse_args, time_median, write_result

from tessera_ray.core import BlockPool, PoolConfig, content_seed
from tessera_ray.errors import TransportUnavailableError
from tessera_ray.layout import preset_layout
from tessera_ray.transport import (
    PageExport,
    PageFetchResult,
    Transport,
    TransportConfig,
    export_pages,
    fetch_verified,
    make_transport,
)

SKIPPED = 77
NOT_RUN = "not run: no GPU"
NAMESPACE = "gpu-check"
LAYOUT = preset_layout("deepseek-v3")
TARGET = 0.5
_ROWS = (
    ("hash_gpu_pages", TARGET),
    ("seal_gpu_pages", TARGET),
    ("verify_gpu_pages", TARGET),
    ("verified_fetch_gpu_local", TARGET),
    ("verified_fetch_gpu_nixl", None),
    ("nixl_read_gpu", None),
)
"""The rows measured before the same-node ones, with their targets (what a run without a GPU
records as not run)."""
"""Hashing, sealing and verifying on the device: at least half the device copy's rate."""


def _pool(pages: int) -> BlockPool:
    return BlockPool.for_group(LAYOUT, 0, PoolConfig(num_pages=pages, device="cuda"))


def _gbps(pages: int, page_bytes: int, seconds: float) -> float:
    return pages * page_bytes / seconds / 1e9


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def _device_copy_s(pages: int, repeat: int) -> float:
    src, dst = _pool(pages).words, _pool(pages).words
    index = torch.randperm(pages, device="cuda")
    return time_median(
        _synced(lambda: dst.index_copy_(0, index, src.index_select(0, index))), repeat=repeat
    )


def _random_pages(pages: int) -> torch.Tensor:
    return torch.randint(0, 256, (pages, _pool(1).page_bytes), dtype=torch.uint8, device="cuda")


def _hash_s(pages: int, repeat: int) -> tuple[float, str]:
    """Median seconds to hash ``pages`` pages of a device pool, and the path that hashed."""
    pool = _pool(pages)
    handles = pool.write_many(pool.allocate_many(pages), _random_pages(pages))
    slots = [int(pool.slot(h)) for h in handles]
    seed = content_seed(NAMESPACE, pool.fingerprint)
    seconds = time_median(_synced(lambda: pool.hash_pages(slots, seed)), repeat=repeat)
    return seconds, pool.hash_path


def _verify_s(pages: int, repeat: int) -> float:
    """Median seconds of ``seal_verified`` over ``pages`` landed pages of a fresh device pool
    each run, against the hashes the host's xxh3 gives their bytes (taken once, untimed): every
    page must verify, so the device hash is also checked against the host's here."""
    data = _random_pages(pages)
    seed = content_seed(NAMESPACE, _pool(1).fingerprint)
    expected = [xxhash.xxh3_128_intdigest(row.numpy().data, seed) for row in data.cpu()]
    samples = []
    for _ in range(repeat + 1):  # the first is a warm-up
        pool = _pool(pages)
        handles = pool.write_many(pool.allocate_many(pages), data)
        torch.cuda.synchronize()
        start = time.perf_counter()
        _, mismatched = pool.seal_verified(handles, NAMESPACE, expected)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
        if mismatched:
            raise AssertionError(f"{len(mismatched)} pages hashed otherwise on the device")
    return statistics.median(samples[1:])


def _seal_s(pages: int, repeat: int) -> float:
    data = _random_pages(pages)
    fresh: list[BlockPool] = []

    def seal() -> None:
        pool = fresh.pop()
        pool.seal_many(pool.write_many(pool.allocate_many(pages), data), NAMESPACE)

    samples = []
    for _ in range(repeat + 1):  # the first is a warm-up
        fresh.append(_pool(pages))
        samples.append(time_median(_synced(seal), repeat=1, warmup=0))
    return sorted(samples[1:])[len(samples[1:]) // 2]


class _Pair:
    """An owner device pool holding ``pages`` sealed, pinned, exported pages and an empty
    reader device pool, on two transports of ``kind``."""

    def __init__(self, kind: str, pages: int) -> None:
        self.owner, self.reader = _pool(pages), _pool(pages)
        config = TransportConfig(kind=kind)
        self.owner_t: Transport = make_transport(config, name=f"owner-{kind}")
        self.reader_t: Transport = make_transport(config, name=f"reader-{kind}")
        if self.owner_t.kind != kind or self.reader_t.kind != kind:
            made = self.owner_t.kind
            self.close()
            raise TransportUnavailableError(f"{kind} transport unavailable (made {made})")
        info = self.owner_t.register([self.owner])
        self.reader_t.register([self.reader])
        self.reader_t.add_peers([info])
        self.data = torch.randint(
            0, 256, (pages, self.owner.page_bytes), dtype=torch.uint8, device="cuda"
        )
        handles = self.owner.write_many(self.owner.allocate_many(pages), self.data)
        sealed = [r.handle for r in self.owner.seal_many(handles, NAMESPACE)]
        self.export: PageExport = export_pages(
            self.owner, sealed, namespace=NAMESPACE, peer=self.owner_t.name
        )

    def fetch(self) -> PageFetchResult:
        """The verified fetch alone: what a reader pays, and all that is timed."""
        return fetch_verified(self.reader_t, self.export, timeout_s=60)

    def check_and_empty(self, result: PageFetchResult) -> None:
        """Compare every fetched byte with the owner's, then empty the reader for the next
        fetch; untimed, since no reader does either."""
        if result.failed:
            raise AssertionError(f"verified fetch failed: {result.failed[0]}")
        got = self.reader.data.index_select(
            0, torch.tensor([self.reader.slot(f.handle) for f in result.fetched], device="cuda")
        )
        if not torch.equal(got, self.data):
            raise AssertionError("a fetched page differs from the owner's")
        self.reader.release_many([f.handle for f in result.fetched])
        self.reader.evict(len(result.fetched), copy_data=False)  # the next fetch starts empty

    def raw_read(self) -> None:
        local = self.reader.allocate_many(len(self.export.slots))
        try:
            slots = [int(self.reader.slot(h)) for h in local]
            ticket = self.reader_t.read(self.owner_t.name, self.export.slots, slots)
            self.reader_t.wait(ticket, 60)
        finally:
            self.reader.release_many(local)

    def close(self) -> None:
        self.reader_t.close()
        self.owner_t.close()


def _fetch_s(pair: _Pair, repeat: int) -> float:
    """Median seconds of ``pair.fetch`` over ``repeat`` runs after one warm-up, each run checked
    and emptied outside its timing."""
    samples = []
    for _ in range(repeat + 1):  # the first is a warm-up
        start = time.perf_counter()
        result = pair.fetch()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
        pair.check_and_empty(result)
    return statistics.median(samples[1:])


def _pair_or_unavailable(
    kind: str, pages: int, make: Callable[[str, int], _Pair] = _Pair
) -> _Pair | Row:
    """The pair, or the row saying why ``kind`` cannot run here. Only an unavailable transport
    becomes a row: any other error is a bug in what is measured, and propagates."""
    try:
        return make(kind, pages)
    except TransportUnavailableError as exc:  # NIXL not importable, or its agent did not start
        return Row.unavailable(f"verified_fetch_gpu_{kind}", "GB/s", str(exc))


def _not_run(rows: tuple[tuple[str, float | None], ...]) -> list[Row]:
    return [Row(name=n, value=None, unit="GB/s", target_ratio=t, note=NOT_RUN) for n, t in rows]


def main() -> int:
    args = parse_args("gpu_pool")
    if not torch.cuda.is_available():
        write_result("gpu_pool", args, _not_run(_ROWS) + same_node_device_rows(0, 0))
        print("skipped: this python sees no CUDA device")
        return SKIPPED
    pages = 256 if args.quick else 1024
    repeat = 3 if args.quick else 7
    page_bytes = _pool(1).page_bytes
    copy = _gbps(pages, page_bytes, _device_copy_s(pages, repeat))
    note = f"{torch.cuda.get_device_name(0)}, {pages} MLA pages of {page_bytes} B"

    def row(name: str, seconds: float, target: float | None = None, how: str = "") -> Row:
        value = _gbps(pages, page_bytes, seconds)
        return Row(
            name=name,
            value=value,
            unit="GB/s",
            baseline="device_copy",
            baseline_value=copy,
            target_ratio=target,
            note=note + how,
        )

    hash_s, path = _hash_s(pages, repeat)
    how = f"; hashed by the {path} path"
    rows = [
        row("hash_gpu_pages", hash_s, TARGET, how),
        row("seal_gpu_pages", _seal_s(pages, repeat), TARGET, how),
        row("verify_gpu_pages", _verify_s(pages, repeat), TARGET, how),
    ]
    for kind in ("local", "nixl"):
        pair = _pair_or_unavailable(kind, pages)
        if isinstance(pair, Row):
            rows.append(pair)
            continue
        try:
            target = TARGET if kind == "local" else None
            rows.append(row(f"verified_fetch_gpu_{kind}", _fetch_s(pair, repeat), target, how))
            if kind == "nixl":
                rows.append(
                    row("nixl_read_gpu", time_median(_synced(pair.raw_read), repeat=repeat))
                )
        finally:
            pair.close()
    rows += same_node_device_rows(pages, repeat)
    write_result("gpu_pool", args, rows)
    return 0


# ---------------------------------------------------------------- same node, two processes

_SAME_NODE = "gpu-same-node"
_SAME_NODE_ROWS = (
    ("verified_fetch_gpu_same_node", TARGET),
    ("cuda_ipc_gather", None),
    ("verified_fetch_gpu_nixl_same_node", None),
    ("same_node_vs_nixl_gpu", 100.0),
)


def _same_node_owner(conn: Any, pages: int) -> None:
    """The owner process of the same-node rows: ``pages`` sealed pages in a device pool behind
    a NIXL transport that publishes the pool's CUDA IPC share; sends its peer info and the
    export, then holds the pages until told to go."""
    pool = _pool(pages)
    transport = make_transport(
        TransportConfig(kind="nixl"), name="same-node-owner", node=_SAME_NODE
    )
    info = transport.register(pool)
    data = torch.randint(0, 256, (pages, pool.page_bytes), dtype=torch.uint8, device="cuda")
    sealed = [
        r.handle
        for r in pool.seal_many(pool.write_many(pool.allocate_many(pages), data), NAMESPACE)
    ]
    torch.cuda.synchronize()
    conn.send((info, export_pages(pool, sealed, namespace=NAMESPACE, peer=transport.name)))
    conn.recv()
    transport.close()


def same_node_device_rows(pages: int, repeat: int) -> list[Row]:
    """The same-node device rows (module docstring): the owner in a second process started
    here, the reader in this one; every fetch checked against the owner's bytes, untimed."""
    if not torch.cuda.is_available():
        return _not_run(_SAME_NODE_ROWS)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from tessera_ray.transport import DeviceShare

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_same_node_owner, args=(there, pages), daemon=True)
    owner.start()
    made: list[Transport] = []
    try:
        info, export = here.recv()
        reader = _pool(pages)
        for name, mode in (("same-node-reader", "auto"), ("same-node-reader-nixl", "backend")):
            config = TransportConfig(kind="nixl", same_node=mode)  # type: ignore[arg-type]
            made.append(make_transport(config, name=name, node=_SAME_NODE))
            made[-1].register(reader)
            made[-1].add_peers([info])
        mapped, nixl = made
        if mapped.carrier(info.name) != "mapped" or nixl.carrier(info.name) != "nixl":
            raise AssertionError("the readers did not take the paths they were told to")
        share = info.mappings[0]
        assert isinstance(share, DeviceShare)
        src = rebuild_cuda_tensor(*share.handle)  # the owner's pool, opened raw
        remote = torch.tensor(export.slots, device="cuda")
        owners = src.index_select(0, remote)
        wide_src, wide_dst = src.view(torch.int64), reader.data.view(torch.int64)
        reserved = reader.allocate_many(pages)
        index = torch.tensor([int(reader.slot(h)) for h in reserved], device="cuda")
        ipc_s = time_median(
            _synced(lambda: wide_dst.index_copy_(0, index, wide_src.index_select(0, remote))),
            repeat=repeat,
        )
        if not torch.equal(reader.data.index_select(0, index), owners):
            raise AssertionError("the raw CUDA IPC gather did not copy the owner's pages")
        reader.release_many(reserved)

        def fetch_s(transport: Transport) -> float:
            samples = []
            for _ in range(repeat + 1):  # the first is a warm-up
                start = time.perf_counter()
                result = fetch_verified(transport, export, timeout_s=60)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - start)
                if result.failed:
                    raise AssertionError(f"verified fetch failed: {result.failed[0]}")
                slots = [int(reader.slot(f.handle)) for f in result.fetched]
                if not torch.equal(reader.data[slots], owners):
                    raise AssertionError("a fetched page differs from the owner's")
                reader.release_many([f.handle for f in result.fetched])
                reader.evict(len(result.fetched), copy_data=False)
            return statistics.median(samples[1:])

        page_bytes = reader.page_bytes
        ipc = _gbps(pages, page_bytes, ipc_s)
        fetched = _gbps(pages, page_bytes, fetch_s(mapped))
        over_nixl = _gbps(pages, page_bytes, fetch_s(nixl))
    finally:
        for transport in made:
            transport.close()
        here.send("done")
        owner.join(60)
    note = f"{torch.cuda.get_device_name(0)}, {pages} MLA pages of {page_bytes} B, two processes"
    return [
        Row(name="cuda_ipc_gather", value=ipc, unit="GB/s", note=f"{note}; nothing verified"),
        Row(
            name="verified_fetch_gpu_same_node",
            value=fetched,
            unit="GB/s",
            baseline="cuda_ipc_gather",
            baseline_value=ipc,
            target_ratio=0.5,
            note=f"{note}; through the owner's CUDA IPC share: gather, hash on the device, "
            "verify, seal",
        ),
        Row(
            name="verified_fetch_gpu_nixl_same_node",
            value=over_nixl,
            unit="GB/s",
            baseline="cuda_ipc_gather",
            baseline_value=ipc,
            note=f"{note}; the same fetch over NIXL",
        ),
        Row(
            name="same_node_vs_nixl_gpu",
            value=fetched,
            unit="GB/s",
            baseline="verified_fetch_gpu_nixl_same_node",
            baseline_value=over_nixl,
            target_ratio=100.0,
            derived_from="verified_fetch_gpu_same_node and verified_fetch_gpu_nixl_same_node",
            note=note,
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
