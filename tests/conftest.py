"""Session-wide fixtures. Ray tests share ONE local cluster per session: three simulated nodes
on 127.0.0.1 (``ray.cluster_utils.Cluster``), sized for a 2-core, 24 GiB machine.

``UCX_MODULES=^ib`` is set before anything imports NIXL: with system libibverbs present a
process holding a UCX backend can crash at exit otherwise (docs/reference.md). Ray workers get it,
and the repository on ``PYTHONPATH``, through the job's runtime environment.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_MODULES", "^ib")
# Keep every Ray address on loopback: without this Ray resolves 127.0.0.1 to the machine's
# routable address when a driver connects to an existing cluster. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray's token authentication stays on for the test cluster, as in production (the chaos suite
# checks a driver with a wrong token is refused). A fresh machine has no token yet: give this
# session one, in the environment only (Ray reads RAY_AUTH_TOKEN before ~/.ray/auth_token).
os.environ.setdefault("RAY_AUTH_MODE", "token")
if not os.environ.get("RAY_AUTH_TOKEN") and not (Path.home() / ".ray" / "auth_token").exists():
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUM_NODES = 3


@dataclass(frozen=True)
class SimCluster:
    address: str
    node_ids: list[str]
    """Node ids in start order: the head first."""
    metrics_export_port: int = 0
    """The head node's Prometheus endpoint: ``http://127.0.0.1:<port>/metrics``."""


def kill_and_wait(actor: Any, timeout_s: float = 30.0) -> None:
    """Kill a Ray actor and block until its process is gone. ``ray.kill`` returns before it
    is, and Ray calls the actor dead while its process still exits, when it can still answer
    on an open pin channel or serve a one-sided read of its memory."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while not _process_gone(pid):
        assert time.monotonic() < deadline, f"the killed actor's process {pid} still runs"
        time.sleep(0.02)


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, or a zombie
    except FileNotFoundError:
        return True


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tessera_cluster() -> Iterator[SimCluster]:
    import ray
    from ray.cluster_utils import Cluster

    metrics_port = _free_loopback_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "object_store_memory": 256 << 20,
            "metrics_export_port": metrics_port,
        },
    )
    for _ in range(NUM_NODES - 1):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=192 << 20)
    ray.init(
        address=cluster.address,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"UCX_MODULES": "^ib", "PYTHONPATH": str(ROOT)}},
    )
    cluster.wait_for_nodes()
    head = ray.get_runtime_context().get_node_id()
    others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    try:
        yield SimCluster(cluster.address, [head, *others], metrics_port)
    finally:
        ray.shutdown()
        cluster.shutdown()
