"""The GPU validation in one run: each check prints one line and lands in ``gpu.json``.

    python benchmarks/gpu_check.py             # on a CUDA machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --dry-run   # list the checks, run nothing

Checks run in order, each in its own process with its own time limit, so one that hangs or
crashes cannot take the others down. Each is reported with one status:

- ``ok``: it ran and what it checks held;
- ``failed``: it exited non-zero, or a benchmark exited 0 without writing its result;
- ``timeout``: it ran past its limit and was killed;
- ``skipped``: it could not run here. A script says so by exiting 77 (what it needs is not
  installed: its last line says what); a pytest check, when none of its tests passed and some
  skipped (the detail gives each skip reason). The kernels' tests are a check of their own, so
  reference-path tests that pass cannot make skipped kernels look ``ok``;
- ``missed``: a benchmark ran, but a row of its result is ``MISSED`` as BENCHMARKS.md would
  show it: its ``ratio`` below its ``target_ratio`` and not ``inconclusive`` (the detail names
  each row and its ratio).

``failed`` and ``timeout`` fail the run (exit 1); ``missed`` and ``skipped`` do not, but the last
line lists them. Without a CUDA device every check is reported skipped (and the run exits 0): the
list, the skips and the JSON are what a CPU machine can check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, provenance  # noqa: E402
from render import row_verdict  # noqa: E402

SKIPPED = 77
"""The exit status of a check that could not run here (the automake convention)."""
KERNEL_TESTS = "flashmla or flashinfer"
"""``pytest -k`` for the tests that name a backend, in the test's name or its parametrize id:
each runs that kernel and compares it with the reference, and skips where it is not usable."""
FAILING = ("failed", "timeout")


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    argv: tuple[str, ...]
    """Run with this interpreter: ``python <argv...>``, from the repository root."""
    timeout_s: int
    result: Path | None = None
    """The JSON a benchmark writes (rows as in ``benchmarks/common.py``): a row below its target
    makes the check ``missed``."""

    @property
    def is_pytest(self) -> bool:
        return self.argv[:2] == ("-m", "pytest")


def _pytest(*args: str) -> tuple[str, ...]:
    return ("-m", "pytest", *args, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider")


def checks(results: Path) -> list[Check]:
    """Every check, in the order they run."""
    kernels, pool = results / "kernels_gpu.json", results / "gpu_pool.json"
    return [
        Check(
            "backends",
            "the decode backends this machine can run (FlashMLA on SM90, FlashInfer on SM80+)",
            ("-c", "from tessera_ray.kernels import available_backends as a; print(a())"),
            30,
        ),
        Check(
            "kernels_vs_reference",
            "FlashMLA and FlashInfer against the float32 reference on bf16 pool pages "
            f"(tests/gpu -k '{KERNEL_TESTS}'; skipped when every one of them skips)",
            _pytest("tests/gpu", "-k", KERNEL_TESTS),
            90,
        ),
        Check(
            "gpu_tests",
            "the backend 'auto' picks (a kernel where one is usable, else the reference), "
            "partial decodes merged, the tiny model, the pool in device memory, and content "
            "hashes computed on the device against the host's "
            f"(tests/gpu -k 'not ({KERNEL_TESTS})', tests/core/test_pool_gpu.py)",
            _pytest("tests/gpu", "tests/core/test_pool_gpu.py", "-k", f"not ({KERNEL_TESTS})"),
            30,
        ),
        Check(
            "decode_bench",
            "decode over pool pages, each backend, and over the same pages laid out contiguously "
            "(target: pool within 5%) (bench_kernels --quick)",
            ("benchmarks/bench_kernels.py", "--quick", "--out", str(kernels)),
            60,
            kernels,
        ),
        Check(
            "gpu_pool",
            "a device pool's hash, seal, verify-on-arrival and verified fetch (same process, "
            "then NIXL VRAM to VRAM between two agents) against raw device copies (target: "
            "half their rate), every fetched byte compared",
            ("benchmarks/gpu_pool.py", "--quick", "--out", str(pool)),
            60,
            pool,
        ),
        Check(
            "engine",
            "vLLM on the GPU (a tiny DeepSeek-V2, eager and CUDA graphs): a second engine's "
            "tier hits equal vLLM's own prefix-cache hits, token and logprob",
            ("benchmarks/gpu_engine.py",),
            210,
        ),
    ]


@dataclass
class Outcome:
    name: str
    status: str
    """``ok``, ``failed``, ``timeout``, ``skipped`` or ``missed`` (the module docstring)."""
    seconds: float
    detail: str


def _cuda() -> str | None:
    """The device's name, or ``None`` when this interpreter's torch sees no CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _pytest_verdict(report: Path) -> tuple[str, str]:
    """Status and detail of a pytest run that exited 0, from its JUnit XML report.

    The XML rather than the terminal output: it is pytest's machine-readable interface, one
    ``testcase`` per test with a ``skipped`` child whose ``message`` is the reason ``-rs``
    prints, while the summary lines change with verbosity, plugins and pytest versions.
    """
    try:
        cases = list(ET.parse(report).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as e:
        return "failed", f"pytest wrote no readable report: {e}"
    reasons: Counter[str] = Counter()
    passed = 0
    for case in cases:
        skip = case.find("skipped")
        if skip is not None:
            reasons[skip.get("message") or "no reason given"] += 1
        elif case.find("failure") is None and case.find("error") is None:
            passed += 1
    why = "; ".join(f"{reason} ({n})" for reason, n in reasons.items())
    if passed == 0:
        return ("skipped", why) if reasons else ("failed", "no test ran")
    skips = f", {reasons.total()} skipped: {why}" if reasons else ""
    return "ok", f"{passed} passed{skips}"


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _rows_verdict(result: Path, before: tuple[int, int, int] | None) -> tuple[str, str]:
    """Status and detail of a benchmark that exited 0, from the result JSON it wrote."""
    # A file left by an earlier run must not pass for this run's result.
    if _stamp(result) in (None, before):
        return "failed", f"exited 0 but wrote no result to {result}"
    try:
        rows = json.loads(result.read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        return "failed", f"unreadable result {result}: {e!r}"
    # BENCHMARKS.md's verdict for the same row: an inconclusive row is not a miss.
    missed = [
        f"{r['name']} {r['ratio']:.3f} < {r['target_ratio']}"
        for r in rows
        if r.get("target_ratio") is not None and row_verdict(r) == "MISSED"
    ]
    absent = [r["name"] for r in rows if r.get("value") is None]
    tail = f"; not available: {', '.join(absent)}" if absent else ""
    if missed:
        return "missed", f"below target: {', '.join(missed)}{tail}"
    return "ok", f"{len(rows)} rows, no target missed{tail}"


def _run(check: Check, python: str) -> Outcome:
    began = time.monotonic()
    before = _stamp(check.result) if check.result else None
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        report = Path(tmp) / "junit.xml"
        extra = [f"--junitxml={report}"] if check.is_pytest else []
        try:
            done = subprocess.run(
                [python, *check.argv, *extra], cwd=ROOT, capture_output=True, text=True,
                timeout=check.timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return Outcome(check.name, "timeout", time.monotonic() - began, f"{check.timeout_s} s")
        tail = (done.stdout + done.stderr).strip().splitlines()
        status, detail = "ok", tail[-1] if tail else ""
        if done.returncode == SKIPPED:
            status = "skipped"
        elif done.returncode != 0:
            status = "failed"
        elif check.is_pytest:
            status, detail = _pytest_verdict(report)
        elif check.result is not None:
            status, detail = _rows_verdict(check.result, before)
    return Outcome(check.name, status, time.monotonic() - began, detail)


def _summary(outcomes: list[Outcome]) -> str:
    """``OK`` or ``FAILED <names>``, then the checks missed and skipped, which do not fail it."""
    failed = [o.name for o in outcomes if o.status in FAILING]
    parts = ["FAILED " + ", ".join(failed) if failed else "OK"]
    for status in ("missed", "skipped"):
        names = [o.name for o in outcomes if o.status == status]
        if names:
            parts.append(f"{status}: {', '.join(names)}")
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the checks, run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu.json")
    ns = parser.parse_args(argv)
    plan = checks(ns.out.parent)
    if ns.dry_run:
        for check in plan:
            print(f"{check.name}: {check.what} (limit {check.timeout_s} s)")
        return 0
    device = _cuda()
    outcomes = []
    for check in plan:
        if device is None:
            outcome = Outcome(check.name, "skipped", 0.0, "this python sees no CUDA device")
        else:
            outcome = _run(check, sys.executable)
        outcomes.append(outcome)
        print(f"{outcome.name}: {outcome.status} ({outcome.seconds:.0f} s) {outcome.detail}")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": device,
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **provenance("gpu"),
        "checks": [asdict(o) for o in outcomes],
    }
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"gpu_check: {_summary(outcomes)} -> {ns.out}")
    return 1 if any(o.status in FAILING for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
