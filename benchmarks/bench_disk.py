"""Disk tier: batched writes and verified cold reads of MLA pages, against raw file IO.

Rows:

- ``disk_write``: ``DiskTier.put_many`` of DeepSeek-V3 MLA pages (73,728 B: 64 tokens x 576
  bf16 values x 2 B) in batches of 64, against writing the same bytes (the same buffers: one
  page set serves every side and round, each round's tier a fresh root) sequentially to one
  fresh file, one ``writev`` per batch, with the same durability work per batch as the tier:
  an fsync of the file and an fsync of its directory (a put_many returns once its batch is
  durable: segment fsync, rename, directory fsync). The raw side's directory fsync has little
  to commit (no name changes after the first batch); in 15 interleaved rounds here it made
  the raw write 8% slower in the median (671 vs 724 ms), inside this disk's round-to-round
  spread (0.2x-4x), so this baseline is somewhat easier than file fsyncs alone. The tier's
  extra journal commit for each rename stays in what it is judged on.
  Content hashes are computed before timing: the pool computes them when it hands pages over
  (``DiskBlocks.put`` hashes each block right before ``put_many(..., prehashed=True)``), so
  this row's tier trusts them on the way in, as there, and writes headers, renames and
  fsyncs the directory; every read verifies regardless. ``disk_write_checked`` is the
  default put_many that hashes each payload again to check its key (a caller outside the
  pool), reported beside it.
  The tier runs in its default IO mode (buffered, through the page cache); ``disk_write_direct``
  is the same tier with ``direct_io=True`` (``storage/_direct.py``), ``raw_write_direct`` the
  raw append through O_DIRECT, and ``disk_write_protocol_alone`` the tier's protocol in that
  mode with no tier code, so that no IO mode hides a cost.
- ``disk_read_verify``: ``get_many_into`` of every page into preallocated buffers (checksum
  and content hash verified per page), against one raw read of the baseline file (the same
  payload bytes) into one buffer. Both start cold: every file is fdatasync'ed and dropped from
  the page cache (``posix_fadvise(DONTNEED)``) right before its read, outside the timed
  region on both sides. ``raw_read_direct`` reads the raw file with one O_DIRECT read, and
  ``disk_read_segments_alone`` reads the tier's segment files whole, buffered, nothing
  verified.

Rounds interleave the sides, alternating their order, so all see the same machine state; the
median of each side is reported. This VM shares its disk and 2 cores with other
work, so single runs scatter widely (raw write moved 0.05-1.2 GB/s within one afternoon): judge
the ratio over several runs.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash
from common import Row, parse_args, time_median, write_result

from tessera_ray.layout import preset_layout
from tessera_ray.storage import DiskTier, content_hasher

GB = 1e9
BATCH = 64


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
    repeat = 3 if args.quick else 7
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

        def tier_write_timed(prehashed: bool, direct: bool = False) -> float:
            """Seconds of the put_many calls alone (pages hashed and tier opened before)."""
            rep = next(sets)
            tier = DiskTier(
                work / f"tier{rep}",
                1 << 40,
                fingerprint=layout.fingerprint,
                namespace="bench",
                direct_io=direct,
                io_threads=8 if direct else 4,  # direct reads gain from more (DiskTierConfig)
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
        raw_items = items

        protocol_dirs = (work / f"protocol{n}" for n in range(1 << 30))

        def protocol_write() -> None:
            """The tier's crash-safe protocol alone, in the tier's IO mode, no tier code: per
            batch a fresh ``.partial`` opened O_DIRECT, the same bytes copied into an aligned
            buffer and written, fdatasync, rename, directory fsync."""
            d = next(protocol_dirs)
            d.mkdir()
            view = memoryview(stage)
            for s in range(0, num_pages, BATCH):
                partial = d / f"{s:08x}.seg.partial"
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
                try:
                    n = _stage_batch(view, raw_items[s : s + BATCH])
                    _pwrite_all(fd, view[:n])
                    os.fdatasync(fd)
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
                    _write_all(fd, [view for _, view in raw_items[s : s + BATCH]])
                    os.fsync(fd)
                    os.fsync(dir_fd)  # the tier's per-batch directory fsync, see the docstring
            finally:
                os.close(fd)
                os.close(dir_fd)

        def raw_write_direct() -> None:
            """The raw append again, through O_DIRECT: each batch copied into an aligned
            buffer and written with one call, the same fsyncs (raw IO in the tier's mode)."""
            path = next(raw_paths)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            dir_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
            view = memoryview(stage)
            try:
                for s in range(0, num_pages, BATCH):
                    n = _stage_batch(view, raw_items[s : s + BATCH])
                    _pwrite_all(fd, view[:n], s * page_bytes)
                    os.fdatasync(fd)
                    os.fsync(dir_fd)
            finally:
                os.close(fd)
                os.close(dir_fd)

        write_gbs, raw_write_gbs, proto_gbs, raw_direct_gbs, checked_gbs, direct_gbs = (
            total / s / GB
            for s in _interleaved(
                [
                    lambda: tier_write_timed(prehashed=True),
                    lambda: time_median(raw_write, repeat=1, warmup=0),
                    lambda: time_median(protocol_write, repeat=1, warmup=0),
                    lambda: time_median(raw_write_direct, repeat=1, warmup=0),
                    lambda: tier_write_timed(prehashed=False),
                    lambda: tier_write_timed(prehashed=True, direct=True),
                ],
                repeat,
            )
        )

        # Reads: the last tier written in each IO mode, cold.
        tier = next(t for t in reversed(tiers) if not t.direct_io)
        tier_direct = next(t for t in reversed(tiers) if t.direct_io)
        loop = asyncio.new_event_loop()

        async def all_keys() -> list[bytes]:
            return [k async for k in tier.keys()]

        keys = loop.run_until_complete(all_keys())
        outs = [bytearray(page_bytes) for _ in keys]
        seg_files = sorted((tier.config.root / "segments").glob("*.seg"))
        direct_files = sorted((tier_direct.config.root / "segments").glob("*.seg"))

        def tier_read(tier: DiskTier = tier, files: list[Path] = seg_files) -> float:
            """Seconds of the reads alone: the cache drop before them is setup (for 32
            segment files it costs ~50 ms of fdatasync/fadvise calls here, a third of the
            read itself, against ~1 ms for the one raw file)."""
            _drop_cache(files)
            start = time.perf_counter()

            async def go() -> None:
                batches = [
                    tier.get_many_into(keys[s : s + BATCH], outs[s : s + BATCH])
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

        seg_buf = bytearray(max(p.stat().st_size for p in seg_files))

        def segments_read() -> float:
            """The tier's segment files read whole, one after another, nothing verified: the
            same bytes as the raw file (plus headers), in 32 files instead of one."""
            _drop_cache(seg_files)
            start = time.perf_counter()
            for p in seg_files:
                with open(p, "rb", buffering=0) as f:
                    f.readinto(memoryview(seg_buf))
            return time.perf_counter() - start

        def raw_read_direct() -> float:
            """The raw file read again through O_DIRECT into an aligned buffer (no cache to
            drop: direct reads bypass it)."""
            start = time.perf_counter()
            fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
            try:
                assert os.preadv(fd, [memoryview(stage)], 0) == total
            finally:
                os.close(fd)
            return time.perf_counter() - start

        read_gbs, raw_read_gbs, seg_read_gbs, raw_read_direct_gbs, read_direct_gbs = (
            total / s / GB
            for s in _interleaved(
                [
                    tier_read,
                    raw_read,
                    segments_read,
                    raw_read_direct,
                    lambda: tier_read(tier_direct, direct_files),
                ],
                repeat,
            )
        )
        for t in tiers:
            loop.run_until_complete(t.close())
        loop.close()

    note = f"{num_pages} MLA pages of {page_bytes} B, batches of {BATCH}"
    proto_ratio = proto_gbs / raw_direct_gbs
    direct_read_ratio = raw_read_direct_gbs / raw_read_gbs
    seg_ratio = seg_read_gbs / raw_read_gbs
    write_result(
        "disk",
        args,
        [
            Row(
                name="disk_write",
                value=write_gbs,
                unit="GB/s",
                baseline="raw_write_fsync",
                baseline_value=raw_write_gbs,
                target_ratio=0.8,
                note=note,
                miss_reason="buffered, each batch's fresh segment (.partial, fsync, rename, "
                "directory fsync) costs more than the raw append's fsync; the same tier with "
                f"direct_io=True wrote at {direct_gbs / raw_write_gbs:.2f} of raw in this run "
                "(row disk_write_direct) and its protocol alone at "
                f"{proto_ratio:.2f} of a raw O_DIRECT append; this shared virtual disk's state "
                "moves every side from round to round, so judge the ratio over several runs",
            ),
            Row(
                name="disk_write_direct",
                value=direct_gbs,
                unit="GB/s",
                baseline="raw_write_fsync",
                baseline_value=raw_write_gbs,
                note=f"{note}; the tier with direct_io=True (segments written around the page "
                "cache), prehashed as the pool writes",
            ),
            Row(
                name="disk_write_checked",
                value=checked_gbs,
                unit="GB/s",
                baseline="raw_write_fsync",
                baseline_value=raw_write_gbs,
                note=f"{note}; put_many without prehashed (a caller outside the pool): every "
                "payload hashed once more to check its key before anything is written",
            ),
            Row(
                name="disk_write_protocol_alone",
                value=proto_gbs,
                unit="GB/s",
                baseline="raw_write_direct",
                baseline_value=raw_direct_gbs,
                note=f"{note}; the atomic-write protocol in the tier's IO mode with no tier "
                "code: per batch a fresh O_DIRECT .partial, one write, fdatasync, rename, "
                "directory fsync (the ceiling it leaves; against the raw append in that mode)",
            ),
            Row(
                name="raw_write_direct",
                value=raw_direct_gbs,
                unit="GB/s",
                baseline="raw_write_fsync",
                baseline_value=raw_write_gbs,
                note=f"{note}; the raw append through O_DIRECT (copy into an aligned buffer, "
                "write, the same fsyncs): raw IO in the tier's IO mode, for comparison",
            ),
            Row(
                name="disk_read_verify",
                value=read_gbs,
                unit="GB/s",
                baseline="raw_read_cold",
                baseline_value=raw_read_gbs,
                target_ratio=0.8,
                note=note,
                miss_reason="the pages live in 32 segment files (4.7 MB each) where the raw "
                "bytes are one file: the segment files read whole, buffered, nothing verified, "
                f"ran at {seg_ratio:.2f} of raw in this run (row disk_read_segments_alone); "
                f"with direct_io=True the tier read at {read_direct_gbs / raw_read_gbs:.2f} "
                f"(row disk_read_verify_direct), a raw O_DIRECT read at {direct_read_ratio:.2f}",
            ),
            Row(
                name="disk_read_verify_direct",
                value=read_direct_gbs,
                unit="GB/s",
                baseline="raw_read_cold",
                baseline_value=raw_read_gbs,
                note=f"{note}; the tier with direct_io=True: whole segment windows read around "
                "the page cache on 8 IO threads, verified in a staging buffer, copied out",
            ),
            Row(
                name="disk_read_segments_alone",
                value=seg_read_gbs,
                unit="GB/s",
                baseline="raw_read_cold",
                baseline_value=raw_read_gbs,
                note=f"{note}; the tier's segment files read whole, cold, one after another, "
                "no verification (what the file layout alone costs)",
            ),
            Row(
                name="raw_read_direct",
                value=raw_read_direct_gbs,
                unit="GB/s",
                baseline="raw_read_cold",
                baseline_value=raw_read_gbs,
                note=f"{note}; the raw file read with one O_DIRECT read: raw IO in the tier's IO "
                "mode, for comparison",
            ),
        ],
    )


if __name__ == "__main__":
    main()
