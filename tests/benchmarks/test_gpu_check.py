"""The GPU validation script's own logic, on CPU: the list, the skips, the JSON, and how a
failed or hung check is reported (the checks themselves need a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.contract import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check

sys.path.pop(0)


def _no_subprocess(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a check ran")


def test_dry_run_lists_every_check_and_runs_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "gpu.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [c.name for c in gpu_check.checks(tmp_path)]
    assert len(names) == len(set(names)) >= 5
    assert {"kernels_vs_reference", "decode_bench", "gpu_pool", "engine"} <= set(names)
    # The whole validation fits the time a lent GPU machine gives it.
    assert sum(c.timeout_s for c in gpu_check.checks(tmp_path)) <= 8 * 60
    assert [line.split(":")[0] for line in lines] == names
    assert not (tmp_path / "gpu.json").exists()


def test_without_cuda_every_check_is_skipped_and_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_check, "_cuda", lambda: None)
    monkeypatch.setattr(gpu_check, "_run", _no_subprocess)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] is None
    assert {c["status"] for c in doc["checks"]} == {"skipped"}


def test_a_failed_and_a_hung_check_fail_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, second, *rest = gpu_check.checks(tmp_path)

    def run(argv: list[str], **kwargs: Any) -> Any:
        if tuple(argv[1:]) == first.argv:
            return subprocess.CompletedProcess(argv, 1, "", "AssertionError: out differs\n")
        if tuple(argv[1:]) == second.argv:
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        return subprocess.CompletedProcess(argv, 0, "fine\n", "")

    monkeypatch.setattr(gpu_check, "_cuda", lambda: "Stand-in GPU")
    monkeypatch.setattr(subprocess, "run", run)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 1
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks[first.name]["status"] == "failed"
    assert checks[first.name]["detail"] == "AssertionError: out differs"
    assert checks[second.name]["status"] == "timeout"
    assert all(checks[c.name]["status"] == "ok" for c in rest)


def test_a_check_that_skips_itself_is_recorded_skipped_not_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, *rest = gpu_check.checks(tmp_path)

    def run(argv: list[str], **kwargs: Any) -> Any:
        if tuple(argv[1:]) == first.argv:
            return subprocess.CompletedProcess(argv, gpu_check.SKIPPED, "skipped: no vLLM\n", "")
        return subprocess.CompletedProcess(argv, 0, "fine\n", "")

    monkeypatch.setattr(gpu_check, "_cuda", lambda: "Stand-in GPU")
    monkeypatch.setattr(subprocess, "run", run)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks[first.name] == {
        **checks[first.name],
        "status": "skipped",
        "detail": "skipped: no vLLM",
    }
    assert all(checks[c.name]["status"] == "ok" for c in rest)


@pytest.mark.parametrize("script", ["gpu_pool.py", "gpu_engine.py"])
def test_the_gpu_scripts_skip_themselves_without_cuda(script: str) -> None:
    """Run here, where torch sees no CUDA device: each says why and exits 77, needing no
    network and touching nothing."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--out", "/dev/null"]
        if script == "gpu_pool.py"
        else [sys.executable, str(ROOT / "benchmarks" / script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == gpu_check.SKIPPED, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("skipped: ")
