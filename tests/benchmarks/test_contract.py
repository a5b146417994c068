"""The benchmark contract: a benchmark runs alone, writes the agreed JSON, and renders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target_ratio"}


def test_baselines_quick_writes_contract_json(tmp_path: Path) -> None:
    out = tmp_path / "baselines.json"
    subprocess.run(
        [sys.executable, "benchmarks/bench_baselines.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "baselines" and doc["quick"] is True
    assert {"python", "cpus", "torch"} <= set(doc["machine"])
    names = [r["name"] for r in doc["rows"]]
    assert names == ["memcpy", "xxh3_128", "file_write_fsync", "file_read_cold"]
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["value"] > 0
        if row["baseline"] is not None:
            assert row["ratio"] == row["value"] / row["baseline_value"]

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from render import render
    finally:
        sys.path.pop(0)
    page = render([doc])
    assert "## baselines" in page and "`python benchmarks/bench_baselines.py --quick`" in page
    assert page.count("\n| ") == 1 + len(names)  # header row + one per result row


def test_render_marks_missed_targets() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from render import render
    finally:
        sys.path.pop(0)
    row = {
        "name": "x",
        "value": 1.0,
        "unit": "GB/s",
        "baseline": "memcpy",
        "baseline_value": 2.0,
        "ratio": 0.5,
        "target_ratio": 0.8,
    }
    doc = {
        "benchmark": "b",
        "machine": {"cpus": 2},
        "command": "python benchmarks/bench_b.py",
        "rows": [row],
    }
    assert "| x |" in render([doc]) and " MISSED |" in render([doc])
    row["target_ratio"] = 0.4
    assert " MISSED |" not in render([doc])
