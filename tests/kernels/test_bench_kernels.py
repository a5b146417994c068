"""benchmarks/bench_kernels.py follows the benchmark contract (quick mode, JSON rows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target_ratio"}


def test_bench_kernels_quick_writes_contract_json(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    subprocess.run(
        [sys.executable, "benchmarks/bench_kernels.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "kernels" and doc["quick"] is True
    names = [r["name"] for r in doc["rows"]]
    assert names[:3] == ["reference_cpu_b1", "reference_cpu_b4", "reference_cpu_b16"]
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row) and row["value"] > 0 and row["unit"] == "tokens/s"
        assert row["ratio"] == row["value"] / row["baseline_value"]
