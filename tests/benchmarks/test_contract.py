"""The benchmark contract: a benchmark runs alone, writes the agreed JSON, and renders."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.benchmarks.contract import ROOT, run_quick


def test_baselines_quick_writes_contract_json(tmp_path: Path) -> None:
    doc = run_quick("baselines", tmp_path)
    names = [r["name"] for r in doc["rows"]]
    assert names == ["memcpy", "xxh3_128", "file_write_fsync", "file_read_cold"]

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from render import render
    finally:
        sys.path.pop(0)
    page = render([doc])
    assert "## baselines" in page and "`python benchmarks/bench_baselines.py --quick`" in page
    section = page[page.index("## baselines") :]
    assert section.count("\n| ") == 1 + len(names)  # header row + one per result row
    assert "no GPU" in page and "What they cannot say" in page


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
    assert "| b | x | 0.5 | >= 0.8 | MISSED |" in render([doc])  # the summary's line
    row["target_ratio"] = 0.4
    assert " MISSED |" not in render([doc]) and "| b | x | 0.5 | >= 0.4 | met |" in render([doc])


def test_the_gpu_validation_renders_as_its_own_section() -> None:
    """``gpu.json`` (the GPU checks' run, not a benchmark) lands in BENCHMARKS.md as one line
    per check, beside the benchmarks' sections."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
        from render import render
    finally:
        sys.path.pop(0)
    checks = [
        {"name": c.name, "status": "skipped", "seconds": 0.0, "detail": "no CUDA"}
        for c in gpu_check.checks(ROOT / "benchmarks" / "results")
    ]
    page = render([{"device": None, "machine": {}, "checks": checks}])
    section = page[page.index("## GPU validation") :]
    assert section.count("| skipped |") == len(checks)
    assert "no result here records such a run" in " ".join(page.split())
    assert "On a GPU" not in page
    # A run on a device: the opening says what ran there, and stops saying nothing did.
    ran = [{**c, "status": "ok"} for c in checks[:2]] + [
        {**c, "status": "missed"} for c in checks[2:3]
    ]
    doc = {"device": "H200", "machine": {}, "commit": "abc", "time": "t", "checks": ran}
    page = render([doc])
    opening = " ".join(page[: page.index("## GPU validation")].split())
    assert f"On a GPU (H200) the GPU validation ran: {checks[0]['name']} (ok)" in opening
    assert f"{checks[2]['name']} (missed)" in opening and "no result here records" not in opening
    assert "(commit abc, t)" in page
