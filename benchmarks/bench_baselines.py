"""Physical limits of this machine, measured in the run: memcpy, xxh3-128, file write and read.

Every tier benchmark compares against these in its own run; this one records them on their own
so BENCHMARKS.md shows what the machine can do. Rows: memcpy (GB/s), xxh3-128 over cold
memory (GB/s, ratio to memcpy), file write + fsync (GB/s), cold file read after dropping the
file's pages from the page cache (GB/s).
"""

from __future__ import annotations

import os
import tempfile

import torch
import xxhash
from common import Row, parse_args, time_median, write_result

GB = 1e9


def _cold_buffers(total_bytes: int, buffer_bytes: int) -> list[torch.Tensor]:
    """Several buffers larger than the caches together, used round robin so reads stay cold."""
    count = max(2, total_bytes // buffer_bytes)
    return [torch.randint(0, 256, (buffer_bytes,), dtype=torch.uint8) for _ in range(count)]


def main() -> None:
    args = parse_args("baselines")
    buffer_bytes = (16 if args.quick else 64) << 20
    repeat = 5 if args.quick else 15
    bufs = _cold_buffers((128 if args.quick else 512) << 20, buffer_bytes)
    dst = torch.empty(buffer_bytes, dtype=torch.uint8)
    turn = iter(range(1 << 30))

    def copy() -> None:
        dst.copy_(bufs[next(turn) % len(bufs)])

    def hash_() -> None:
        xxhash.xxh3_128_digest(memoryview(bufs[next(turn) % len(bufs)].numpy()))

    memcpy_gbs = buffer_bytes / time_median(copy, repeat=repeat) / GB
    xxh3_gbs = buffer_bytes / time_median(hash_, repeat=repeat) / GB

    payload = bufs[0].numpy().tobytes()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TESSERA_BENCH_DIR")) as root:
        path = os.path.join(root, "blob")

        def write() -> None:
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        def cold_read() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                with os.fdopen(os.dup(fd), "rb") as f:
                    f.readinto(memoryview(bytearray(buffer_bytes)))
            finally:
                os.close(fd)

        write_gbs = buffer_bytes / time_median(write, repeat=max(3, repeat // 3)) / GB
        read_gbs = buffer_bytes / time_median(cold_read, repeat=max(3, repeat // 3)) / GB

    size = f"{buffer_bytes >> 20} MiB buffers"
    write_result(
        "baselines",
        args,
        [
            Row(name="memcpy", value=memcpy_gbs, unit="GB/s", note=size),
            Row(
                name="xxh3_128",
                value=xxh3_gbs,
                unit="GB/s",
                baseline="memcpy",
                baseline_value=memcpy_gbs,
                note=size,
            ),
            Row(
                name="file_write_fsync",
                value=write_gbs,
                unit="GB/s",
                baseline="memcpy",
                baseline_value=memcpy_gbs,
                note=size,
            ),
            Row(
                name="file_read_cold",
                value=read_gbs,
                unit="GB/s",
                baseline="memcpy",
                baseline_value=memcpy_gbs,
                note=size,
            ),
        ],
    )


if __name__ == "__main__":
    main()
