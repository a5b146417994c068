"""Running one real vLLM engine in its own process (``_run_engine.py``) and reading its report;
shared by the engine tests and ``benchmarks/bench_engine.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EngineRun", "run_engine", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]


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
    # vLLM's defaults, as a user's engine has them: nothing of this process's vLLM settings.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine._run_engine", str(spec_path), str(out_path)],
        cwd=ROOT,
        env=env,
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
