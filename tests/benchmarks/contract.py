"""Run one benchmark in quick mode and check the JSON every benchmark must write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target_ratio"}


def run_quick(benchmark: str, tmp_path: Path) -> dict[str, Any]:
    """``python benchmarks/bench_<benchmark>.py --quick --out ...``, alone, as a user runs it;
    returns its document after checking the contract's fields and ratios."""
    out = tmp_path / f"{benchmark}.json"
    subprocess.run(
        [sys.executable, f"benchmarks/bench_{benchmark}.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["benchmark"] == benchmark and doc["quick"] is True
    assert {"python", "cpus", "torch"} <= set(doc["machine"])
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["value"] > 0
        if row["baseline"] is not None:
            assert row["ratio"] == row["value"] / row["baseline_value"]
    return doc
