"""The GPU validation script's own logic, on CPU: the list, the skips, the JSON, and how a
failed, hung, all-skipped or below-target check is reported (the checks themselves need a GPU).
Also ``gpu_pool.py``'s parts that run without one: what becomes an unavailable row, and what its
fetch timing covers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

import pytest

from tessera_ray.core import BlockPool, PoolConfig
from tessera_ray.errors import TransportError, TransportUnavailableError
from tessera_ray.transport import LocalTransport, TransportConfig
from tests.benchmarks.contract import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check
import gpu_pool

sys.path.pop(0)

Behaviour = Callable[[gpu_check.Check, list[str]], subprocess.CompletedProcess[str]]


def _no_subprocess(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a check ran")


def _junit(argv: list[str], outcomes: list[str | None]) -> None:
    """Write the JUnit report pytest would write for ``argv``'s ``--junitxml``: one test per
    entry, passed (``None``) or skipped with that reason (as pytest writes it: the reason in
    ``message``, prefixed by the location in the text)."""
    (path,) = [a.split("=", 1)[1] for a in argv if a.startswith("--junitxml=")]
    cases = "".join(
        f'<testcase classname="tests.gpu.t" name="test_{i}" time="0.1">'
        + (
            ""
            if why is None
            else f'<skipped type="pytest.skip" message={quoteattr(why)}>t.py:1: {why}</skipped>'
        )
        + "</testcase>"
        for i, why in enumerate(outcomes)
    )
    Path(path).write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        f'<testsuite name="pytest" errors="0" failures="0">{cases}</testsuite></testsuites>'
    )


def _rows(check: gpu_check.Check, rows: list[dict[str, Any]]) -> None:
    assert check.result is not None
    check.result.parent.mkdir(parents=True, exist_ok=True)
    check.result.write_text(json.dumps({"benchmark": check.name, "rows": rows}))


def _done(argv: list[str], rc: int = 0, out: str = "fine\n") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(argv, rc, out, "")


def _passes(check: gpu_check.Check, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """What a check that holds does: its tests pass, its rows meet their targets."""
    if check.is_pytest:
        _junit(argv, [None, None])
    elif check.result is not None:
        _rows(check, [{"name": "r", "value": 2.0, "ratio": 1.0, "target_ratio": 0.95}])
    return _done(argv)


def _stand_in(
    monkeypatch: pytest.MonkeyPatch, results: Path, **by_name: Behaviour
) -> list[gpu_check.Check]:
    """A CUDA device and ``subprocess.run`` doing, per check, ``by_name``'s behaviour (else
    ``_passes``); returns the plan."""
    plan = gpu_check.checks(results)
    real = subprocess.run

    def run(argv: list[str], **kwargs: Any) -> Any:
        if argv[0] == "git":  # the commit the run records
            return real(argv, **kwargs)
        (check,) = [c for c in plan if tuple(argv[1 : 1 + len(c.argv)]) == c.argv]
        assert kwargs["timeout"] == check.timeout_s
        return by_name.get(check.name, _passes)(check, argv)

    monkeypatch.setattr(gpu_check, "_cuda", lambda: "Stand-in GPU")
    monkeypatch.setattr(subprocess, "run", run)
    return plan


def _main(out: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    rc = gpu_check.main(["--out", str(out)])
    return rc, {c["name"]: c for c in json.loads(out.read_text())["checks"]}


def test_dry_run_lists_every_check_and_runs_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "gpu.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = gpu_check.checks(tmp_path)
    names = [c.name for c in plan]
    assert len(names) == len(set(names)) >= 6
    assert {"kernels_vs_reference", "gpu_tests", "decode_bench", "gpu_pool", "engine"} <= set(names)
    # The whole validation fits the time a lent GPU machine gives it.
    assert sum(c.timeout_s for c in plan) <= 8 * 60
    assert [line.split(":")[0] for line in lines] == names
    assert not (tmp_path / "gpu.json").exists()
    # The pool's GPU tests are listed, and a pytest check really runs them.
    assert [line for line in lines if "tests/core/test_pool_gpu.py" in line]
    assert [c for c in plan if c.is_pytest and "tests/core/test_pool_gpu.py" in c.argv]


def test_the_kernel_tests_are_a_check_of_their_own() -> None:
    """The rule for "the kernels all skipped": the tests that name a backend run alone, so the
    tests that pass on the reference (and the pool's) cannot hide their skips."""
    plan = {c.name: c for c in gpu_check.checks(Path("results"))}
    kernels, rest = plan["kernels_vs_reference"].argv, plan["gpu_tests"].argv
    assert kernels[kernels.index("-k") + 1] == gpu_check.KERNEL_TESTS == "flashmla or flashinfer"
    assert rest[rest.index("-k") + 1] == f"not ({gpu_check.KERNEL_TESTS})"
    assert "tests/gpu" in kernels and "tests/gpu" in rest and "gpu" in kernels


def test_the_pytest_checks_run_here_are_skipped_with_pytest_s_reasons(tmp_path: Path) -> None:
    """For real, on this machine where no test can run: pytest's own report is read, and the
    kernel check holds the tests of both backends."""
    plan = {c.name: c for c in gpu_check.checks(tmp_path)}
    kernels = gpu_check._run(plan["kernels_vs_reference"], sys.executable)
    rest = gpu_check._run(plan["gpu_tests"], sys.executable)
    assert (kernels.status, rest.status) == ("skipped", "skipped"), (kernels, rest)
    assert "FlashMLA not usable here" in kernels.detail
    assert "FlashInfer MLA not usable here" in kernels.detail
    assert "not usable" not in rest.detail and "needs CUDA" in rest.detail


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
    # Tied to the code it ran, as every result is (make bench-check reads these).
    assert doc["commit"] == gpu_check.provenance("gpu")["commit"] and doc["commit"]
    assert "tests/core/test_pool_gpu.py" in doc["measures"]


def test_a_failed_and_a_hung_check_fail_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def fails(check: gpu_check.Check, argv: list[str]) -> Any:
        return _done(argv, 1, "AssertionError: out differs\n")

    def hangs(check: gpu_check.Check, argv: list[str]) -> Any:
        raise subprocess.TimeoutExpired(argv, check.timeout_s)

    plan = _stand_in(monkeypatch, tmp_path, backends=fails, kernels_vs_reference=hangs)
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 1
    assert checks["backends"]["status"] == "failed"
    assert checks["backends"]["detail"] == "AssertionError: out differs"
    assert checks["kernels_vs_reference"]["status"] == "timeout"
    assert all(checks[c.name]["status"] == "ok" for c in plan[2:])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("gpu_check: FAILED backends, kernels_vs_reference ->")


def test_a_check_that_skips_itself_is_recorded_skipped_not_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def skips(check: gpu_check.Check, argv: list[str]) -> Any:
        return _done(argv, gpu_check.SKIPPED, "skipped: no vLLM\n")

    plan = _stand_in(monkeypatch, tmp_path, engine=skips)
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 0
    assert checks["engine"] == {
        **checks["engine"],
        "status": "skipped",
        "detail": "skipped: no vLLM",
    }
    assert all(checks[c.name]["status"] == "ok" for c in plan if c.name != "engine")


def test_kernel_tests_all_skipped_are_reported_skipped_beside_passing_reference_tests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The H200 run that printed ``ok`` for ``3 passed, 8 skipped``: every FlashMLA and
    FlashInfer test skipped while the reference-path tests passed."""

    def kernels_skip(check: gpu_check.Check, argv: list[str]) -> Any:
        _junit(argv, ["FlashMLA not usable here"] * 4 + ["FlashInfer MLA not usable here"] * 4)
        return _done(argv, 0, "8 skipped, 5 deselected in 3.00s\n")

    def reference_passes(check: gpu_check.Check, argv: list[str]) -> Any:
        _junit(argv, [None] * 5)
        return _done(argv, 0, "5 passed, 8 deselected in 9.00s\n")

    _stand_in(monkeypatch, tmp_path, kernels_vs_reference=kernels_skip, gpu_tests=reference_passes)
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 0
    assert checks["kernels_vs_reference"]["status"] == "skipped"
    assert checks["kernels_vs_reference"]["detail"] == (
        "FlashMLA not usable here (4); FlashInfer MLA not usable here (4)"
    )
    assert checks["gpu_tests"] == {**checks["gpu_tests"], "status": "ok", "detail": "5 passed"}
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("gpu_check: OK; skipped: kernels_vs_reference ->")


def test_one_backend_passing_makes_the_kernel_check_ok_and_names_the_other_s_skips(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def flashmla_only(check: gpu_check.Check, argv: list[str]) -> Any:
        _junit(argv, [None] * 4 + ["FlashInfer MLA not usable here"] * 4)
        return _done(argv)

    _stand_in(monkeypatch, tmp_path, kernels_vs_reference=flashmla_only)
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 0
    assert checks["kernels_vs_reference"]["status"] == "ok"
    assert checks["kernels_vs_reference"]["detail"] == (
        "4 passed, 4 skipped: FlashInfer MLA not usable here (4)"
    )


def test_a_benchmark_row_below_its_target_is_missed_and_does_not_fail_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def misses(check: gpu_check.Check, argv: list[str]) -> Any:
        _rows(
            check,
            [
                {"name": "met", "value": 9.0, "ratio": 0.99, "target_ratio": 0.95},
                {"name": "pool_flashmla", "value": 8.0, "ratio": 0.9123, "target_ratio": 0.95},
                {"name": "no_target", "value": 1.0, "ratio": 0.1, "target_ratio": None},
                {"name": "absent", "value": None, "ratio": None, "target_ratio": 0.95},
                # Below its target but recorded inconclusive (its baseline's spread): no miss.
                {
                    "name": "noisy",
                    "value": 7.0,
                    "ratio": 0.8,
                    "target_ratio": 0.95,
                    "verdict": "inconclusive",
                },
            ],
        )
        return _done(argv)

    _stand_in(monkeypatch, tmp_path, decode_bench=misses)
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 0
    assert checks["decode_bench"]["status"] == "missed"
    assert checks["decode_bench"]["detail"] == (
        "below target: pool_flashmla 0.912 < 0.95; not available: absent"
    )
    assert checks["gpu_pool"]["status"] == "ok"
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("gpu_check: OK; missed: decode_bench ->")


def test_a_benchmark_that_exits_0_without_writing_its_result_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A result left by an earlier run is not this run's."""

    def writes_nothing(check: gpu_check.Check, argv: list[str]) -> Any:
        return _done(argv)

    plan = _stand_in(monkeypatch, tmp_path, gpu_pool=writes_nothing)
    (stale,) = [c for c in plan if c.name == "gpu_pool"]
    _rows(stale, [{"name": "r", "value": 2.0, "ratio": 1.0, "target_ratio": 0.95}])
    rc, checks = _main(tmp_path / "gpu.json")
    assert rc == 1
    assert checks["gpu_pool"]["status"] == "failed"
    assert checks["gpu_pool"]["detail"].startswith("exited 0 but wrote no result")


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


def test_gpu_pool_makes_a_row_of_an_unavailable_transport_only() -> None:
    def unavailable(kind: str, pages: int) -> Any:
        raise TransportUnavailableError("NIXL is not importable here")

    row = gpu_pool._pair_or_unavailable("nixl", 8, unavailable)
    assert isinstance(row, gpu_pool.Row) and row.value is None
    assert row.name == "verified_fetch_gpu_nixl"
    assert row.note == "not available: NIXL is not importable here"
    pair = object()
    assert gpu_pool._pair_or_unavailable("local", 8, lambda kind, pages: pair) is pair


@pytest.mark.parametrize("error", [TransportError, ValueError, RuntimeError])
def test_gpu_pool_lets_any_other_error_propagate(error: type[Exception]) -> None:
    def broken(kind: str, pages: int) -> Any:
        raise error("registering the pools with NIXL failed")

    with pytest.raises(error, match="registering"):
        gpu_pool._pair_or_unavailable("nixl", 8, broken)


def test_gpu_pool_reports_a_transport_of_another_kind_as_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asked for ``nixl`` and handed another kind: unavailable, not measured under its name."""
    monkeypatch.setattr(
        gpu_pool,
        "_pool",
        lambda pages: BlockPool.for_group(gpu_pool.LAYOUT, 0, PoolConfig(num_pages=pages)),
    )
    monkeypatch.setattr(
        gpu_pool,
        "make_transport",
        lambda config, name: LocalTransport(TransportConfig(kind="local"), name=name),
    )
    row = gpu_pool._pair_or_unavailable("nixl", 2)
    assert isinstance(row, gpu_pool.Row)
    assert row.note == "not available: nixl transport unavailable (made local)"


class _Clock:
    """``perf_counter`` stand-in that the stand-in pair advances."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gpu_pool_times_the_verified_fetch_alone_and_checks_every_run_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(gpu_pool.time, "perf_counter", clock)
    monkeypatch.setattr(gpu_pool.torch.cuda, "synchronize", lambda: None)
    fetched: list[object] = []
    checked: list[object] = []

    class Pair:
        def fetch(self) -> object:
            assert len(checked) == len(fetched)  # the previous run was checked and emptied
            clock.now += [50.0, 1.0, 3.0, 2.0][len(fetched)]  # a slow warm-up, then the runs
            fetched.append(object())
            return fetched[-1]

        def check_and_empty(self, result: object) -> None:
            clock.now += 100.0  # comparing every byte: outside the timing
            checked.append(result)

    assert gpu_pool._fetch_s(Pair(), repeat=3) == 2.0  # type: ignore[arg-type]
    assert checked == fetched and len(fetched) == 4


@pytest.mark.skipif(gpu_pool.torch.cuda.is_available(), reason="measured where CUDA is")
def test_gpu_pool_same_node_rows_say_not_run_without_a_gpu() -> None:
    rows = gpu_pool.same_node_device_rows(8, 1)
    assert [r.name for r in rows] == [
        "verified_fetch_gpu_same_node",
        "cuda_ipc_gather",
        "verified_fetch_gpu_nixl_same_node",
        "same_node_vs_nixl_gpu",
    ]
    assert all(r.value is None and r.note == "not run: no GPU" for r in rows)
    assert [r.target_ratio for r in rows] == [0.5, None, None, 100.0]


@pytest.mark.skipif(gpu_pool.torch.cuda.is_available(), reason="measured where CUDA is")
def test_gpu_pool_without_a_gpu_records_every_row_as_not_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu_pool.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_pool.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == gpu_pool.SKIPPED, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10 and all(r["value"] is None for r in rows)
    assert all(r["note"] == "not run: no GPU" and r["verdict"] is None for r in rows)
    targets = {r["name"]: r["target_ratio"] for r in rows}
    assert targets["seal_gpu_pages"] == targets["verify_gpu_pages"] == 0.5
    assert targets["same_node_vs_nixl_gpu"] == 100.0
