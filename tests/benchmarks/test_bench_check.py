"""Results tied to the commit they measured: ``write_result`` records it, ``results_check.py``
lists a result whose measured code changed since, and BENCHMARKS.md shows it per section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.contract import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import common
import results_check as bench_check
from render import render

sys.path.pop(0)


def test_every_benchmark_names_the_paths_it_measures_and_they_exist() -> None:
    scripts = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert scripts <= set(common.MEASURES)
    for name in common.MEASURES:
        for path in common.measured_paths(name):
            assert (ROOT / path).exists(), f"{name} measures {path}, which does not exist"


def _git(repo: Path, *argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git checkout with a measured module and a file the benchmark does not measure."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.invalid")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text('"""Doc."""\n\n\ndef f(x):\n    return x + 1\n')
    (tmp_path / "other.py").write_text("y = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def _doc(repo: Path, commit: str | None) -> dict[str, Any]:
    return {"benchmark": "toy", "commit": commit, "measures": ["pkg"], "rows": []}


def test_a_result_is_current_until_its_measured_code_changes(repo: Path) -> None:
    commit = common.source_commit(["pkg"], root=repo)
    assert commit is not None and not commit.endswith("-dirty")
    doc = _doc(repo, commit)
    assert bench_check.stale(doc, "toy", repo) is None
    # Docstrings, comments and files it does not measure leave it current.
    (repo / "pkg" / "mod.py").write_text(
        '"""Another doc."""\n\n\ndef f(x):\n    """Adds one."""\n    return x + 1  # why\n'
    )
    (repo / "other.py").write_text("y = 2\n")
    assert bench_check.stale(doc, "toy", repo) is None
    # A change of code, committed or not, makes it stale and names the file.
    (repo / "pkg" / "mod.py").write_text('"""Doc."""\n\n\ndef f(x):\n    return x + 2\n')
    assert "pkg/mod.py" in (bench_check.stale(doc, "toy", repo) or "")
    _git(repo, "commit", "-qam", "second")
    assert "pkg/mod.py" in (bench_check.stale(doc, "toy", repo) or "")
    # So does a new file under a measured path.
    (repo / "pkg" / "new.py").write_text("z = 1\n")
    assert "pkg/new.py" in (
        bench_check.stale(_doc(repo, _git(repo, "rev-parse", "HEAD")), "toy", repo) or ""
    )


def test_results_without_a_clean_known_commit_are_stale(repo: Path) -> None:
    assert "no commit" in (bench_check.stale(_doc(repo, None), "toy", repo) or "")
    (repo / "pkg" / "mod.py").write_text("def f(x):\n    return x\n")
    dirty = common.source_commit(["pkg"], root=repo)
    assert dirty is not None and dirty.endswith("-dirty")
    assert "uncommitted" in (bench_check.stale(_doc(repo, dirty), "toy", repo) or "")
    # Changes outside the measured paths do not make a run dirty.
    assert common.source_commit(["other.py"], root=repo) == _git(
        repo, "describe", "--always", "--abbrev=12"
    )
    assert "not in this history" in (bench_check.stale(_doc(repo, "0" * 12), "toy", repo) or "")


def test_main_lists_stale_results_and_fails(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "toy.json").write_text(json.dumps(_doc(repo, None)))
    (results / "picture.json").write_text(json.dumps({"not": "a result"}))
    assert bench_check.main(["--results", str(results)]) == 1
    out = capsys.readouterr().out
    assert "stale: toy (toy.json): records no commit" in out and "0 of 1" in out


def test_write_result_records_the_commit_and_what_it_measures(tmp_path: Path) -> None:
    args = common.BenchArgs(quick=True, out=tmp_path / "pool.json")
    doc = common.write_result("pool", args, [common.Row(name="r", value=1.0, unit="x")])
    assert doc["commit"] == common.source_commit(common.measured_paths("pool"))
    assert doc["measures"] == common.measured_paths("pool")
    assert "tessera_ray/core" in doc["measures"] and "benchmarks/bench_pool.py" in doc["measures"]
    assert json.loads(args.out.read_text())["commit"] == doc["commit"]


def test_benchmarks_md_shows_each_sections_commit_and_marks_derived_and_inconclusive() -> None:
    rows = [
        common.Row(name="a", value=2.0, unit="s"),
        common.Row(
            name="b", value=1.0, unit="1/s", baseline="a", baseline_value=2.0,
            target_ratio=0.4, derived_from="1 / a",
        ),
        common.Row(
            name="c", value=1.0, unit="x", baseline="y", baseline_value=1.1,
            target_ratio=0.95, inconclusive="y spread 12%",
        ),
    ]  # fmt: skip
    doc = {
        "benchmark": "toy",
        "machine": {"cpus": 2},
        "command": "python benchmarks/bench_toy.py",
        "commit": "abc123def456",
        "rows": [r.to_json() for r in rows],
    }
    page = render([doc])
    assert "(commit abc123def456, " in page
    assert "| toy | b (derived) | 0.5 | >= 0.4 | met | abc123def456 |" in page
    assert "| toy | c | 0.9091 | >= 0.95 | inconclusive | abc123def456 |" in page
    assert "derived from 1 / a" in page and "inconclusive on this machine: y spread 12%" in page
    assert " MISSED" not in page
    assert "Derived rows (each names what it is computed from): toy: b." in page
