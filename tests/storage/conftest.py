"""Small pages and helpers for the storage tests (tiny pages keep the suite fast)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tessera_ray.core.hostmem import aligned_host_bytes
from tessera_ray.storage import DiskTier, content_hasher

FINGERPRINT = "0655f464e5f4c174303e81f0296dee31"  # deepseek-v3 mla-bf16 layout
NAMESPACE = "tests"
HASH = content_hasher(NAMESPACE, FINGERPRINT)
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def page(i: int, size: int = 256) -> tuple[bytes, bytes]:
    """A deterministic page and its content hash."""
    data = (i.to_bytes(8, "little") * (size // 8 + 1))[:size]
    data = bytes((b + i * 7 + j) & 0xFF for j, b in enumerate(data))
    return HASH(memoryview(data)), data


def aligned_buffers(n: int, size: int) -> list[memoryview]:
    """``n`` page-aligned buffers of ``size`` bytes, slices of one mapping (as the slots of a
    pool are): what direct reads fill without a staging copy."""
    arena = aligned_host_bytes(n * size)
    return [arena[i * size : (i + 1) * size] for i in range(n)]


_IO_MODE: list[bool | None] = [None]  # direct_io of tiers that open_disk opens (see io_mode)


def open_disk(root: Path, capacity_bytes: int = 1 << 30, **kw: Any) -> DiskTier:
    kw.setdefault("direct_io", _IO_MODE[0])
    return DiskTier(root, capacity_bytes, fingerprint=FINGERPRINT, namespace=NAMESPACE, **kw)


@pytest.fixture(params=[None, False], ids=["direct", "buffered"])
def io_mode(request: pytest.FixtureRequest) -> Iterator[bool | None]:
    """Runs a test once with the tier's default IO (direct where the filesystem has it, as
    on the test machines' ext4) and once buffered, the fallback: both read paths meet every
    fault."""
    _IO_MODE[0] = request.param
    try:
        yield request.param
    finally:
        _IO_MODE[0] = None


def segments(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.seg"))


def quarantined(root: Path) -> list[Path]:
    return sorted((root / "quarantine").glob("*.rec"))


@pytest.fixture
def disk_factory(tmp_path: Path) -> Callable[..., DiskTier]:
    def make(**kw: Any) -> DiskTier:
        return open_disk(tmp_path / "tier", **kw)

    return make


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
