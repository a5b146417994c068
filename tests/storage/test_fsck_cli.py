"""``tessera-ray fsck ROOT [--repair]``: reports, repairs, exit codes, progress."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tessera_ray.cli import main
from tessera_ray.storage import fsck
from tessera_ray.storage._format import HEADER_BYTES
from tessera_ray.storage._progress import Progress

from .conftest import flip, open_disk, page, quarantined, run, segments

REC = HEADER_BYTES + 256


def _root(tmp_path: Path) -> tuple[Path, list[tuple[bytes, bytes]]]:
    root = tmp_path / "t"
    items = [page(i) for i in range(4)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)

    run(body())
    return root, items


def test_clean_root_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = _root(tmp_path)
    assert main(["fsck", str(root)]) == 0
    assert "4 records ok" in capsys.readouterr().out


def test_problems_reported_then_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, items = _root(tmp_path)
    seg = segments(root)[0]
    flip(seg, 1 * REC + HEADER_BYTES + 5)  # payload of record 1
    (root / "segments" / "notes.txt").write_text("not ours")  # orphan
    (root / "segments" / ("a" * 32 + ".seg.partial")).write_bytes(b"x" * 10)

    assert main(["fsck", str(root)]) == 1
    out = capsys.readouterr().out
    assert "record checksum mismatch" in out and "1 corrupt, 1 partial, 1 orphan" in out
    assert quarantined(root) == []  # without --repair nothing moves

    assert main(["fsck", str(root), "--repair"]) == 1  # it found problems, and says so
    assert len(quarantined(root)) == 2  # the record and the orphan
    assert main(["fsck", str(root)]) == 0

    async def body() -> None:
        async with open_disk(root) as tier:
            got = await tier.get_many([k for k, _ in items])
            assert got == [items[0][1], None, items[2][1], items[3][1]]

    run(body())


def test_not_a_root_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fsck", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a tessera-ray disk tier root" in err


def test_repair_refuses_a_root_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = _root(tmp_path)
    tier = open_disk(root)
    try:
        assert main(["fsck", str(root), "--repair"]) == 2
        assert "before fsck --repair" in capsys.readouterr().err
    finally:
        run(tier.close())


def test_progress_shown_on_request(tmp_path: Path) -> None:
    root, _ = _root(tmp_path)
    buf = io.StringIO()
    bar = Progress("x", 3, enabled=True, stream=buf)
    for _ in range(3):
        bar.advance()
    bar.close()
    assert "3/3 (100.0%)" in buf.getvalue()
    assert not Progress.wanted(5, min_items=10)
    assert Progress.wanted(5, min_items=10, force=True)
    assert fsck(root, progress=False).ok
