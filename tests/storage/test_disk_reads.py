"""The verified read path the benchmark takes (``get_many_into``: header and payload in one
read, straight into the caller's buffers) and the one-pass record checksum: every fault is
caught there too, and the checksum still covers payloads of roots with a custom key function."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tessera_ray.errors import LayoutMismatchError
from tessera_ray.storage import fsck
from tessera_ray.storage._files import META_NAME
from tessera_ray.storage._format import ALIGNED_HEAD_BYTES, HEADER_BYTES

from .conftest import aligned_buffers, flip, open_disk, page, quarantined, run, segments

pytestmark = pytest.mark.usefixtures("io_mode")

PAGES = 6
REC = HEADER_BYTES + 256

# Each fault: (which page, the reason, how to inject it given the record span and where the
# payload starts in a record).
_FAULTS: dict[str, tuple[int, str, Callable[[Path, int, int], None]]] = {
    "payload": (2, "record checksum mismatch", lambda s, rec, head: flip(s, 2 * rec + head + 9)),
    "payload_last_byte": (1, "record checksum mismatch", lambda s, rec, head: flip(s, 2 * rec - 1)),
    "header": (3, "header checksum mismatch", lambda s, rec, head: flip(s, 3 * rec + 40)),
    "record_check_field": (
        0,
        "record checksum mismatch",
        lambda s, rec, head: flip(s, HEADER_BYTES - 3),
    ),
    "magic": (4, "bad magic", lambda s, rec, head: flip(s, 4 * rec)),
    "truncated": (5, "truncated", lambda s, rec, head: os.truncate(s, 5 * rec + 100)),
}

# Compact records (256 B pages) read into plain buffers; aligned records (4,096 B pages, whole
# blocks) read into page-aligned buffers, straight from the file when IO is direct.
_SHAPES = {"compact": (256, HEADER_BYTES), "aligned": (4096, ALIGNED_HEAD_BYTES)}


def _outs(n: int, size: int, aligned: bool) -> list[memoryview]:
    if aligned:
        return aligned_buffers(n, size)
    return [memoryview(bytearray(size)) for _ in range(n)]


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("fault", sorted(_FAULTS))
def test_batch_read_into_buffers_catches_each_fault(tmp_path: Path, fault: str, shape: str) -> None:
    bad, reason, inject = _FAULTS[fault]
    size, head = _SHAPES[shape]
    root = tmp_path / "t"
    items = [page(i, size=size) for i in range(PAGES)]

    async def body() -> None:
        async with open_disk(root) as tier:
            await tier.put_many(items)
            inject(segments(root)[0], head + size, head)
            outs = _outs(PAGES, size, shape == "aligned")
            sizes = await tier.get_many_into([k for k, _ in items], outs)
            assert sizes == [None if i == bad else size for i in range(PAGES)]
            for i, (_, data) in enumerate(items):
                if i != bad:
                    assert bytes(outs[i]) == data
            assert tier.stats.corrupt_total == 1
            # quarantined: a second batch read does not even try it
            assert await tier.get_many_into([items[bad][0]], _outs(1, size, False)) == [None]

    run(body())
    notes = [json.loads(p.with_suffix(".json").read_text()) for p in quarantined(root)]
    assert [n["content_hash"] for n in notes] == [items[bad][0].hex()]
    assert reason in notes[0]["reason"]
    assert fsck(root).ok


def test_records_read_in_file_order_whatever_the_request_order(tmp_path: Path) -> None:
    items = [page(i) for i in range(PAGES)]

    async def body() -> None:
        async with open_disk(tmp_path / "t") as tier:
            await tier.put_many(items)
            order = [4, 0, 5, 2, 2, 1]  # shuffled, one key twice
            outs = [bytearray(300) for _ in order]  # larger than a page: only 256 B filled
            sizes = await tier.get_many_into([items[i][0] for i in order], outs)
            assert sizes == [256] * len(order)
            assert [bytes(o[:256]) for o in outs] == [items[i][1] for i in order]

    run(body())


def test_custom_key_function_hashes_each_payload_once_more(tmp_path: Path) -> None:
    """The default digest is the key, so it alone proves a page (one pass); a custom key
    function adds exactly one call per page, on writes and on reads."""
    calls = 0

    def prefix_key(data: memoryview) -> bytes:
        nonlocal calls
        calls += 1
        return bytes(data[:16])

    items = [(data[:16], data) for _, data in (page(i) for i in range(PAGES))]

    async def body() -> None:
        nonlocal calls
        async with open_disk(tmp_path / "t", hasher=prefix_key) as tier:
            await tier.put_many(items)
            assert calls == PAGES
            calls = 0
            outs = [bytearray(256) for _ in items]
            assert await tier.get_many_into([k for k, _ in items], outs) == [256] * PAGES
            assert calls == PAGES
            assert [bytes(o) for o in outs] == [d for _, d in items]

    run(body())


def test_fsck_checks_payloads_of_custom_key_roots(tmp_path: Path) -> None:
    """The record checksum covers the payload through the root's own digest, so fsck still
    finds a flipped payload byte where it cannot check the keys."""
    root = tmp_path / "t"
    items = [(data[:16], data) for _, data in (page(i) for i in range(PAGES))]

    async def body() -> None:
        async with open_disk(root, hasher=lambda d: bytes(d[:16])) as tier:
            await tier.put_many(items)

    run(body())
    assert fsck(root).ok
    flip(segments(root)[0], 3 * REC + HEADER_BYTES + 100)
    report = fsck(root)
    assert not report.content_hash_checked
    assert [(p.kind, p.offset, p.reason) for p in report.problems] == [
        ("corrupt", 3 * REC, "record checksum mismatch")
    ]


def test_root_of_format_version_1_is_refused(tmp_path: Path) -> None:
    """Version 1 checksummed payload bytes directly; its records would all fail here, so the
    root is refused as a whole instead of being quarantined record by record."""
    root = tmp_path / "t"
    run(open_disk(root).close())
    meta = json.loads((root / META_NAME).read_text())
    (root / META_NAME).write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(LayoutMismatchError, match="format version 1"):
        open_disk(root)
