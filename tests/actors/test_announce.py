"""A pool's announcement on its node: only its user can read the secret, a reader never sees half
a file, a dead pool's file is skipped, and namespaces cannot escape the run directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_ray.actors.announce import (
    RUN_DIR_ENV,
    PoolAnnouncement,
    announce,
    announced,
    process_started,
    run_dir,
    start_field,
)
from tessera_ray.actors.channel import ChannelAddress


@pytest.fixture(autouse=True)
def _run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def _entry(pool: str, pid: int, *, namespace: str = "ns", port: int = 4000) -> PoolAnnouncement:
    address = ChannelAddress("127.0.0.1", port, os.urandom(32))
    return PoolAnnouncement(namespace, pool, "node-1", address, pid, process_started(pid))


def _dead_pid() -> int:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(gone.stdout)


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


def test_a_pool_whose_process_is_gone_is_not_announced_and_its_file_is_cleared() -> None:
    dead = _entry("pool-dead", _dead_pid())
    announce(dead)
    assert announced("ns") == []
    live = _entry("pool-live", os.getpid())
    announce(live)
    assert announced("ns") == [live]
    # The next announcement cleared the dead pool's file: they would otherwise pile up.
    assert sorted(p.name for p in run_dir("ns").iterdir()) == ["pool-live.json"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc: pids only")
def test_a_file_whose_pid_now_names_another_process_is_not_announced() -> None:
    # A pool died and its pid went to another process (here: this one, started at another
    # time). Engines led there would find a closed port: CI failed on exactly that.
    mine = process_started(os.getpid())
    assert mine is not None
    reused = _entry("pool-old", os.getpid())
    reused = PoolAnnouncement(
        reused.namespace, reused.pool, reused.node, reused.address, reused.pid, mine - 1
    )
    announce(reused)
    assert announced("ns") == []
    live = _entry("pool-new", os.getpid())
    announce(live)
    assert announced("ns") == [live]
    assert not (run_dir("ns") / "pool-old.json").exists()


def test_a_process_start_time_is_read_past_a_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(str(n) for n in range(3, 53))  # fields 3.. of a stat line
    assert start_field(f"4242 (a) b (c) {fields}") == 22
    assert start_field("4242 (cut short) S 1 2") is None
    assert start_field(f"4242 (exited) Z {fields[2:]}") is None  # its sockets are closed
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        if Path("/proc/self/stat").exists():
            ours, theirs = process_started(os.getpid()), process_started(child.pid)
            assert ours is not None and theirs is not None and theirs >= ours
    finally:
        child.kill()
        child.wait()
    assert process_started(child.pid) is None


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
