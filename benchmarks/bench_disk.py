"""Disk tier: batched writes and verified cold reads of MLA pages, against raw file IO.

Rows:

- ``disk_write``: ``DiskTier.put_many`` of DeepSeek-V3 MLA pages (73,728 B: 64 tokens x 576
  bf16 values x 2 B) in batches of 64, the tier in its default configuration (segments read
  and written around the page cache where the filesystem allows it: ``DiskTierConfig.
  direct_io``), against the faster of two raw writes of the same bytes (the same buffers: one
  page set serves every side and round, each round's tier a fresh root) to one fresh file, with
  the same durability work per batch as the tier (a put_many returns once its batch is durable:
  segment fsync, rename, directory fsync): ``raw_write_fsync``, through the page cache, one
  ``writev`` per batch, an fsync of the file and of its directory; ``raw_write_direct``, the
  same append through O_DIRECT. The raw side's directory fsync has little to commit (no name
  changes after the first batch), so this baseline is somewhat easier than the tier's work;
  the tier's extra journal commit for each rename stays in what it is judged on.
  Content hashes are computed before timing: the pool computes them when it hands pages over
  (``DiskBlocks.put`` hashes each block right before ``put_many(..., prehashed=True)``), so
  this row's tier trusts them on the way in, as there; every read verifies regardless.
  ``disk_write_checked`` is the default put_many that hashes each payload again to check its
  key (a caller outside the pool). ``disk_write_buffered`` is the tier with
  ``direct_io=False``; ``disk_write_protocol_direct`` / ``disk_write_protocol_buffered`` run
  the crash-safe protocol alone (per batch a fresh ``.partial``, one write, fsync, rename,
  directory fsync) with no tier code in each IO mode, the ceiling each mode leaves.
- ``disk_read_verify``: ``get_many_into`` of every page into the slots of a ``BlockPool``
  (checksum and content hash verified per page; the slots are block-aligned, so direct reads
  land payloads there with no staging copy), the tier in its default configuration, against
  the faster of two raw reads of the baseline file (the same payload bytes): one buffered read
  into one buffer (``raw_read_cold``) and one O_DIRECT read into huge-page memory like the
  pool's (``raw_read_direct``). All start cold: every file is fdatasync'ed and dropped from the
  page cache (``posix_fadvise(DONTNEED)``) right before its read, outside the timed region.
  ``disk_read_verify_staged`` reads into unaligned buffers (bytearrays), which go through a
  staging buffer and a copy; ``disk_read_verify_buffered`` is the tier with
  ``direct_io=False``; ``disk_read_verify_vs_raw_direct`` sets the tier against the direct read
  whichever is faster; ``disk_read_segments_direct`` /
  ``disk_read_segments_buffered`` read the tier's segment files whole in each mode, on as
  many threads as the tier reads with, nothing verified: what the file layout alone allows.

Rounds interleave the sides, alternating their order, so all see the same machine state; the
median of each side is reported. A shared virtual disk's state moves every side from round to
round (docs/measured-choices.md): judge the ratio over several runs.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from common import Row, parse_args, time_median, write_result

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.core.hostmem import aligned_host_bytes
from tessera_ray.layout import preset_layout
from tessera_ray.storage import DiskTier, content_hasher

GB = 1e9
ALIGN = 4096  # O_DIRECT lengths: a multiple of the logical block (512 B or 4 KiB)
BATCH = 64


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """One writev for the batch, resuming after a short write (as the tier writes)."""
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _stage_batch(stage: memoryview, items: list[tuple[bytes, memoryview]]) -> int:
    """Copy a batch's pages into the aligned buffer back to back; returns the byte count
    (64 pages of 73,728 B: a multiple of 4,096, as O_DIRECT needs)."""
    off = 0
    for _, page in items:
        stage[off : off + page.nbytes] = page
        off += page.nbytes
    return off


def _pwrite_all(fd: int, view: memoryview, offset: int = 0) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _interleaved(sides: list[Callable[[], float]], repeat: int) -> list[float]:
    """Median seconds of each side over ``repeat`` rounds; a round runs every side once, in
    order on even rounds and in reverse on odd ones, so all see the same machine state."""
    samples: list[list[float]] = [[] for _ in sides]
    for r in range(repeat):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            samples[i].append(sides[i]())
    return [statistics.median(s) for s in samples]


def main() -> None:
    args = parse_args("disk")
    layout = preset_layout("deepseek-v3")
    page_bytes = layout.groups[0].page.page_bytes  # 73,728
    num_pages = 512 if args.quick else 2048
    repeat = 3 if args.quick else 9
    hasher = content_hasher("bench", layout.fingerprint)
    base = os.urandom(page_bytes * 8)
    total = num_pages * page_bytes

    def pages() -> list[tuple[bytes, memoryview]]:
        out = []
        for i in range(num_pages):
            buf = bytearray(base[(i % 8) * page_bytes : (i % 8 + 1) * page_bytes])
            buf[:16] = xxhash.xxh3_128_digest(f"page {i}".encode())  # every page distinct
            view = memoryview(buf)
            out.append((hasher(view), view))
        return out

    # One set of pages for every side and round: the same bytes from the same (warm) buffers.
    # Each round's tier is a fresh root, so it stores them all again (nothing deduplicates).
    items = pages()

    with tempfile.TemporaryDirectory(dir=os.environ.get("TESSERA_BENCH_DIR")) as tmp:
        work = Path(tmp)
        sets = iter(range(1 << 30))
        tiers: list[DiskTier] = []

        def tier_write_timed(prehashed: bool, **config: Any) -> float:
            """Seconds of the put_many calls alone (pages hashed and tier opened before)."""
            rep = next(sets)
            tier = DiskTier(
                work / f"tier{rep}",
                1 << 40,
                fingerprint=layout.fingerprint,
                namespace="bench",
                **config,
            )
            tiers.append(tier)

            async def go() -> float:
                start = time.perf_counter()
                for s in range(0, num_pages, BATCH):
                    await tier.put_many(items[s : s + BATCH], prehashed=prehashed)
                return time.perf_counter() - start

            return asyncio.run(go())

        stage = mmap.mmap(-1, total)  # page-aligned, as O_DIRECT needs (raw and protocol)
        raw_paths = (work / f"raw{n}.bin" for n in range(1 << 30))
        raw_path = work / "raw.bin"
        protocol_dirs = (work / f"protocol{n}" for n in range(1 << 30))

        def protocol_write(direct: bool) -> None:
            """The tier's crash-safe protocol alone, no tier code: per batch a fresh
            ``.partial`` (O_DIRECT: the bytes copied into an aligned buffer first), one write,
            fsync, rename, directory fsync."""
            d = next(protocol_dirs)
            d.mkdir()
            view = memoryview(stage)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
            for s in range(0, num_pages, BATCH):
                partial = d / f"{s:08x}.seg.partial"
                fd = os.open(partial, flags, 0o644)
                try:
                    if direct:
                        n = _stage_batch(view, items[s : s + BATCH])
                        _pwrite_all(fd, view[:n])
                        os.fdatasync(fd)
                    else:
                        _write_all(fd, [page for _, page in items[s : s + BATCH]])
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(partial, d / f"{s:08x}.seg")
                dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)

        def raw_write() -> None:
            # A fresh file each time, as the tier writes fresh segments (no block reuse).
            nonlocal raw_path
            raw_path = next(raw_paths)
            fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            dir_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for s in range(0, num_pages, BATCH):
                    _write_all(fd, [view for _, view in items[s : s + BATCH]])
                    os.fsync(fd)
                    os.fsync(dir_fd)  # the tier's per-batch directory fsync, see the docstring
            finally:
                os.close(fd)
                os.close(dir_fd)

        def raw_write_direct() -> None:
            """The raw append again, through O_DIRECT: each batch copied into an aligned
            buffer and written with one call, the same fsyncs."""
            path = next(raw_paths)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            dir_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
            view = memoryview(stage)
            try:
                for s in range(0, num_pages, BATCH):
                    n = _stage_batch(view, items[s : s + BATCH])
                    _pwrite_all(fd, view[:n], s * page_bytes)
                    os.fdatasync(fd)
                    os.fsync(dir_fd)
            finally:
                os.close(fd)
                os.close(dir_fd)

        def timed(fn: Callable[[], None]) -> Callable[[], float]:
            return lambda: time_median(fn, repeat=1, warmup=0)

        write_sides: dict[str, Callable[[], float]] = {
            "tier": lambda: tier_write_timed(prehashed=True),
            "raw": timed(raw_write),
            "tier_buffered": lambda: tier_write_timed(prehashed=True, direct_io=False),
            "checked": lambda: tier_write_timed(prehashed=False),
            "protocol_direct": timed(lambda: protocol_write(direct=True)),
            "protocol_buffered": timed(lambda: protocol_write(direct=False)),
            "raw_direct": timed(raw_write_direct),
        }
        w = dict(
            zip(
                write_sides,
                (total / s / GB for s in _interleaved(list(write_sides.values()), repeat)),
                strict=True,
            )
        )

        # Reads: the last tier written in each IO mode, cold.
        tier = next(t for t in reversed(tiers) if t.config.direct_io is None)
        tier_buffered = next(t for t in reversed(tiers) if t.config.direct_io is False)
        default_mode = "direct" if tier.direct_io else "buffered (no O_DIRECT here)"
        loop = asyncio.new_event_loop()

        async def all_keys() -> list[bytes]:
            return [k async for k in tier.keys()]

        keys = loop.run_until_complete(all_keys())
        # The destination is a BlockPool's slots, where a restore puts pages: the pool's
        # memory starts on a page boundary, so every 73,728 B slot is block-aligned and direct
        # reads land payloads there with no staging copy. Unaligned buffers (bytearrays) take
        # the staging path: the row disk_read_verify_staged.
        slots = BlockPool(
            layout.groups[0].page, PoolConfig(num_pages=len(keys)), fingerprint=layout.fingerprint
        )
        flat = slots.data.numpy().reshape(-1).data
        pool_outs = [flat[i * page_bytes : (i + 1) * page_bytes] for i in range(len(keys))]
        loose_outs = [memoryview(bytearray(page_bytes)) for _ in keys]

        def seg_files(t: DiskTier) -> list[Path]:
            return sorted((t.config.root / "segments").glob("*.seg"))

        def tier_read(t: DiskTier, outs: list[memoryview]) -> float:
            """Seconds of the reads alone: the cache drop before them is setup (for 32
            segment files it costs ~50 ms of fdatasync/fadvise calls here, a third of the
            read itself, against ~1 ms for the one raw file)."""
            _drop_cache(seg_files(t))
            start = time.perf_counter()

            async def go() -> None:
                batches = [
                    t.get_many_into(keys[s : s + BATCH], outs[s : s + BATCH])
                    for s in range(0, len(keys), BATCH)
                ]
                for sizes in await asyncio.gather(*batches):
                    assert all(n == page_bytes for n in sizes)

            loop.run_until_complete(go())
            return time.perf_counter() - start

        big = bytearray(total)

        def raw_read() -> float:
            _drop_cache([raw_path])
            start = time.perf_counter()
            with open(raw_path, "rb", buffering=0) as f:
                assert f.readinto(memoryview(big)) == total
            return time.perf_counter() - start

        threads = tier.config.io_threads
        pool = ThreadPoolExecutor(threads)
        seg_bufs = [mmap.mmap(-1, _align_up(max(p.stat().st_size for p in seg_files(tier))))]
        seg_bufs += [mmap.mmap(-1, len(seg_bufs[0])) for _ in range(threads - 1)]

        def segments_read(t: DiskTier, direct: bool) -> float:
            """The tier's segment files read whole, each with one read, on as many threads as
            the tier reads with, nothing verified: the same bytes as the raw file (plus
            headers) in 32 files instead of one."""
            files = seg_files(t)
            _drop_cache(files)
            free = list(seg_bufs)
            lock = threading.Lock()
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

            def read_one(path: Path) -> None:
                with lock:
                    buf = free.pop()
                try:
                    fd = os.open(path, flags)
                    try:
                        size = _align_up(os.fstat(fd).st_size) if direct else len(buf)
                        os.preadv(fd, [memoryview(buf)[:size]], 0)
                    finally:
                        os.close(fd)
                finally:
                    with lock:
                        free.append(buf)

            start = time.perf_counter()
            list(pool.map(read_one, files))
            return time.perf_counter() - start

        # The raw direct read lands in the same kind of memory as the tier's (page-aligned,
        # huge pages): direct reads into 4 KiB pages ran ~30% slower here (1.36 against 1.93
        # GB/s, 11 rounds), buffered reads the same either way (1.62 / 1.61).
        huge = aligned_host_bytes(total)
        huge[:] = bytes(total)

        def raw_read_direct() -> float:
            """The raw file read again through O_DIRECT with one read into huge-page memory
            (no cache to drop: direct reads bypass it)."""
            start = time.perf_counter()
            fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
            try:
                assert os.preadv(fd, [huge], 0) == total
            finally:
                os.close(fd)
            return time.perf_counter() - start

        read_sides: dict[str, Callable[[], float]] = {
            "tier": lambda: tier_read(tier, pool_outs),
            "tier_staged": lambda: tier_read(tier, loose_outs),
            "raw": raw_read,
            "tier_buffered": lambda: tier_read(tier_buffered, pool_outs),
            "segments_direct": lambda: segments_read(tier, direct=True),
            "segments_buffered": lambda: segments_read(tier_buffered, direct=False),
            "raw_direct": raw_read_direct,
        }
        r = dict(
            zip(
                read_sides,
                (total / s / GB for s in _interleaved(list(read_sides.values()), repeat)),
                strict=True,
            )
        )
        pool.shutdown()
        for t in tiers:
            loop.run_until_complete(t.close())
        loop.close()

    note = f"{num_pages} MLA pages of {page_bytes} B, batches of {BATCH}"
    write_rows = [
        (
            "disk_write_buffered",
            "tier_buffered",
            "raw",
            "the tier with direct_io=False (through the page cache), prehashed as the pool writes",
        ),
        (
            "disk_write_checked",
            "checked",
            "raw",
            "put_many without prehashed (a caller outside "
            "the pool): every payload hashed once more to check its key before anything is "
            "written",
        ),
        (
            "disk_write_protocol_direct",
            "protocol_direct",
            "raw_direct",
            "the crash-safe "
            "protocol with no tier code, O_DIRECT: per batch a fresh .partial, one write, "
            "fdatasync, rename, directory fsync; against the raw O_DIRECT append",
        ),
        (
            "disk_write_protocol_buffered",
            "protocol_buffered",
            "raw",
            "the same protocol "
            "through the page cache (fsync); against the raw buffered append: the ceiling a "
            "buffered tier has",
        ),
        (
            "raw_write_direct",
            "raw_direct",
            "raw",
            "the raw append through O_DIRECT (copy into an aligned buffer, write, the same fsyncs)",
        ),
    ]

    def side_rows(
        vals: dict[str, float], baselines: dict[str, str], specs: list[tuple[str, str, str, str]]
    ) -> list[Row]:
        """Rows reported beside a target row: (name, side, baseline side, what it measures)."""
        return [
            Row(
                name=name,
                value=vals[side],
                unit="GB/s",
                baseline=baselines[base],
                baseline_value=vals[base],
                note=f"{note}; {what}",
                # The tier's own side is its target row's value, set against another baseline.
                derived_from=(
                    f"the value of this section's target row and {baselines[base]}"
                    if side == "tier"
                    else None
                ),
            )
            for name, side, base, what in specs
        ]

    read_rows = [
        (
            "disk_read_verify_staged",
            "tier_staged",
            "raw",
            "the default tier into unaligned buffers (bytearrays): each window read into a "
            "staging buffer, verified there, then copied out",
        ),
        (
            "disk_read_verify_buffered",
            "tier_buffered",
            "raw",
            "the tier with direct_io=False: one "
            "preadv per record straight into the caller's buffer, verified there",
        ),
        (
            "disk_read_segments_direct",
            "segments_direct",
            "raw",
            "the default tier's segment files read "
            f"whole with O_DIRECT on {threads} threads, nothing verified (what the file layout "
            "alone allows)",
        ),
        (
            "disk_read_segments_buffered",
            "segments_buffered",
            "raw",
            "the buffered tier's segment files "
            f"read whole through the page cache on {threads} threads, cold, nothing verified",
        ),
        (
            "disk_read_verify_vs_raw_direct",
            "tier",
            "raw_direct",
            "the default tier (as disk_read_verify) against the raw file read with one "
            "O_DIRECT read into the same kind of memory: the fastest raw read here",
        ),
        (
            "raw_read_direct",
            "raw_direct",
            "raw",
            "the raw file read with one O_DIRECT read into huge-page memory",
        ),
    ]

    def target_row(
        name: str, vals: dict[str, float], baselines: dict[str, str], what: str, miss: str
    ) -> Row:
        """The issue's row: the default tier (side "tier") against the faster raw side of the
        run, buffered ("raw") or O_DIRECT ("raw_direct"): what the disk allows with no tier
        code, whichever way it is reached."""
        side = max(("raw", "raw_direct"), key=lambda k: vals[k])
        return Row(
            name=name,
            value=vals["tier"],
            unit="GB/s",
            baseline=baselines[side],
            baseline_value=vals[side],
            target_ratio=0.8,
            note=(
                f"{note}; {what}; against the faster raw I/O of this run (buffered "
                f"{vals['raw']:.2f}, direct {vals['raw_direct']:.2f} GB/s)"
            ),
            miss_reason=miss,
        )

    rows = [
        target_row(
            "disk_write",
            w,
            {"raw": "raw_write_fsync", "raw_direct": "raw_write_direct"},
            f"the tier as configured by default ({default_mode}), prehashed as the pool writes",
            f"the crash-safe protocol alone ran at {w['protocol_direct'] / w['raw_direct']:.2f} "
            f"of a raw O_DIRECT append and {w['protocol_buffered'] / w['raw']:.2f} of the raw "
            "buffered one in this run; this shared virtual disk's state moves every side from "
            "round to round, so judge the ratio over several runs",
        ),
        *side_rows(w, {"raw": "raw_write_fsync", "raw_direct": "raw_write_direct"}, write_rows),
        target_row(
            "disk_read_verify",
            r,
            {"raw": "raw_read_cold", "raw_direct": "raw_read_direct"},
            f"the tier as configured by default ({default_mode}, {threads} IO threads) into the "
            "slots of a BlockPool: whole segment windows per read, payloads straight into the "
            "slots, every page verified there",
            "the pages live in 32 segment files (4.7 MB each) where the raw bytes are one file: "
            "those files read whole on the tier's threads, nothing verified, ran at "
            f"{r['segments_direct'] / max(r['raw'], r['raw_direct']):.2f} of the faster raw "
            f"read direct and {r['segments_buffered'] / max(r['raw'], r['raw_direct']):.2f} "
            "buffered in this run (rows "
            "disk_read_segments_*); the tier's per-page header checks hold the GIL, so an IO "
            "thread that finished a read waits for it before issuing the next; judge the "
            "ratio over several runs",
        ),
        *side_rows(r, {"raw": "raw_read_cold", "raw_direct": "raw_read_direct"}, read_rows),
    ]
    write_result("disk", args, rows)


if __name__ == "__main__":
    main()
