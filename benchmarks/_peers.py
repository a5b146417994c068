"""Starting and stopping the peer systems the benchmarks compare against, on loopback only.

- Redis: the Debian ``redis-server`` bound to 127.0.0.1 on a free port (never 6379, which a
  Ray GCS may hold), no persistence; clients use redis-py.
- Mooncake Store: ``mooncake_master`` from the ``mooncake-transfer-engine-non-cuda`` wheel,
  protocol tcp, metadata by P2P handshake. Its clients' TCP transport listens on every
  interface, so Mooncake runs only inside a loopback-only network namespace: the peer benchmark
  re-executes itself under ``unshare -n`` (with ``lo`` up) when it can, and reports Mooncake
  "not available" with the reason when it cannot.

A peer that is not installed or does not start is a reason string, never an estimate.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Peer",
    "enter_loopback_namespace",
    "namespace_possible",
    "namespace_problem",
    "redis_problem",
    "mooncake_problem",
    "redis_server",
    "mooncake_master",
    "version",
]

_NETNS_ENV = "TESSERA_BENCH_NETNS"
"""Set to "1" inside the namespace, or to the reason the namespace could not be made."""
MOONCAKE_DISTS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


@dataclass(frozen=True)
class Peer:
    """A started peer server: where clients connect, and the version that answered."""

    address: str
    version: str


_LO_UP = "ip link set lo up"


def namespace_possible() -> str | None:
    """``None`` when this process may create a loopback-only network namespace, else why not
    (not root, no ``unshare`` or ``ip``). Probes by creating one and bringing ``lo`` up."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", _LO_UP], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        return f"unshare -n failed: {reason}"
    return None


def enter_loopback_namespace(argv: list[str]) -> None:
    """Re-execute this process inside a new network namespace that has only ``lo`` (up).

    Returns (without re-executing) when already inside, or when the namespace cannot be made:
    the reason is then kept for :func:`namespace_problem`. Why a namespace: a peer that binds
    every interface must not be reachable from outside this machine.
    """
    if _NETNS_ENV in os.environ:
        return
    problem = namespace_possible()
    if problem is not None:
        os.environ[_NETNS_ENV] = problem
        return
    env = {**os.environ, _NETNS_ENV: "1"}
    cmd = ["unshare", "-n", "sh", "-c", f'{_LO_UP} && exec "$@"', "sh", sys.executable, *argv]
    sys.stdout.flush()
    os.execvpe("unshare", cmd, env)


def namespace_problem() -> str | None:
    """``None`` inside the loopback-only namespace, else why this process is not in one."""
    state = os.environ.get(_NETNS_ENV)
    if state == "1":
        return None
    return f"no loopback-only network namespace ({state or 'not requested'})"


def version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` that is installed."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def redis_problem() -> str | None:
    """Why Redis cannot be measured here, or ``None``."""
    if shutil.which("redis-server") is None:
        return "redis-server not installed (Debian package redis-server; see make bench)"
    if version("redis") is None:
        return "redis-py not installed (pip extra 'bench')"
    return None


def mooncake_problem(*, need_namespace: bool = True) -> str | None:
    """Why Mooncake Store cannot be measured here, or ``None``. The import runs in a child
    process: a wheel missing its system libraries (libibverbs) fails there, not here.
    ``need_namespace``: also require this process to be in the loopback-only namespace."""
    if version(*MOONCAKE_DISTS) is None:
        return "mooncake-transfer-engine-non-cuda not installed (pip extra 'bench')"
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        return f"import mooncake.store failed: {lines[-1] if lines else probe.returncode}"
    return namespace_problem() if need_namespace else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until something accepts on 127.0.0.1:port. A server announces readiness only in its log,
    in words that change between versions, so connecting is the portable test."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"not listening on 127.0.0.1:{port} after {timeout_s:.0f} s")


@contextmanager
def _server(cmd: list[str], port: int, name: str) -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix=f"tessera-bench-{name}-") as work:
        log = Path(work) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_listening(port, proc, log, timeout_s=30)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def redis_server() -> Iterator[Peer]:
    """A private redis-server on 127.0.0.1, no snapshots, no append-only file."""
    port = free_port()
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    words = [w for w in out.stdout.split() if w.startswith("v=")]
    server = words[0][2:] if words else out.stdout.strip()
    cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    cmd += ["--appendonly", "no", "--protected-mode", "yes"]
    with _server(cmd, port, "redis"):
        yield Peer(
            address=f"127.0.0.1:{port}",
            version=f"redis-server {server}, redis-py {version('redis')}, hiredis "
            + (version("hiredis") or "absent (pure-Python parser)"),
        )


@contextmanager
def mooncake_master() -> Iterator[Peer]:
    """A Mooncake master on 127.0.0.1 (RPC and metrics ports chosen free), no HTTP metadata
    server: the clients find each other by P2P handshake."""
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "mooncake.cli", f"--rpc_port={port}"]
    cmd += ["--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"]
    cmd += ["--enable_http_metadata_server=false"]
    with _server(cmd, port, "mooncake"):
        dist = next(d for d in MOONCAKE_DISTS if version(d) is not None)
        yield Peer(address=f"127.0.0.1:{port}", version=f"{dist} {version(dist)}")


@contextmanager
def mooncake_store_process(master: Peer, segment_bytes: int) -> Iterator[Peer]:
    """Mooncake's standalone store process (the wheel's ``mooncake_client``) on 127.0.0.1: it
    mounts ``segment_bytes`` of memory into ``master``'s store and outlives the clients that
    put objects there, which mount none (``mode: standalone-store``)."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_client"
    port = free_port()
    cmd = [str(binary), "--host=127.0.0.1", f"--port={port}", "--metadata_server=P2PHANDSHAKE"]
    cmd += [f"--master_server_address={master.address}", "--protocol=tcp"]
    cmd += [f"--global_segment_size={segment_bytes}", "--local_buffer_size=0", "--logtostderr"]
    with _server(cmd, port, "mooncake-store"):
        yield Peer(address=f"127.0.0.1:{port}", version=master.version)
