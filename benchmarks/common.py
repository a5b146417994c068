"""The benchmark contract every ``benchmarks/bench_*.py`` follows.

Each benchmark runs alone (``python benchmarks/bench_<name>.py [--quick] [--out FILE]``);
``--quick`` finishes within a minute on a 2-core machine. It writes one JSON document::

    {"benchmark": NAME, "machine": {...}, "command": "...", "quick": bool, "time": ISO,
     "commit": "git describe", "measures": [paths],
     "rows": [{"name", "value", "unit", "baseline", "baseline_value", "ratio", "target_ratio",
               "verdict", "derived", "derived_from"}]}

``commit`` is the checkout the run measured (``-dirty`` when a path it measures had uncommitted
changes) and ``measures`` the paths whose code the numbers depend on (``MEASURES``):
``benchmarks/results_check.py`` lists the results whose measured paths changed since.

A row whose system could not be installed or started has ``"value": null`` and a ``note``
starting ``"not available: "`` with the reason: a missing peer is reported, never estimated. A
document may list ``"plots"`` (PNG file names next to the JSON, which BENCHMARKS.md shows) and
``"versions"`` (system -> version, or why it is not available).

Ratios compare the tier against a baseline measured in the same run (memcpy, raw xxh3, raw
NIXL, ...), never against a number from another day. A row whose value or baseline is computed
from other figures rather than measured as such says what it is ``derived_from``. ``ratio`` is
value over baseline_value for throughputs; a row says so in its ``unit``. ``verdict`` is
``met``, ``MISSED``, ``inconclusive`` (the baseline's own spread here is wider than the target's
margin) or ``None`` without a target. ``make bench`` runs every benchmark and regenerates
BENCHMARKS.md from the JSON files (``benchmarks/render.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Row",
    "BenchArgs",
    "parse_args",
    "machine_info",
    "write_result",
    "time_median",
    "RESULTS_DIR",
    "NOT_AVAILABLE",
    "ENGINE_PYTHON",
    "needs_engine_venv",
    "MEASURES",
    "source_commit",
    "archived_commit",
    "spread",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ENGINE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-engine" / "bin" / "python"
"""vLLM's CPU build lives in its own virtualenv (``make test-engine`` creates it)."""
NOT_AVAILABLE = "not available: "
ROOT = Path(__file__).resolve().parents[1]

_TIER = (
    "tessera_ray/actors",
    "tessera_ray/core",
    "tessera_ray/layout",
    "tessera_ray/storage",
    "tessera_ray/transport",
    "tessera_ray/metrics.py",
    "tessera_ray/errors.py",
)
_ENGINE = (
    *_TIER,
    "tessera_ray/vllm",
    "tessera_ray/serve",
    "tessera_ray/models",
    "tests/engine/_harness.py",
    "tests/engine/_run_engine.py",
    "benchmarks/_peers.py",
)
MEASURES: dict[str, tuple[str, ...]] = {
    "baselines": (),
    "pool": ("tessera_ray/core", "tessera_ray/layout"),
    "disk": ("tessera_ray/storage", "tessera_ray/core", "tessera_ray/layout"),
    "directory": _TIER,
    "transport": _TIER,
    "connector": (*_TIER, "tessera_ray/vllm", "benchmarks/_engine_rows.py"),
    "peers": (*_TIER, "benchmarks/_peers.py", "benchmarks/_peer_sides.py"),
    "fleet": (*_TIER, "tessera_ray/demo", "tessera_ray/models", "benchmarks/_prefill.py"),
    "trace": (
        "tessera_ray/serve/routing.py",
        "tessera_ray/actors/directory.py",
        "tessera_ray/actors/_eviction.py",
        "tessera_ray/layout",
        "benchmarks/_trace_input.py",
        "benchmarks/_trace_routers.py",
        "benchmarks/_trace_sim.py",
        "benchmarks/_trace_tier.py",
        "benchmarks/profiles",
    ),
    "kernels": ("tessera_ray/kernels", "tessera_ray/layout", "tessera_ray/core"),
    "engine": (*_ENGINE, "benchmarks/_engine_rows.py"),
    "engine_v4": (
        *_ENGINE,
        "benchmarks/bench_engine.py",
        "benchmarks/_engine_rows.py",
        "tests/engine/v4_plugin",
    ),
    "engine_cpu": (*_ENGINE, "benchmarks/bench_engine.py", "tests/engine/_proc_cpu.py"),
    "serve": (
        *_ENGINE,
        "tessera_ray/demo",
        "tessera_ray/_loopback.py",
        "tessera_ray/metrics_scrape.py",
    ),
    "serve_idle": (
        *_ENGINE,
        "tessera_ray/demo",
        "tessera_ray/_loopback.py",
        "tessera_ray/_cli_demo.py",
        "tests/engine/_proc_cpu.py",
    ),
    "serve_client": (
        *_ENGINE,
        "tessera_ray/demo",
        "tessera_ray/_loopback.py",
        "tessera_ray/_cli_demo.py",
    ),
    "gpu_pool": _TIER,
    "gpu": (*_ENGINE, "tessera_ray/kernels", "tests/gpu", "tests/core/test_pool_gpu.py"),
}
"""Per benchmark, the paths (besides its own script and this module) whose code its numbers
depend on: the package modules it drives, in this process or in the engines and actors it
starts. ``results_check.py`` compares them with the commit a result recorded."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured figure, with the same-run baseline it is judged against."""

    name: str
    value: float | None
    """``None`` only for a row that could not be measured; ``note`` then says why."""
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    target_ratio: float | None = None
    """The ratio the tier aims for (e.g. 0.8 of memcpy); ``None`` where there is no target."""
    target_max: float | None = None
    """An upper bound on the value itself, in its unit, for a target stated as a most (e.g. at
    most 1% of a core more); a row has this or ``target_ratio``, not both."""
    note: str | None = None
    miss_reason: str | None = None
    """Why the target is missed, as found by measurement; added to the note only in a run
    where the ratio falls below the target."""
    derived_from: str | None = None
    """What the value or the baseline is computed from (other rows, or a figure subtracted),
    for a row that does not measure its comparison directly."""
    inconclusive: str | None = None
    """Set when the baseline's own spread on this machine is wider than the target's margin
    (the spread, in words): the target can be neither met nor missed here."""

    @property
    def verdict(self) -> str | None:
        if self.target_max is not None and self.value is not None:
            missed = self.value > self.target_max
        elif self.target_ratio is not None and self.ratio is not None:
            missed = self.ratio < self.target_ratio
        else:
            return None
        if self.inconclusive:
            return "inconclusive"
        return "MISSED" if missed else "met"

    @property
    def missed(self) -> bool:
        return self.verdict == "MISSED"

    @property
    def ratio(self) -> float | None:
        if self.value is None or self.baseline_value in (None, 0):
            return None
        return self.value / self.baseline_value

    @classmethod
    def unavailable(cls, name: str, unit: str, reason: str, **baseline: Any) -> Row:
        """A row for a system that is not there: no value, the reason in the note."""
        return cls(name=name, value=None, unit=unit, note=f"{NOT_AVAILABLE}{reason}", **baseline)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        out["verdict"] = self.verdict
        reason = out.pop("miss_reason")
        if reason and self.missed:
            out["note"] = f"{out['note']}; below target: {reason}" if out["note"] else reason
        if self.inconclusive and self.verdict == "inconclusive":
            why = f"inconclusive on this machine: {self.inconclusive}"
            out["note"] = f"{out['note']}; {why}" if out["note"] else why
        out["derived"] = self.derived_from is not None
        for key in ("note", "derived_from", "inconclusive", "target_max"):
            if out[key] is None:
                del out[key]
        return out


@dataclass(frozen=True)
class BenchArgs:
    quick: bool
    out: Path


def parse_args(benchmark: str, argv: list[str] | None = None) -> BenchArgs:
    parser = argparse.ArgumentParser(description=f"tessera-ray benchmark {benchmark}")
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR / f"{benchmark}.json", help="JSON result path"
    )
    ns = parser.parse_args(argv)
    return BenchArgs(quick=ns.quick, out=ns.out)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    info.update(_cpu_kind())
    return info


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
"""The vector extensions that pick vLLM's CPU kernels (and so what a CPU engine row measures)."""


def _cpu_kind() -> dict[str, Any]:
    """The CPU's model and which of ``_CPU_FLAGS`` it has (Linux), so rows from machines whose
    CPUs differ are not read as one another's."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in text.splitlines()[:40])
        if k.strip() in ("model name", "flags")
    )
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name", "?"),
        "cpu_flags": [f for f in _CPU_FLAGS if f in flags],
    }


def write_result(
    benchmark: str,
    args: BenchArgs,
    rows: list[Row],
    *,
    plots: list[str] | None = None,
    versions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write the contract JSON to ``args.out`` and print a short table; returns the document.
    ``plots``: PNG file names already written next to ``args.out``; ``versions``: what each
    compared system ran as (or why it did not run)."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else f"bench_{benchmark}.py"
    doc = {
        "benchmark": benchmark,
        "machine": machine_info(),
        "command": f"python benchmarks/{script}" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [r.to_json() for r in rows],
    }
    if plots:
        doc["plots"] = plots
    if versions:
        doc["versions"] = versions
    doc.update(provenance(benchmark))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in rows:
        ratio = f"  x{r.ratio:.3f} of {r.baseline}" if r.ratio is not None else ""
        value = f"{r.value:>14.4g}" if r.value is not None else f"{'-':>14}"
        why = f"  {r.note}" if r.value is None else ""
        print(f"{r.name:<28} {value} {r.unit:<10}{ratio}{why}")
    print(f"wrote {args.out}")
    return doc


def measured_paths(benchmark: str) -> list[str]:
    """What a result of ``benchmark`` depends on: ``MEASURES`` (a ``KeyError`` names a
    benchmark missing there), its own script and this module."""
    script = {"gpu": "gpu_check.py", "gpu_pool": "gpu_pool.py"}.get(
        benchmark, f"bench_{benchmark}.py"
    )
    return [f"benchmarks/{script}", "benchmarks/common.py", *MEASURES[benchmark]]


def archived_commit(root: Path = ROOT) -> str | None:
    """The commit an unpacked ``git archive`` of this repository was made from (the GPU
    bundle's checkout: ``benchmarks/gpu_bundle.sh``), ``None`` in a clone. ``git archive``
    writes it into ``benchmarks/archive_commit.txt`` (``export-subst`` in .gitattributes)."""
    try:
        text = (root / "benchmarks" / "archive_commit.txt").read_text().strip()
    except OSError:
        return None
    return None if text.startswith("$Format") else text[:12]


def source_commit(paths: list[str], root: Path = ROOT) -> str | None:
    """``git describe --always`` of the checkout, ``-dirty`` when any of ``paths`` has changes
    not committed (untracked files under them included): the code a run measured. Changes
    elsewhere (results written by an earlier benchmark of the same ``make bench``) do not
    count. In an unpacked archive, the commit it was made from (even where the archive lies
    inside some other git checkout); ``None`` outside both."""
    archived = archived_commit(root)
    if archived is not None:
        return archived

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=root, capture_output=True, text=True, check=True, timeout=30
        )
        return done.stdout.strip()

    try:
        commit = git("describe", "--always", "--abbrev=12")
        dirty = git("status", "--porcelain", "--untracked-files=all", "--", *paths)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def provenance(benchmark: str) -> dict[str, Any]:
    """The fields that tie a result to the code it measured: ``commit``, ``measures``."""
    paths = measured_paths(benchmark)
    return {"commit": source_commit(paths), "measures": paths}


def spread(samples: list[float]) -> float:
    """(max - min) / median: how far apart the runs of one configuration landed."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def time_median(fn: Callable[[], object], *, repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` untimed runs.

    The median, not the minimum: on a shared 2-core machine the minimum rewards lucky runs.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def start_local_ray(
    *, object_store_bytes: int | None = None, pythonpath: tuple[str, ...] = ()
) -> None:
    """An embedded Ray for one benchmark: 2 CPUs, every address on 127.0.0.1, no dashboard.
    Workers skip UCX's IB module (it can crash a process at exit here, docs/reference.md) and get
    ``pythonpath`` when they import the repository's or this folder's modules by name."""
    import ray

    env = {"UCX_MODULES": "^ib"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        object_store_memory=object_store_bytes,
        runtime_env={"env_vars": env},
    )


def needs_engine_venv() -> bool:
    """For a benchmark of real vLLM engines: ``True`` where vLLM imports; otherwise re-run this
    script in ``.venv-engine`` (once: never loops) or, where there is none, ``False``."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return True
    if ENGINE_PYTHON.exists() and not os.environ.get("TESSERA_BENCH_ENGINE_VENV"):
        os.environ["TESSERA_BENCH_ENGINE_VENV"] = "1"
        os.execv(str(ENGINE_PYTHON), [str(ENGINE_PYTHON), *sys.argv])
    return False
