"""Aligned records (format 3): payloads of whole 512 B blocks start on a block boundary, so
direct reads land them straight in aligned caller buffers (pool slots) with no staging copy;
every check still holds on that path, and a failed page leaves no unverified byte behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.errors import CorruptPageError, PageNotFoundError
from tessera_ray.storage import _direct as D
from tessera_ray.storage import fsck
from tessera_ray.storage._format import (
    ALIGNED_HEAD_BYTES,
    BLOCK_BYTES,
    HEADER_BYTES,
    record_heads,
    scan_segment,
)

from .conftest import aligned_buffers, flip, open_disk, page, quarantined, run, segments

SIZE = 4096  # eight blocks: an aligned record of 512 + 4096 B
REC = ALIGNED_HEAD_BYTES + SIZE


def _aligned_outs(n: int) -> list[memoryview]:
    return aligned_buffers(n, SIZE)


def _heads(seg: Path) -> list[int]:
    fd = os.open(seg, os.O_RDONLY)
    try:
        items = scan_segment(fd, seg.stat().st_size)
    finally:
        os.close(fd)
    return [it.header.head_bytes for it in items if it.header is not None]


def test_record_heads_align_whole_block_payloads_only() -> None:
    assert record_heads([SIZE, SIZE]) == [ALIGNED_HEAD_BYTES, ALIGNED_HEAD_BYTES]
    # A compact record moves the next one off the block boundary: it stays compact too.
    assert record_heads([SIZE, 256, SIZE]) == [ALIGNED_HEAD_BYTES, HEADER_BYTES, HEADER_BYTES]
    assert record_heads([64, 64]) == [HEADER_BYTES, HEADER_BYTES]  # manifests: no padding


def test_aligned_segment_layout_reads_back_in_both_io_modes(
    tmp_path: Path, io_mode: bool | None
) -> None:
    root = tmp_path / "t"
    items = [page(i, size=SIZE) for i in range(5)]
    mixed = [page(10, size=SIZE), page(11, size=256), page(12, size=SIZE)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)
            await tier.put_many(mixed)
            every = items + mixed
            assert await tier.get_many([k for k, _ in every]) == [d for _, d in every]
            outs = _aligned_outs(len(every))
            sizes = await tier.get_many_into([k for k, _ in every], outs)
            assert sizes == [len(d) for _, d in every]
            assert [bytes(o[: len(d)]) for o, (_, d) in zip(outs, every, strict=True)] == [
                d for _, d in every
            ]

    run(body())
    by_size = sorted(segments(root), key=lambda p: p.stat().st_size)
    assert by_size[1].stat().st_size == 5 * REC
    assert _heads(by_size[1]) == [ALIGNED_HEAD_BYTES] * 5
    assert _heads(by_size[0]) == [ALIGNED_HEAD_BYTES, HEADER_BYTES, HEADER_BYTES]
    assert fsck(root).ok


class _StagingSpy:
    """Counts direct reads that went through a staging buffer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = D.read_direct

        def spy(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            return real(*args, **kw)

        monkeypatch.setattr(D, "read_direct", spy)


@pytest.mark.parametrize("refused", [False, True], ids=["zero-copy", "device-refuses"])
def test_aligned_buffers_are_read_without_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """Aligned records land straight in aligned buffers; an unaligned buffer takes the staging
    path. A device with 4 KiB logical blocks answers EINVAL to 512 B-aligned scatter reads
    (``refused``): the tier reads the same window through staging instead."""
    real = os.preadv

    def refusing(fd: int, bufs: list[Any], offset: int, *rest: Any) -> int:
        if len(bufs) > 2:  # only the scattered zero-copy read has more than two buffers
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *rest)

    items = [page(i, size=SIZE) for i in range(6)]

    async def body() -> None:
        async with open_disk(tmp_path / "t") as tier:
            if not tier.direct_io:
                pytest.skip("the test filesystem has no O_DIRECT")
            await tier.put_many(items)
            if refused:
                monkeypatch.setattr(os, "preadv", refusing)
            spy = _StagingSpy(monkeypatch)
            outs = _aligned_outs(len(items))
            assert await tier.get_many_into([k for k, _ in items], outs) == [SIZE] * 6
            assert [bytes(o) for o in outs] == [d for _, d in items]
            assert spy.calls == int(refused)  # one window: scattered, or staged once
            odd = bytearray(SIZE + 1)
            assert await tier.get_into(items[2][0], memoryview(odd)[1:]) == SIZE
            assert bytes(odd[1:]) == items[2][1]
            assert spy.calls == int(refused) + 1

    run(body())


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        (ALIGNED_HEAD_BYTES + 100, "record checksum mismatch"),  # payload byte
        (20, "header checksum mismatch"),  # header byte
    ],
    ids=["payload", "header"],
)
def test_corrupt_aligned_record_is_quarantined_and_zeroed_in_the_buffer(
    tmp_path: Path, io_mode: bool | None, where: int, reason: str
) -> None:
    root = tmp_path / "t"
    items = [page(i, size=SIZE) for i in range(4)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)
            flip(segments(root)[0], 2 * REC + where)
            outs = _aligned_outs(len(items))
            for o in outs:
                o[:] = b"\xaa" * SIZE
            with pytest.raises(CorruptPageError, match=reason):
                await tier.get_into(items[2][0], outs[2])
            assert bytes(outs[2]) == bytes(SIZE)  # the unverified bytes were wiped
            assert tier.stats.corrupt_total == 1
            got = await tier.get_many_into([k for k, _ in items], outs)
            assert got == [SIZE, SIZE, None, SIZE]  # dropped from the index: a miss now
            assert [bytes(outs[i]) for i in (0, 1, 3)] == [items[i][1] for i in (0, 1, 3)]
            with pytest.raises(PageNotFoundError):
                await tier.get(items[2][0])

    run(body())
    assert len(quarantined(root)) == 1
    assert fsck(root).ok  # the record was tombstoned; the rest check out


def test_truncated_segment_under_a_zero_copy_read(tmp_path: Path, io_mode: bool | None) -> None:
    root = tmp_path / "t"
    items = [page(i, size=SIZE) for i in range(3)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)
            os.truncate(segments(root)[0], 2 * REC + ALIGNED_HEAD_BYTES + BLOCK_BYTES)
            outs = _aligned_outs(len(items))
            got = await tier.get_many_into([k for k, _ in items], outs)
            assert got == [SIZE, SIZE, None]
            assert bytes(outs[2]) == bytes(SIZE)
            assert [bytes(outs[i]) for i in (0, 1)] == [items[0][1], items[1][1]]

    run(body())
    note = quarantined(root)[0].with_suffix(".json").read_text()
    assert "truncated" in note


def test_restart_rebuilds_aligned_records_and_tombstones_them(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = [page(i, size=SIZE) for i in range(5)]

    async def write() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)
            assert await tier.delete_many([items[1][0]]) == [True]

    async def reopen() -> None:
        async with open_disk(root) as tier:
            assert len(tier) == 4
            outs = _aligned_outs(4)
            keep = [items[i] for i in (0, 2, 3, 4)]
            assert await tier.get_many_into([k for k, _ in keep], outs) == [SIZE] * 4
            assert [bytes(o) for o in outs] == [d for _, d in keep]

    run(write())
    run(reopen())
    report = fsck(root)
    assert report.ok and report.records_ok == 4
