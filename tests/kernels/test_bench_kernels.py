"""benchmarks/bench_kernels.py follows the benchmark contract (quick mode, JSON rows)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.contract import run_quick


def test_bench_kernels_quick_writes_contract_json(tmp_path: Path) -> None:
    doc = run_quick("kernels", tmp_path)
    names = [r["name"] for r in doc["rows"]]
    assert names[:3] == ["reference_cpu_b1", "reference_cpu_b4", "reference_cpu_b16"]
    assert all(r["unit"] == "tokens/s" and r["baseline"] for r in doc["rows"])
