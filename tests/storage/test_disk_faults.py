"""Fault injection: each fault gives the right error, quarantines the corrupt record, and
leaves every other page readable (now and after a restart)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tessera_ray.errors import (
    CorruptPageError,
    DiskFullError,
    InvalidKeyError,
    LayoutMismatchError,
    PageNotFoundError,
    ReadOnlyStorageError,
    StorageError,
    StorageLockedError,
)
from tessera_ray.storage import DiskTier, _io, fsck
from tessera_ray.storage._files import fingerprint_bytes
from tessera_ray.storage._format import HEADER_BYTES, pack_header

from .conftest import FINGERPRINT, HASH, flip, open_disk, page, quarantined, run, segments

pytestmark = pytest.mark.usefixtures("io_mode")

PAGES = 6
REC = HEADER_BYTES + 256


def _fill(root: Path) -> list[tuple[bytes, bytes]]:
    """One segment of PAGES records (one batch), returned in file order."""
    items = [page(i) for i in range(PAGES)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)

    run(body())
    return items


def _assert_fault(
    root: Path,
    items: list[tuple[bytes, bytes]],
    bad: int,
    reason: str,
    fault: Callable[[Path], None],
    error: type = CorruptPageError,
) -> None:
    """Inject ``fault`` into the segment under an open tier, then read everything."""

    async def body() -> None:
        async with open_disk(root) as tier:
            fault(segments(root)[0])
            with pytest.raises(error) as info:
                await tier.get(items[bad][0])
            if error is CorruptPageError:
                assert reason in str(info.value)
                assert tier.stats.corrupt_total == 1
                # never served, not even on a second try or in a batch
                assert await tier.get_many([items[bad][0]]) == [None]
            for i, (k, d) in enumerate(items):
                if i != bad:
                    assert await tier.get(k) == d

    run(body())
    if error is CorruptPageError:
        notes = [json.loads(p.with_suffix(".json").read_text()) for p in quarantined(root)]
        assert [n["content_hash"] for n in notes] == [items[bad][0].hex()]
        assert reason in notes[0]["reason"]

    async def reopened() -> None:  # after a restart: still not served, the rest intact
        async with open_disk(root) as tier:
            assert not await tier.contains(items[bad][0])
            assert await tier.get_many([k for k, _ in items]) == [
                None if i == bad else d for i, (_, d) in enumerate(items)
            ]

    run(reopened())
    assert fsck(root).ok


def test_flipped_payload_byte(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    _assert_fault(
        root, items, 2, "record checksum mismatch", lambda s: flip(s, 2 * REC + HEADER_BYTES + 9)
    )


def test_flipped_header_byte(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    # byte 40 lies in the content-hash field of the header
    _assert_fault(root, items, 3, "header checksum mismatch", lambda s: flip(s, 3 * REC + 40))


def test_wrong_magic(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    _assert_fault(root, items, 1, "bad magic", lambda s: flip(s, 1 * REC))


def test_truncated_file(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    # the last record loses most of its payload
    _assert_fault(root, items, 5, "truncated", lambda s: os.truncate(s, 5 * REC + 100))


def test_wrong_layout_fingerprint(tmp_path: Path) -> None:
    """A well-formed record (valid checksums) written for another layout is never served."""
    root = tmp_path / "t"
    items = _fill(root)
    key, data = items[4]
    forged = pack_header(fingerprint_bytes("another-layout"), key, len(data), key)

    def fault(seg: Path) -> None:
        with open(seg, "r+b") as f:
            f.seek(4 * REC)
            f.write(forged)

    _assert_fault(root, items, 4, "layout fingerprint mismatch", fault)


def test_wrong_fingerprint_found_at_restart(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    key, data = items[0]
    forged = pack_header(fingerprint_bytes("another-layout"), key, len(data), key)
    with open(segments(root)[0], "r+b") as f:
        f.write(forged)
    assert [p.reason for p in fsck(root).problems] == ["layout fingerprint mismatch"]

    async def body() -> None:
        async with open_disk(root) as tier:
            assert tier.stats.corrupt_total == 1
            assert await tier.get_many([k for k, _ in items]) == [None] + [d for _, d in items[1:]]

    run(body())
    assert fsck(root).ok


def test_corruption_found_at_restart_is_quarantined(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    flip(segments(root)[0], 0 * REC + 20)  # header of record 0: the scan cannot trust it

    async def body() -> None:
        async with open_disk(root) as tier:
            assert tier.stats.corrupt_total == 1
            assert not await tier.contains(items[0][0])
            with pytest.raises(PageNotFoundError):
                await tier.get(items[0][0])
            for k, d in items[1:]:
                assert await tier.get(k) == d

    run(body())
    assert len(quarantined(root)) == 1
    assert fsck(root).ok


def test_zero_length_file(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    other = [page(100 + i) for i in range(3)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(other)  # a second segment
            seg0 = next(s for s in segments(root) if os.path.getsize(s) == PAGES * REC)
            os.truncate(seg0, 0)  # the first segment loses everything under a live tier
            with pytest.raises(CorruptPageError, match="truncated"):
                await tier.get(items[0][0])
            assert await tier.get_many([k for k, _ in items]) == [None] * PAGES
            for k, d in other:
                assert await tier.get(k) == d
            assert tier.stats.corrupt_total == PAGES
            assert not seg0.exists()  # no live record left: the file is gone

    run(body())
    assert len(quarantined(root)) == PAGES


def test_zero_length_segment_at_restart(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    empty = root / "segments" / ("f" * 32 + ".seg")
    empty.touch()
    report = fsck(root)
    assert [p.kind for p in report.problems] == ["empty"]

    async def body() -> None:
        async with open_disk(root) as tier:
            assert await tier.get_many([k for k, _ in items]) == [d for _, d in items]

    run(body())
    assert not empty.exists() and fsck(root).ok


def test_partial_left_by_killed_writer(tmp_path: Path) -> None:
    root = tmp_path / "t"
    items = _fill(root)
    seg = segments(root)[0]
    partial = root / "segments" / ("e" * 32 + ".seg.partial")
    partial.write_bytes(seg.read_bytes()[: REC + 10])
    report = fsck(root)
    assert [p.kind for p in report.problems] == ["partial"] and not report.ok

    async def body() -> None:
        async with open_disk(root) as tier:
            assert tier.stats.partials_cleaned == 1
            assert await tier.get_many([k for k, _ in items]) == [d for _, d in items]

    run(body())
    assert not partial.exists()
    assert fsck(root).ok


class _FullDiskTier(DiskTier):
    """Test-only: the filesystem fills after ``room`` more bytes (a real OSError(ENOSPC))."""

    room = 10_000

    def _write_segment(
        self, name: str, items: list[tuple[bytes, memoryview]], digests: list[bytes]
    ) -> int:
        need = sum(HEADER_BYTES + v.nbytes for _, v in items)
        if need > self.room:
            partial = self._seg_dir / (name + ".partial")
            partial.write_bytes(b"\0" * self.room)  # what a real writer leaves before ENOSPC
            partial.unlink()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= need
        return super()._write_segment(name, items, digests)


def _check_enospc(tier: DiskTier, stored: list[tuple[bytes, bytes]]) -> None:
    async def body() -> None:
        await tier.put_many(stored)
        big = [page(500 + i, size=4096) for i in range(400)]
        with pytest.raises(DiskFullError) as info:
            await tier.put_many(big)
        assert info.value.errno == errno.ENOSPC
        assert isinstance(info.value, OSError) and "no space" in str(info.value)
        for k, d in stored:
            assert await tier.get(k) == d
        assert not any(await tier.contains_many([k for k, _ in big]))
        assert not list((tier.config.root / "segments").glob("*.partial"))
        await tier.close()

    run(body())


def test_enospc_injected(tmp_path: Path) -> None:
    tier = _FullDiskTier(tmp_path / "t", 1 << 30, fingerprint=FINGERPRINT, namespace="tests")
    _check_enospc(tier, [page(i) for i in range(5)])


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode:
        pytest.skip(f"cannot mount tmpfs: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_real_tmpfs(tmpfs: Path) -> None:
    """A 1 MiB tmpfs really fills: the real error path of DiskTier, with capacity far above."""
    tier = open_disk(tmpfs / "t", 1 << 30)
    _check_enospc(tier, [page(i) for i in range(5)])
    tier2 = open_disk(tmpfs / "t")  # and a reopen still sees every stored page
    run(tier2.close())


def test_read_only_root(tmpfs: Path) -> None:
    root = tmpfs / "t"
    items = _fill(root)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:

        async def body() -> None:
            async with open_disk(root) as tier:
                for k, d in items:
                    assert await tier.get(k) == d
                with pytest.raises(ReadOnlyStorageError) as info:
                    await tier.put(*page(77))
                assert info.value.errno == errno.EROFS
                assert isinstance(info.value, StorageError)
                assert not await tier.contains(page(77)[0])
                assert await tier.get_many([k for k, _ in items]) == [d for _, d in items]

        run(body())
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)


def test_layout_mismatch_and_lock(tmp_path: Path) -> None:
    root = tmp_path / "t"
    _fill(root)
    with pytest.raises(LayoutMismatchError, match="holds layout"):
        DiskTier(root, 1 << 20, fingerprint="f" * 32, namespace="tests")
    tier = open_disk(root)
    with pytest.raises(StorageLockedError):
        open_disk(root)
    run(tier.close())


def test_capacity_respected_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "t"

    async def body() -> None:
        async with open_disk(root, capacity_bytes=10 * REC) as tier:
            for i in range(40):
                await tier.put_many([page(2 * i), page(2 * i + 1)])
                on_disk = sum(p.stat().st_size for p in segments(root))
                assert on_disk == tier.used_bytes <= 10 * REC
            assert len(tier) == 10 and tier.stats.evicted_pages_total == 70
            assert await tier.get(page(79)[0]) == page(79)[1]

    run(body())


@pytest.mark.parametrize("capacity_pages", [100, PAGES + 2])
def test_a_payload_that_does_not_hash_to_its_key_writes_nothing(
    tmp_path: Path, capacity_pages: int
) -> None:
    """A well-formed key whose payload hashes elsewhere fails the whole batch before anything
    is stored or evicted (with room enough, and on a full tier that would have to evict).
    Nothing is left behind and capacity accounting is unchanged, so the same tier takes the
    good pages next."""
    root = tmp_path / "disk"
    stored = _fill(root)
    good = [page(i) for i in range(PAGES, PAGES + 3)]
    lying = (page(99)[0], good[1][1])  # good bytes under another page's hash

    async def body() -> None:
        async with open_disk(root, capacity_bytes=capacity_pages * REC) as tier:
            before = (tier.stats.used_bytes, len(tier), segments(root))
            with pytest.raises(InvalidKeyError, match="does not hash to its key"):
                await tier.put_many([good[0], lying, good[2]])
            assert (tier.stats.used_bytes, len(tier), segments(root)) == before
            assert not list((root / "segments").glob("*.partial"))
            assert [await tier.get(k) for k, _ in stored] == [d for _, d in stored]
            await tier.put_many(good)
            assert [await tier.get(k) for k, _ in good] == [d for _, d in good]

    run(body())


def test_prehashed_skips_the_write_hash_but_reads_still_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prehashed`` trusts the caller's keys on the way in (no payload is hashed while
    writing); a false claim is stored but caught by the read, quarantined, never served."""
    root = tmp_path / "t"
    good = [page(i) for i in range(3)]
    lying = (page(99)[0], good[1][1])  # good bytes under another page's hash

    def no_hashing(*args: object) -> None:
        raise AssertionError("a prehashed write hashed the payloads")

    async def body() -> None:
        async with open_disk(root) as tier:
            monkeypatch.setattr(_io, "digest_batch", no_hashing)
            await tier.put_many([*good, lying], prehashed=True)
            monkeypatch.undo()
            assert [await tier.get(k) for k, _ in good] == [d for _, d in good]
            with pytest.raises(CorruptPageError, match="record checksum mismatch"):
                await tier.get(lying[0])
            assert tier.stats.corrupt_total == 1
            assert await tier.contains_many([lying[0]]) == [False]

    run(body())
    assert len(quarantined(root)) == 1
    assert fsck(root).ok  # the bad record was quarantined and cut out of its segment


def test_prehashed_is_ignored_by_a_root_with_its_own_key_function(tmp_path: Path) -> None:
    def key_of(view: memoryview) -> bytes:
        return HASH(view)[::-1]

    async def body() -> None:
        async with open_disk(tmp_path / "t", hasher=key_of) as tier:
            key, data = page(1)
            with pytest.raises(InvalidKeyError, match="does not hash to its key"):
                await tier.put_many([(key, data)], prehashed=True)
            await tier.put_many([(key_of(memoryview(data)), data)], prehashed=True)
            assert await tier.get(key_of(memoryview(data))) == data

    run(body())
