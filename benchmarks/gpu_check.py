"""The GPU validation in one run: each check prints one line and lands in ``gpu.json``.

    python benchmarks/gpu_check.py             # on a CUDA machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --dry-run   # list the checks, run nothing

Checks run in order, each in its own process with its own time limit, so one that hangs or
crashes cannot take the others down. A check that exits 77 skipped itself (what it needs is not
installed: its last line says what). Without a CUDA device every check is reported skipped
(and the run exits 0): the list, the skips and the JSON are what a CPU machine can check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info  # noqa: E402

SKIPPED = 77
"""The exit status of a check that could not run here (the automake convention)."""


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    argv: tuple[str, ...]
    """Run with this interpreter: ``python <argv...>``, from the repository root."""
    timeout_s: int


def checks(results: Path) -> list[Check]:
    """Every check, in the order they run."""
    return [
        Check(
            "backends",
            "the decode backends this machine can run (FlashMLA on SM90, FlashInfer on SM80+)",
            ("-c", "from tessera_ray.kernels import available_backends as a; print(a())"),
            30,
        ),
        Check(
            "kernels_vs_reference",
            "FlashMLA and FlashInfer against the float32 reference on bf16 pool pages (tests/gpu)",
            ("-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"),
            120,
        ),
        Check(
            "decode_bench",
            "decode over pool pages, each backend, and over the same pages laid out contiguously "
            "(target: pool within 5%) (bench_kernels --quick)",
            ("benchmarks/bench_kernels.py", "--quick", "--out", str(results / "kernels_gpu.json")),
            60,
        ),
        Check(
            "gpu_pool",
            "a device pool's seal and verified fetch (same process, then NIXL VRAM to VRAM "
            "between two agents) against raw device copies, every fetched byte compared",
            ("benchmarks/gpu_pool.py", "--quick", "--out", str(results / "gpu_pool.json")),
            60,
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
    """``ok``, ``failed``, ``timeout`` or ``skipped``."""
    seconds: float
    detail: str


def _cuda() -> str | None:
    """The device's name, or ``None`` when this interpreter's torch sees no CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _run(check: Check, python: str) -> Outcome:
    began = time.monotonic()
    try:
        done = subprocess.run(
            [python, *check.argv], cwd=ROOT, capture_output=True, text=True,
            timeout=check.timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Outcome(check.name, "timeout", time.monotonic() - began, f"{check.timeout_s} s")
    tail = (done.stdout + done.stderr).strip().splitlines()
    status = {0: "ok", SKIPPED: "skipped"}.get(done.returncode, "failed")
    return Outcome(check.name, status, time.monotonic() - began, tail[-1] if tail else "")


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
    doc = {"device": device, "machine": machine_info(), "checks": [asdict(o) for o in outcomes]}
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [o.name for o in outcomes if o.status in ("failed", "timeout")]
    print(f"gpu_check: {'FAILED ' + ', '.join(failed) if failed else 'OK'} -> {ns.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
