"""Moving pages between two Ray actors: the tier's verified fetch against raw NIXL, the Ray
object store and memcpy, all measured in one run on the same pools and the same bytes.

Two cases: 256 DeepSeek-V3 MLA pages of 73,728 B (FlashMLA's bf16 page), and 16 MiB batches
of 1 MiB pages. Per case, in the reader actor, interleaved so noise hits all alike, and each
timed step after the reader wrote a 96 MiB scratch buffer, so none finds the bytes in the
caches where the step before it left them (the raw READ used to follow a fetch of the same
bytes, and ran about a fifth faster for it):

- ``fetch_full_path``: ask the owner to look the pages up by token key and pin them (one
  request on the tier's pin channel, ``actors/channel.py``, answered on the owner's own event
  loop) and reserve the reader's slots while it answers; NIXL READs into them on the
  transport's I/O thread, in requests of 512 KiB (``TransportConfig.hash_chunk_bytes``), each
  request's pages hashed there as soon as it lands, still in that core's cache; compare every
  page's content hash with the export, seal; the unpin is sent without waiting, as a pool
  actor does.
- ``raw_nixl_read``: the same bytes and slots with NIXL alone (own agents, prepared lists, one
  request, busy completion check): the ceiling. Target ratio >= 0.6.
- ``ray_object_store``: the owner returns the pages through the object store and the reader
  copies them into its slots (what the Ray fallback does, without verification). Target >= 2.
- ``memcpy``: the same bytes copied within the reader's process. Reported.

More rows split the full path: ``fetch_owner_call`` (the owner's lookup + pin + export over
the channel, the reader's reservation beside it, ms), ``fetch_owner_call_ray`` and
``fetch_full_path_ray_pin`` (the same with the pin as a Ray actor call, what a pool without a
channel does), ``actor_noop_call`` (the same actors' round trip for a method that does
nothing, ms: Ray's floor), ``fetch_read_verify_seal`` (the reader's part, GB/s) and
``verified_read_floor`` (raw READs in the same requests, each one's pages hashed as it lands,
nothing else: the most any verified fetch reaches here). ``nixl_transfer_call`` is the time
spent inside NIXL's ``transfer()`` call of the raw READ: the Python binding copies there, on
the calling thread. ``read_while_hashing`` runs a raw READ on a kept thread while this one
hashes as many other bytes: on this VM they take nearly the sum of both apart, while a hash in
a separate process mostly overlaps the READ, and hashing each
request's pages on the other core while the next one lands, even from C without the GIL, does
no better than hashing them on the I/O thread (docs/verified-fetch-probes.md).

A third case puts both pools on one node, the owner's in shared memory: the verified fetch
through the mapped slab against a bare memcpy out of the same mapping (target >= 0.8), with
NIXL between the same two processes beside it (``benchmarks/_same_node.py``).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before anything loads UCX: its ib module crashes a process at exit with some system
# libibverbs (this single-host benchmark has no use for RDMA); an operator's choice stays.
os.environ.setdefault("UCX_MODULES", "^ib")

from common import Row, parse_args, start_local_ray, write_result  # noqa: E402

GB = 1e9
MIB = 1 << 20


class BenchNode:
    """One pool with its tier transport, plus a separate raw NIXL agent on the same memory."""

    def __init__(self, name: str, page_bytes: int, num_pages: int) -> None:
        import torch

        from tessera_ray.actors._heap import freeze_startup_heap
        from tessera_ray.core import BlockPool, PoolConfig, token_key
        from tessera_ray.transport import TransportConfig, make_transport

        page, fingerprint = page_spec(page_bytes)
        self.pool = BlockPool(page, PoolConfig(num_pages=num_pages), fingerprint=fingerprint)
        self.namespace = "bench"
        self.transport = make_transport(TransportConfig(kind="nixl", timeout_s=30), name=name)
        self.info = self.transport.register(self.pool)
        # The raw baseline drives the transport's own agent and prepared lists with bare NIXL
        # calls: same memory, same descriptors, same progress thread. A second agent would add
        # a second busy progress thread, which on a 2-core machine slows both paths.
        self.raw = self.transport._agent  # type: ignore[attr-defined]
        self.raw_local = self.transport._local  # type: ignore[attr-defined]
        self.raw_remote: Any = None
        self.leases: dict[int, list[Any]] = {}
        self.lock = threading.Lock()
        self.keys: list[Any] = []
        self._token_key = token_key
        self._torch = torch
        freeze_startup_heap()  # as a pool actor does once started

    def peer(self) -> Any:
        return self.info

    def connect(self, info: Any) -> None:
        self.transport.add_peers([info])
        self.raw_remote = self.transport._remote[info.name]  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- owner side
    def fill(self, n: int) -> list[Any]:
        """``n`` random sealed single-page blocks, registered under token keys."""
        handles = self.pool.allocate_many(n)
        handles = self.pool.write_many(handles, payload(n, self.pool.page_bytes))
        for i, h in enumerate(handles):
            key = self._token_key(self.namespace, self.pool.fingerprint, None, [i])
            res = self.pool.seal_block([h], self.namespace, key)
            self.pool.release(res.handles[0])
            self.keys.append(key)
        return self.keys

    def slots(self) -> list[int]:
        handles = [self.pool.lookup(self.namespace, k) for k in self.keys]
        out = [int(self.pool.slot(h[0])) for h in handles if h is not None]
        self.pool.release_many([h[0] for h in handles if h is not None])
        return out

    def pin_export(self, keys: list[Any]) -> Any:
        """Lookup (takes the pins) and export, as the owner's actor does for a fetch."""
        from tessera_ray.transport import export_pages

        with self.lock:
            found = self.pool.lookup_many(self.namespace, keys)
            handles = [h[0] for h in found if h is not None]
            export = export_pages(
                self.pool, handles, namespace=self.namespace, peer=self.transport.name
            )
            self.leases[id(export)] = handles
        return id(export), export

    def serve_channel(self) -> Any:
        """Serve pin_export and unpin on the tier's pin channel (``actors/channel.py``), on an
        event loop of its own, as a pool actor serves them on its loop; returns the address."""
        import asyncio
        import threading

        from tessera_ray.actors.channel import ChannelServer

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        # Answered in the read callback, as a pool actor answers a pin of resident blocks.
        self.server = ChannelServer({"pin": self.pin_export, "unpin": self.unpin}, host="127.0.0.1")
        return asyncio.run_coroutine_threadsafe(self.server.start(), loop).result()

    def noop(self) -> None:
        """Nothing: the cost of a Ray actor call alone, for the owner round trip's split."""

    def unpin(self, lease: int) -> None:
        with self.lock:  # the Ray thread and the channel's loop both call it
            self.pool.release_many(self.leases.pop(lease))

    def serve(self, slots: list[int]) -> Any:
        index = self._torch.tensor(slots, dtype=self._torch.long)
        return self.pool.data.index_select(0, index).numpy()

    # ---------------------------------------------------------------- reader side
    def measure(
        self, owner: Any, channel: Any, keys: list[Any], remote_slots: list[int], reps: int
    ) -> Any:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        import ray
        import xxhash

        from tessera_ray.core import content_seed
        from tessera_ray.transport import fetch_verified
        from tessera_ray.transport._rows import scatter_rows

        torch, pool, n = self._torch, self.pool, len(keys)
        src = torch.randint(0, 256, (n, pool.page_bytes), dtype=torch.uint8)
        dst = torch.empty_like(src)
        times: dict[str, list[float]] = {
            "full": [],
            "raw": [],
            "ray": [],
            "memcpy": [],
            "full_ray_pin": [],
        }
        parts: dict[str, list[float]] = {
            "owner_call": [],
            "owner_call_ray": [],
            "read_verify_seal": [],
            "noop": [],
            "hash": [],
            "verified_read_floor": [],
            "read_while_hashing": [],
            "transfer_call": [],
        }
        rows_src = [memoryview(r.numpy()) for r in src]

        def hash_all() -> None:
            for row in rows_src:
                xxhash.xxh3_128_intdigest(row, 1)

        def raw_read(local: list[int], remote: list[int] = remote_slots) -> float:
            """One raw READ; returns the seconds spent inside ``transfer()`` alone."""
            h = self.raw.make_prepped_xfer("READ", self.raw_local, local, self.raw_remote, remote)
            t = time.perf_counter()
            state = self.raw.transfer(h)
            in_call = time.perf_counter() - t
            while state == "PROC":
                state = self.raw.check_xfer_state(h)
            assert state == "DONE"
            self.raw.release_xfer_handle(h)
            return in_call

        seed = content_seed(self.namespace, pool.fingerprint)
        step = max(1, self.transport.config.hash_chunk_bytes // pool.page_bytes)

        def hashed_read(local: list[int]) -> None:
            """The least a verified read does: raw READs in the transport's request size, each
            request's pages hashed as soon as it lands (no bookkeeping, no owner)."""
            for a in range(0, n, step):
                raw_read(local[a : a + step], remote_slots[a : a + step])
                pool.hash_pages(local[a : a + step], seed)

        from tessera_ray.actors.channel import ChannelClient

        io = ThreadPoolExecutor(max_workers=1)  # kept for every READ, as the transport's thread
        loop = asyncio.new_event_loop()
        client = loop.run_until_complete(ChannelClient.connect(channel, 10.0))

        def fetched(res: Any) -> list[int]:
            """Check a fetch, then free its pages for the next round; returns their slots."""
            assert res.ok and len(res.fetched) == n and not any(f.deduplicated for f in res.fetched)
            local = [int(pool.slot(f.handle)) for f in res.fetched]
            pool.release_many([f.handle for f in res.fetched])
            pool.evict(n, copy_data=False)
            return local

        scratch = torch.empty(96 << 20, dtype=torch.uint8)

        def cold() -> None:
            """Push the pages out of the caches (L3 here: 32 MiB, shared by both processes),
            so that no timed step finds the bytes the step before it read."""
            scratch.fill_(1)

        async def full_path() -> tuple[Any, float, float, float, float]:
            """The tier's path, as a pool actor runs it on its running loop: the pin sent over
            the owner's channel, the reader's slots reserved while the owner answers, the read,
            verify and seal, the unpin sent without waiting. Returns the result and the times
            it began, got the answer, ended the fetch, and ended. Timed in here: starting this
            harness's loop for each round (0.3 ms here, with cold caches) is no part of it."""
            began = time.perf_counter()
            pending = client.request("pin", keys)
            local = pool.allocate_many(n)
            lease, export = await pending.answer(30)
            t_call = time.perf_counter()
            res = fetch_verified(self.transport, export, local=local, timeout_s=30)
            t_fetch = time.perf_counter()
            client.send("unpin", lease)
            return res, began, t_call, t_fetch, time.perf_counter()

        for rep in range(reps + 1):  # the first round warms every path up, untimed
            cold()
            res, t_full, t_call, t_fetch, ended = loop.run_until_complete(full_path())
            full = ended - t_full
            fetched(res)

            # The same with the pin as a Ray actor call (what a pool without a channel does).
            cold()
            t = time.perf_counter()
            pinning = owner.pin_export.remote(keys)
            reserved = pool.allocate_many(n)
            lease, export = ray.get(pinning)
            owner_call_ray = time.perf_counter() - t
            res = fetch_verified(self.transport, export, local=reserved, timeout_s=30)
            owner.unpin.remote(lease)
            full_ray_pin = time.perf_counter() - t
            local = fetched(res)

            cold()
            t = time.perf_counter()
            transfer_call = raw_read(local)
            raw = time.perf_counter() - t

            cold()
            t = time.perf_counter()
            io.submit(hashed_read, local).result()  # on a kept thread, as the transport's
            floor = time.perf_counter() - t

            cold()
            t = time.perf_counter()
            hash_all()
            hashing = time.perf_counter() - t

            cold()
            # Can the reader hash pages while a READ lands others? The READ on a thread kept
            # for it, as the transport's I/O thread runs it, and the hashing on this one.
            t = time.perf_counter()
            reading = io.submit(raw_read, local)
            hash_all()
            reading.result()
            overlapped = time.perf_counter() - t

            cold()
            t = time.perf_counter()
            rows = ray.get(owner.serve.remote(remote_slots))
            scatter_rows(pool.data, local, rows)
            via_ray = time.perf_counter() - t
            del rows

            cold()
            t = time.perf_counter()
            dst.copy_(src)
            copy = time.perf_counter() - t

            t = time.perf_counter()
            ray.get(owner.noop.remote())
            noop = time.perf_counter() - t
            if rep:
                for k, v in zip(times, (full, raw, via_ray, copy, full_ray_pin), strict=True):
                    times[k].append(v)
                parts["owner_call"].append(t_call - t_full)
                parts["owner_call_ray"].append(owner_call_ray)
                parts["read_verify_seal"].append(t_fetch - t_call)
                parts["noop"].append(noop)
                parts["hash"].append(hashing)
                parts["verified_read_floor"].append(floor)
                parts["read_while_hashing"].append(overlapped)
                parts["transfer_call"].append(transfer_call)
        nbytes = n * pool.page_bytes
        out = {k: nbytes / statistics.median(v) / GB for k, v in times.items()}
        out.update({f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()})
        return out


MLA_PAGE_BYTES = 73_728
"""DeepSeek-V3's FlashMLA bf16 page: 64 tokens x 576 values x 2 B."""


def payload(n: int, page_bytes: int) -> Any:
    """The pages every system in the transport and peer benchmarks moves: ``n`` seeded random
    uint8 rows of ``page_bytes`` (a torch tensor), the same bytes in every process."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=gen)


def page_spec(page_bytes: int) -> tuple[Any, str]:
    """A page spec of ``page_bytes`` and its layout fingerprint: DeepSeek-V3's real MLA page for
    73,728 B, otherwise a 64-token bf16 page with a 64-value RoPE region and the latent sized to
    fit (only the size matters to a transfer). ``page_bytes`` is a multiple of 128 above 8 KiB.
    """
    from tessera_ray.layout import (
        CacheSpec,
        DType,
        EntryFormat,
        PageSpec,
        Region,
        Scheme,
        preset_layout,
    )

    if page_bytes == MLA_PAGE_BYTES:
        layout = preset_layout("deepseek-v3")
        return layout.groups[0].page, layout.fingerprint
    rope_values, tokens, value_bytes = 64, 64, 2
    entry = EntryFormat(
        name=f"bench-{page_bytes}",
        regions=(
            Region(
                name="c_kv",
                num_values=page_bytes // (tokens * value_bytes) - rope_values,
                dtype=DType.BF16,
            ),
            Region(name="k_rope", num_values=rope_values, dtype=DType.BF16),
        ),
    )
    page = PageSpec(cache=CacheSpec(scheme=Scheme.MLA, entry=entry), block_tokens=tokens)
    assert page.page_bytes == page_bytes, (page.page_bytes, page_bytes)
    return page, f"bench-{page_bytes}-layout"


def run_case(page_bytes: int, n: int, reps: int) -> dict[str, float]:
    """Start an owner and a reader pool actor with ``n`` pages of ``page_bytes``, fill the
    owner, measure from the reader (see the module docstring), stop both."""
    import ray

    node: Any = ray.remote(BenchNode).options(num_cpus=0)
    owner = node.remote(f"bench-owner-{page_bytes}", page_bytes, n)
    reader = node.remote(f"bench-reader-{page_bytes}", page_bytes, n)
    ray.get(reader.connect.remote(ray.get(owner.peer.remote())))
    keys = ray.get(owner.fill.remote(n))
    slots = ray.get(owner.slots.remote())
    channel = ray.get(owner.serve_channel.remote())
    out: dict[str, float] = ray.get(reader.measure.remote(owner, channel, keys, slots, reps))
    for actor in (owner, reader):
        ray.kill(actor)
    return out


def _ms(name: str, value: float, note: str) -> Row:
    """A part of the fetch path timed in ms, reported without a baseline."""
    return Row(name=name, value=value, unit="ms", note=note)


def _vs_raw(
    r: dict[str, float], nbytes: int, label: str, note: str, name: str, key: str, what: str
) -> Row:
    """A part of the fetch path timed in ms (``r[key]``), as GB/s against raw NIXL READ."""
    return Row(
        name=name,
        value=nbytes / r[key] / 1e6,
        unit="GB/s",
        baseline=f"raw_nixl_read_{label}",
        baseline_value=r["raw"],
        note=f"{note}; {what}",
    )


def main() -> None:
    args = parse_args("transport")
    import ray

    start_local_ray(pythonpath=(str(ROOT), str(ROOT / "benchmarks")))
    reps = 7 if args.quick else 25
    cases = [
        ("mla256", MLA_PAGE_BYTES, 256, "256 MLA pages x 73,728 B"),
        ("16mib", MIB, 16, "16 x 1 MiB"),
    ]
    rows: list[Row] = []
    try:
        for label, page_bytes, n, note in cases:
            r = run_case(page_bytes, n, reps)
            nbytes = n * page_bytes
            full = f"fetch_full_path_{label}"
            raw_ms = nbytes / r["raw"] / 1e6
            # The reason comes from this run's own split of the full path.
            why = (
                f"the owner's lookup + pin + export over the channel takes "
                f"{r['owner_call_ms']:.1f} ms of the {nbytes / r['full'] / 1e6:.1f} ms batch "
                f"(as a Ray actor call {r['owner_call_ray_ms']:.1f} ms; a Ray call doing "
                f"nothing {r['noop_ms']:.1f} ms), against {raw_ms:.1f} ms for the whole raw "
                f"READ; and the reader's part (READ, hash every page as it lands, seal) runs "
                f"at {nbytes / r['read_verify_seal_ms'] / 1e6 / r['raw']:.2f} of raw NIXL READ, "
                f"with its floor, the READ and its hashing alone, at "
                f"{raw_ms / r['verified_read_floor_ms']:.2f} (row verified_read_floor_{label}): "
                f"on this 2-core VM a hash does not overlap a READ (two threads take "
                f"{r['read_while_hashing_ms']:.1f} ms against {raw_ms:.1f} + "
                f"{r['hash_ms']:.1f} ms apart, row read_while_hashing_{label}; a hash in "
                f"another process is itself slowed about 2x; hashing "
                f"each request's pages on the other core while the next one lands, even from C "
                f"with the GIL released, slows the copy and does no better, "
                f"docs/verified-fetch-probes.md), so verifying costs a pass over the bytes "
                f"after the copy before any owner round trip or bookkeeping"
            )

            rows += [
                Row(name=f"raw_nixl_read_{label}", value=r["raw"], unit="GB/s", note=note),
                Row(name=f"ray_object_store_{label}", value=r["ray"], unit="GB/s", note=note),
                Row(name=f"memcpy_{label}", value=r["memcpy"], unit="GB/s", note=note),
                Row(
                    name=full,
                    value=r["full"],
                    unit="GB/s",
                    baseline=f"raw_nixl_read_{label}",
                    baseline_value=r["raw"],
                    target_ratio=0.6,
                    note=f"{note}; lookup+pin+READ+verify+seal",
                    miss_reason=why,
                ),
                Row(
                    name=f"{full}_vs_ray",
                    value=r["full"],
                    unit="GB/s",
                    baseline=f"ray_object_store_{label}",
                    baseline_value=r["ray"],
                    target_ratio=2.0,
                    derived_from=f"{full} and ray_object_store_{label}",
                    note=note,
                    miss_reason=f"{why}; on one node Ray's get is a copy out of shared memory",
                ),
                _vs_raw(
                    r,
                    nbytes,
                    label,
                    note,
                    f"fetch_read_verify_seal_{label}",
                    "read_verify_seal_ms",
                    "the reader's part of the full path (no owner round trip)",
                ),
                _ms(
                    f"fetch_owner_call_{label}",
                    r["owner_call_ms"],
                    f"{note}; lookup + pin + export, one request on the pin channel",
                ),
                _ms(
                    f"fetch_owner_call_ray_{label}",
                    r["owner_call_ray_ms"],
                    f"{note}; the same as one Ray actor call",
                ),
                Row(
                    name=f"fetch_full_path_ray_pin_{label}",
                    value=r["full_ray_pin"],
                    unit="GB/s",
                    baseline=f"raw_nixl_read_{label}",
                    baseline_value=r["raw"],
                    note=f"{note}; the full path with the pin as a Ray actor call (a pool "
                    "without a channel)",
                ),
                _vs_raw(
                    r,
                    nbytes,
                    label,
                    note,
                    f"verified_read_floor_{label}",
                    "verified_read_floor_ms",
                    "raw READs in requests of hash_chunk_bytes on a kept thread, each request's "
                    "pages hashed as soon as it lands, nothing else: what any verified fetch "
                    "could reach here",
                ),
                _vs_raw(
                    r,
                    nbytes,
                    label,
                    note,
                    f"hash_pages_{label}",
                    "hash_ms",
                    "xxh3-128 of every page in the reader, nothing else running",
                ),
                _vs_raw(
                    r,
                    nbytes,
                    label,
                    note,
                    f"read_while_hashing_{label}",
                    "read_while_hashing_ms",
                    "a raw READ on a thread kept for it while this one hashes as many other bytes, "
                    "GB/s of the READ's bytes: at 1.0 the hashing would be free, at READ+hash "
                    "apart it does not overlap at all",
                ),
                _ms(
                    f"nixl_transfer_call_{label}",
                    r["transfer_call_ms"],
                    f"{note}; time inside NIXL's transfer() call of the raw READ (the binding "
                    "copies there, on the calling thread); the whole raw READ takes "
                    f"{nbytes / r['raw'] / 1e6:.2f} ms",
                ),
                _ms(
                    f"actor_noop_call_{label}",
                    r["noop_ms"],
                    f"{note}; a Ray call of an owner method that does nothing, same actors",
                ),
                Row(
                    name=f"{full}_vs_memcpy",
                    value=r["full"],
                    unit="GB/s",
                    baseline=f"memcpy_{label}",
                    baseline_value=r["memcpy"],
                    derived_from=f"{full} and memcpy_{label}",
                    note=note,
                ),
            ]
        from _same_node import run_same_node, same_node_rows

        n = 256 if args.quick else 1024
        label, note = f"mla{n}", f"{n} MLA pages x 73,728 B"
        r = run_same_node(MLA_PAGE_BYTES, n, reps)
        rows += same_node_rows(r, label, note, n * MLA_PAGE_BYTES)
    finally:
        ray.shutdown()
    write_result("transport", args, rows)


if __name__ == "__main__":
    main()
