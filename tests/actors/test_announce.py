"""A pool's announcement on its node: only its user can read the secret, a reader never sees half
a file, a dead pool's file is skipped, and namespaces cannot escape the run directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_ray.actors.announce import RUN_DIR_ENV, PoolAnnouncement, announce, announced, run_dir
from tessera_ray.actors.channel import ChannelAddress


@pytest.fixture(autouse=True)
def _run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def _entry(pool: str, pid: int, *, namespace: str = "ns", port: int = 4000) -> PoolAnnouncement:
    return PoolAnnouncement(
        namespace, pool, "node-1", ChannelAddress("127.0.0.1", port, os.urandom(32)), pid
    )


def test_an_announcement_is_read_back_whole_and_only_its_user_can_read_it() -> None:
    entry = _entry("pool-a", os.getpid())
    path = announce(entry)
    assert announced("ns") == [entry]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "a temp file stayed"


def test_a_new_process_of_the_pool_replaces_its_announcement() -> None:
    announce(_entry("pool-a", os.getpid(), port=4000))
    newer = _entry("pool-a", os.getpid(), port=4001)
    announce(newer)
    assert announced("ns") == [newer]


def test_a_pool_whose_process_is_gone_is_not_announced() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(gone.stdout)
    announce(_entry("pool-dead", dead))
    live = _entry("pool-live", os.getpid())
    announce(live)
    assert announced("ns") == [live]


def test_unreadable_files_and_other_namespaces_are_skipped() -> None:
    live = _entry("pool-a", os.getpid())
    announce(live)
    (run_dir("ns") / "broken.json").write_text("{not json")
    announce(_entry("pool-b", os.getpid(), namespace="other"))
    assert announced("ns") == [live]
    assert announced("nobody") == []


def test_a_namespace_cannot_name_a_path_outside_the_run_directory(tmp_path: Path) -> None:
    entry = _entry("pool-a", os.getpid(), namespace="../../etc")
    path = announce(entry)
    assert path.resolve().is_relative_to((tmp_path / "run").resolve())
    assert announced("../../etc") == [entry]


def test_a_directory_others_can_write_is_not_trusted() -> None:
    live = _entry("pool-a", os.getpid())
    announce(live)
    directory = run_dir("ns")
    directory.chmod(0o777)  # anyone could have planted a forged channel here
    assert announced("ns") == []
    directory.chmod(0o700)
    (directory / "pool-a.json").chmod(0o666)
    assert announced("ns") == []
