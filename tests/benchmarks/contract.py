"""Run one benchmark in quick mode and check the JSON every benchmark must write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target_ratio"}


def run_quick(benchmark: str, tmp_path: Path, timeout_s: float = 120) -> dict[str, Any]:
    """``python benchmarks/bench_<benchmark>.py --quick --out ...``, alone, as a user runs it;
    returns its document after checking the contract's fields and ratios."""
    out = tmp_path / f"{benchmark}.json"
    subprocess.run(
        [sys.executable, f"benchmarks/bench_{benchmark}.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["benchmark"] == benchmark and doc["quick"] is True
    assert {"python", "cpus", "torch"} <= set(doc["machine"])
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row)
        if row["value"] is None:  # a system that is not there says why, and nothing else
            assert row["note"].startswith("not available: ") and row["ratio"] is None, row
            continue
        assert row["value"] > 0, row
        if row["baseline"] is not None and row["baseline_value"] is not None:
            assert row["ratio"] == row["value"] / row["baseline_value"]
        elif row["baseline"] is not None:  # the baseline's system is not there
            assert row["ratio"] is None and "not available: " in row["note"], row
    return doc
