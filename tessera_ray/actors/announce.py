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
a restarted pool writes a new one (new port, new secret) over it. Files are kept per Ray
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

__all__ = ["PoolAnnouncement", "announce", "announced", "run_dir"]

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
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PoolAnnouncement:
        d = json.loads(text)
        address = ChannelAddress(str(d["host"]), int(d["port"]), bytes.fromhex(d["secret"]))
        return cls(str(d["namespace"]), str(d["pool"]), str(d["node"]), address, int(d["pid"]))


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not our pool
        return False
    return True


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
        try:
            if not _ours(path):
                continue
            entry = PoolAnnouncement.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if entry.namespace == namespace and _alive(entry.pid):
            out.append(entry)
    return out
