"""Direct (``O_DIRECT``) segment IO: chosen where the filesystem has it, aligned writes cut
back to the true length, windowed reads, and no unverified byte in a caller's buffer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_ray.errors import CorruptPageError, StorageConfigError
from tessera_ray.storage import _direct as D
from tessera_ray.storage import fsck
from tessera_ray.storage._format import HEADER_BYTES

from .conftest import flip, open_disk, page, run, segments


def test_direct_chosen_where_supported_and_files_have_true_length(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = [page(i, size=1000) for i in range(7)]  # 7 x 1,072 B: not a multiple of 4096

    async def body() -> None:
        async with open_disk(root) as tier:
            assert tier.direct_io is D.direct_supported(root / "TESSERA_TIER.json")
            await tier.put_many(items)

    run(body())
    (seg,) = segments(root)
    assert seg.stat().st_size == 7 * (HEADER_BYTES + 1000)  # the padding was cut off
    assert fsck(root).ok


def test_direct_required_on_a_filesystem_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(D, "direct_supported", lambda path: False)
    with pytest.raises(StorageConfigError, match="O_DIRECT"):
        open_disk(tmp_path / "a", direct_io=True)

    async def body() -> None:  # auto falls back to buffered IO, and works
        async with open_disk(tmp_path / "b") as tier:
            assert not tier.direct_io
            key, data = page(1)
            await tier.put_many([(key, data)])
            assert await tier.get(key) == data

    run(body())


@pytest.mark.parametrize("bad", ["x", 1])
def test_direct_io_setting_validated(tmp_path: Path, bad: object) -> None:
    with pytest.raises(StorageConfigError, match="direct_io"):
        open_disk(tmp_path / "t", direct_io=bad)


def test_windows_gaps_and_records_larger_than_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a 16 KiB staging buffer a 40-page batch streams through many aligned writes and
    reads back in many windows; a record larger than the buffer gets its own; a sparse read
    skips the gap between far-apart records."""
    monkeypatch.setattr(D, "STAGING_BYTES", 16384)
    monkeypatch.setattr("tessera_ray.storage._io._WINDOW_GAP_BYTES", 8192)
    root = tmp_path / "t"
    items = [page(i, size=3000) for i in range(40)] + [page(99, size=40_000)]

    async def body() -> None:
        async with open_disk(root) as tier:
            if not tier.direct_io:
                pytest.skip("the test filesystem has no O_DIRECT")
            await tier.put_many(items)
            assert await tier.get_many([k for k, _ in items]) == [d for _, d in items]
            sparse = [0, 1, 39, 40]  # two windows far apart, then the oversized record
            outs = [bytearray(40_000) for _ in sparse]
            sizes = await tier.get_many_into([items[i][0] for i in sparse], outs)
            assert sizes == [len(items[i][1]) for i in sparse]
            for o, i in zip(outs, sparse, strict=True):
                assert bytes(o[: len(items[i][1])]) == items[i][1]

    run(body())
    assert fsck(root).ok


def test_corrupt_record_never_reaches_the_callers_buffer(tmp_path: Path) -> None:
    """Compact records (256 B payloads) are read into staging and verified there: a record
    failing its checksum leaves the caller's buffer as it was. (Zero-copy reads of aligned
    records, and buffered reads, land first and zero the buffer on a failure:
    test_disk_aligned.py.)"""
    root = tmp_path / "t"
    items = [page(i) for i in range(3)]

    async def body() -> None:
        async with open_disk(root) as tier:
            if not tier.direct_io:
                pytest.skip("the test filesystem has no O_DIRECT")
            await tier.put_many(items)
            flip(segments(root)[0], (HEADER_BYTES + 256) + HEADER_BYTES + 5)  # page 1's payload
            out = bytearray(b"\xaa" * 256)
            with pytest.raises(CorruptPageError, match="record checksum mismatch"):
                await tier.get_into(items[1][0], out)
            assert out == b"\xaa" * 256
            assert await tier.get(items[2][0]) == items[2][1]

    run(body())
