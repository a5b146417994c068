"""CPU time of every process on this machine, from ``/proc``, grouped by what the process is
(Ray's GCS server, a raylet, a pool actor, vLLM's engine core or worker, ...): what an engine
with the connector costs the whole machine, not only its own process. Linux only."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["cpu_seconds", "cpu_between", "process_kind"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

_KINDS: tuple[tuple[str, str], ...] = (
    (r"gcs_server", "ray gcs"),
    (r"raylet", "ray raylet"),
    (r"dashboard|agent\.py|log_monitor|monitor\.py", "ray dashboard and monitors"),
    (r"ray::PoolActor|tessera-pool", "tier pool"),
    (r"ray::DirectoryActor|tessera-dir", "tier directory shard"),
    (r"EngineCore|VLLM::EngineCor", "vllm engine core"),
    (r"VLLM::Worker|VllmWorker|CPUWorker|Worker_TP", "vllm worker"),
    (r"_run_engine", "engine front end"),
    (r"ray::", "ray worker (other)"),
)


def process_kind(comm: str, cmdline: str) -> str:
    """What a process is, from its name and command line ("other" for the rest)."""
    text = f"{comm} {cmdline}"
    for pattern, kind in _KINDS:
        if re.search(pattern, text):
            return kind
    return "other"


def _read(pid: str) -> tuple[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile, or not ours to read
        return None
    # comm is in parentheses and may hold spaces: the fields after its closing one are fixed.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return process_kind(comm, cmdline), (utime + stime) * _TICK_S


def cpu_seconds(exclude: int | None = None) -> dict[int, tuple[str, float]]:
    """Per live process (but ``exclude``): its kind and the CPU seconds it has used."""
    out: dict[int, tuple[str, float]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != exclude:
            got = _read(pid)
            if got is not None:
                out[int(pid)] = got
    return out


def cpu_between(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds used between two :func:`cpu_seconds` samples, per process kind (a process
    that started in between counts from zero; one that ended is not seen)."""
    used: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        start = before.get(pid)
        spent = seconds - (start[1] if start is not None and start[0] == kind else 0.0)
        if spent > 0:
            used[kind] = used.get(kind, 0.0) + spent
    return used
