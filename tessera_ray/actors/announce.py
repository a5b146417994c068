"""A pool's announcement on its own node: where a process on the same machine reaches its channel
without joining Ray (no Ray import).

Why: an engine process that joins Ray to find its pool becomes a Ray driver, and a driver costs
the whole cluster while idle (its own threads, Ray's GCS serving it, the dashboard agent
watching it: docs/connector-cost.md). A process on the pool's node needs none of that: the pool
writes its channel's address and secret to a file only its own user can read, and the vLLM
connector connects from that.

Trust: the same as the node's own: the directory is created mode 0700 and each file 0600, so a
process must run as the pool's user to read a secret (as it must to read Ray's session files),
and a reader trusts only a directory and files that user owns and no one else can write.
A pool that died leaves its file behind; :func:`announced` skips files whose process is gone, and
a restarted pool writes a new one (new port, new secret) over it. A process is named by its pid
and the time it started (Linux's ``/proc``): pids are reused, and a stale file whose number now
belongs to another process (an engine, a Ray worker) would send engines to a closed port.
Each announcement also clears the files of processes that are gone. Files are kept per Ray
namespace: two running tiers of one namespace on one machine (two Ray clusters) would be told
apart by nothing here, so give each its own namespace (or ``TESSERA_RUN_DIR``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.actors.channel import ChannelAddress

__all__ = [
    "PoolAnnouncement",
    "announce",
    "announced",
    "process_started",
    "run_dir",
    "running",
    "start_field",
]

log = logging.getLogger(__name__)

RUN_DIR_ENV = "TESSERA_RUN_DIR"
"""Overrides where announcements live (default: ``tessera-ray-<uid>`` in the temp directory)."""


@dataclass(frozen=True, slots=True)
class PoolAnnouncement:
    """One pool's channel, as a process on its node reaches it."""

    namespace: str
    pool: str
    node: str
    """The Ray node the pool runs on (readers map its memory when they share it)."""
    address: ChannelAddress
    pid: int
    started: int | None = None
    """When process ``pid`` started (clock ticks since boot; ``None`` where ``/proc`` is not
    there): tells the pool's process from a later one given the same pid."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "namespace": self.namespace,
                "pool": self.pool,
                "node": self.node,
                "host": self.address.host,
                "port": self.address.port,
                "secret": self.address.secret.hex(),
                "pid": self.pid,
                "started": self.started,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PoolAnnouncement:
        d = json.loads(text)
        address = ChannelAddress(str(d["host"]), int(d["port"]), bytes.fromhex(d["secret"]))
        started = d.get("started")
        return cls(
            str(d["namespace"]),
            str(d["pool"]),
            str(d["node"]),
            address,
            int(d["pid"]),
            None if started is None else int(started),
        )

    @classmethod
    def of_this_process(
        cls, namespace: str, pool: str, node: str, address: ChannelAddress
    ) -> PoolAnnouncement:
        pid = os.getpid()
        return cls(namespace, pool, node, address, pid, process_started(pid))


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``None``: no such process, or no
    ``/proc`` to ask)."""
    try:
        return start_field(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def start_field(stat: str) -> int | None:
    """The start time in a ``/proc/<pid>/stat`` line (``None``: not such a line, or a process
    that has exited and is only waiting to be reaped)."""
    # The command name (field 2) is in parentheses and may hold spaces or ')': count the fields
    # after its last ')'. The state is field 3, the start time field 22.
    try:
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):  # exited: its sockets are closed
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def run_dir(namespace: str) -> Path:
    """Where the pools of Ray namespace ``namespace`` announce themselves on this machine."""
    base = os.environ.get(RUN_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"tessera-ray-{os.getuid()}"
    )
    return Path(base) / urllib.parse.quote(namespace, safe="")


def announce(entry: PoolAnnouncement) -> Path:
    """Write ``entry`` where :func:`announced` finds it (atomically: a reader sees the old file
    or the new one, never half of one)."""
    directory = run_dir(entry.namespace)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # an existing directory made by hand keeps no wider mode
    path = directory / f"{entry.pool}.json"
    _clear_gone(directory, keep=path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".announce-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(entry.to_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _ours(path: Path) -> bool:
    """Owned by this user, and writable by no one else."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def running(entry: PoolAnnouncement) -> bool:
    """Whether the process that wrote ``entry`` still runs (not merely one with its pid)."""
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not our pool
        return False
    if entry.started is None:
        # Written where there is no /proc: the pid is all there is to go by.
        return not Path("/proc").is_dir()
    return process_started(entry.pid) == entry.started


def _read(path: Path) -> PoolAnnouncement | None:
    try:
        if not _ours(path):
            return None
        return PoolAnnouncement.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _clear_gone(directory: Path, keep: Path) -> None:
    """Remove the announcements of processes that are gone (they would otherwise pile up, one
    per pool ever started in the namespace, and each is read by every engine that starts)."""
    for path in directory.glob("*.json"):
        entry = _read(path)
        if path != keep and entry is not None and not running(entry):
            path.unlink(missing_ok=True)


def announced(namespace: str) -> list[PoolAnnouncement]:
    """The live pools of ``namespace`` on this machine, by name; files that cannot be read, or
    whose process is gone, are skipped."""
    directory = run_dir(namespace)
    if not directory.is_dir():
        return []
    if not _ours(directory):
        # Another user could write a forged announcement here, leading an engine to a channel
        # that is not the tier's (and to pages that are not its own): trust none of it.
        log.warning("announcements in %s ignored: not owned by this user alone", directory)
        return []
    out: list[PoolAnnouncement] = []
    for path in sorted(directory.glob("*.json")):
        entry = _read(path)
        if entry is not None and entry.namespace == namespace and running(entry):
            out.append(entry)
    return out
