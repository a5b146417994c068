"""Host pools in a shared-memory file (``PoolConfig.shared_memory_dir``): the slab is made,
reserved and locked at start, mapped read-only by readers, swept when its owner died, and a
directory that is missing or too small fails the pool's start with one clear line."""

from __future__ import annotations

import errno
import gc
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.core import shm as shm_module
from tessera_ray.core.shm import SlabInfo, SlabMapping, shared_host_zeros, slab_of, sweep_dead_slabs
from tessera_ray.errors import PeerMappingError, PoolConfigError, PoolMemoryError

from .conftest import tiny_spec

PAGE = 4096
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh directory on the machine's tmpfs (where pool slabs live in production)."""
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.skip("no /dev/shm here")
    path = base / f"tessera-test-{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir()
    yield path
    for p in path.iterdir():
        p.unlink()
    path.rmdir()


def _pool(directory: Path | None, num_pages: int = 8) -> BlockPool:
    config = PoolConfig(
        num_pages=num_pages,
        shared_memory_dir=None if directory is None else str(directory),
        pin_memory=False,
    )
    return BlockPool(tiny_spec(PAGE), config, fingerprint="shm-test")


def test_pool_pages_live_in_a_locked_owner_only_slab(shm_dir: Path) -> None:
    pool = _pool(shm_dir)
    info = slab_of(pool.data)
    assert info is not None and slab_of(_pool(None).data) is None
    (path,) = shm_dir.iterdir()
    assert str(path) == info.path and path.name == f"tessera-{os.getpid()}-{info.token}.slab"
    assert (info.num_pages, info.page_bytes, info.nbytes) == (8, PAGE, 8 * PAGE)
    st = path.stat()
    assert st.st_size == 8 * PAGE and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_blocks * 512 >= 8 * PAGE  # reserved at start, not on first touch
    assert pool.data.data_ptr() % 4096 == 0 and bool((pool.data == 0).all())
    # A page written through the pool is what a reader's mapping sees, read-only.
    h = pool.allocate()
    pool.write(h, torch.arange(PAGE, dtype=torch.int64).to(torch.uint8))
    mapping = SlabMapping(info)
    slot = int(pool.slot(h))
    assert bytes(mapping.page(slot)) == pool.read_bytes(h)
    assert mapping.page(slot).readonly
    assert mapping.owner_alive()
    # The pool goes: its file is unlinked and its lock dropped; the reader's mapping stays
    # valid (no fault) until it closes it, and says the owner is gone.
    del pool, h
    gc.collect()
    assert list(shm_dir.iterdir()) == []
    assert not mapping.owner_alive()
    assert len(bytes(mapping.page(slot))) == PAGE
    mapping.close()
    assert mapping.closed and not mapping.owner_alive()
    with pytest.raises(PeerMappingError, match="closed"):
        mapping.page(0)


def test_missing_directory_fails_the_start_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(PoolConfigError, match=r"no-such-dir.*shared_memory_dir=None") as err:
        _pool(missing)
    assert "\n" not in str(err.value)
    with pytest.raises(PoolConfigError, match="cpu pools only"):
        PoolConfig(num_pages=1, device="cuda", shared_memory_dir="/dev/shm")
    with pytest.raises(PoolConfigError, match="directory path"):
        PoolConfig(num_pages=1, shared_memory_dir="")
    assert PoolConfig(num_pages=1, shared_memory_dir=tmp_path).shared_memory_dir == str(tmp_path)


def test_a_directory_too_small_fails_the_start_and_leaves_nothing(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    pages = free // PAGE + 1
    with pytest.raises(PoolMemoryError, match=f"{shm_dir}.*{pages * PAGE:,} B") as err:
        shared_host_zeros(str(shm_dir), pages, PAGE)
    assert "\n" not in str(err.value)
    assert list(shm_dir.iterdir()) == []

    # A directory that filled up after the check: the reservation itself fails, at start.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_module.os, "posix_fallocate", full)
    with pytest.raises(PoolMemoryError, match=r"reserving it failed.*--shm-size"):
        _pool(shm_dir)
    assert list(shm_dir.iterdir()) == []


def test_start_sweeps_slabs_of_dead_owners_only(shm_dir: Path) -> None:
    # A pool process killed outright leaves its slab behind.
    code = (
        "import os, signal, sys; sys.path.insert(0, sys.argv[2]);"
        "from tessera_ray.core.shm import shared_host_zeros;"
        "t = shared_host_zeros(sys.argv[1], 4, 4096); t.fill_(7);"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code, str(shm_dir), str(ROOT)], check=False)
    (dead,) = shm_dir.iterdir()
    assert dead.name.endswith(".slab") and dead.stat().st_size == 4 * 4096
    other = shm_dir / "not-a-slab.slab"
    other.write_bytes(b"x")
    live = _pool(shm_dir)  # its start sweeps the dead owner's file
    info = slab_of(live.data)
    assert info is not None
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted(
        ["not-a-slab.slab", Path(info.path).name]
    )
    assert sweep_dead_slabs(str(shm_dir)) == 0  # a live owner's slab is never swept
    assert Path(info.path).exists()
    other.unlink()


def test_a_reader_refuses_what_it_cannot_map(shm_dir: Path) -> None:
    pool = _pool(shm_dir)
    info = slab_of(pool.data)
    assert info is not None
    absent = SlabInfo(
        path=str(shm_dir / "tessera-1-absent.slab"),
        nbytes=info.nbytes,
        token="0" * 32,
        num_pages=info.num_pages,
        page_bytes=info.page_bytes,
    )
    with pytest.raises(PeerMappingError, match="cannot open"):
        SlabMapping(absent)
    bigger = SlabInfo(**{**info.__dict__, "num_pages": 16, "nbytes": 16 * PAGE})
    with pytest.raises(PeerMappingError, match="holds"):
        SlabMapping(bigger)
    odd = SlabInfo(**{**info.__dict__, "nbytes": info.nbytes + 1})
    with pytest.raises(PeerMappingError, match="inconsistent"):
        SlabMapping(odd)
    if os.geteuid() != 0:  # root opens anything
        os.chmod(info.path, 0)
        try:
            with pytest.raises(PeerMappingError, match="ermission"):
                SlabMapping(info)
        finally:
            os.chmod(info.path, 0o600)


def test_a_shared_pool_works_as_a_private_one(shm_dir: Path) -> None:
    """Seal, dedup, evict and scrub on a slab, byte for byte as on private memory."""
    shared, private = _pool(shm_dir), _pool(None)
    data = torch.randint(0, 256, (6, PAGE), dtype=torch.uint8, generator=torch.Generator())
    data[3] = data[1]
    for pool in (shared, private):
        handles = pool.write_many(pool.allocate_many(6), data)
        sealed = pool.seal_many(handles, "ns")
        assert [r.deduplicated for r in sealed] == [False, False, False, True, False, False]
        pool.release_many([r.handle for r in sealed])
        pool.check_consistency()
    assert torch.equal(shared.data, private.data)
    assert shared.stats().pages_sealed == private.stats().pages_sealed == 5
