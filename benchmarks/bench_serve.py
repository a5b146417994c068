"""The agent fleet through Ray Serve LLM over the tier, under three request routers, in one run:
power-of-two choices (Serve's default), Ray's ``PrefixCacheAffinityRouter``, and the tier-aware
``TesseraRequestRouter``. Each router gets a fresh embedded Ray, tier and app
(``tessera_ray.demo.serve_demo``: two vLLM replicas of a tiny Qwen2, vLLM's CPU build here) and
the same fleet (shared system prompt and documents, per-agent preambles, growing
conversations; every turn asks for one token, so its wall time is its first-token time).

Rows per router: first-token time p50 and p99, prompt tokens computed, the tier's share of the
prompt tokens, bytes moved between pools; for the tier-aware router, its own count of choices
per reason (scraped from its metrics), a fourth run with its memory of routed blocks off (the
directory alone) and a fifth that never spreads a hot prefix (as Ray's router). The tier-aware
router's rows compare against the better of the other two in the same run; target: fewer
tokens computed and a lower p50 first-token time than both. Needs vLLM, pyarrow and openai
(``.venv-engine``)::

    .venv-engine/bin/python benchmarks/bench_serve.py [--quick]

The fleet simulator (``bench_trace.py``) is checked against these runs: a profile is fitted
to cold prompts timed one at a time in the first run, and the simulator replays the same
workload under each router (``_serve_sim.py``); ``simulator_vs_real_*`` rows put its
prediction of tokens computed (target: within 10%) and TTFT p50 (within 30%) beside what the
engines did.

``--quick``: 6 agents, 2 rounds (still five engine starts: minutes, not one).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("UCX_MODULES", "^ib")  # single host: no RDMA (see bench_fleet.py)
from tessera_ray._loopback import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # simulated nodes; before anything imports Ray

from common import Row, needs_engine_venv, parse_args, write_result  # noqa: E402

from tessera_ray.demo.workload import DemoConfig  # noqa: E402

RUNS: dict[str, tuple[str, dict[str, Any]]] = {  # run name -> (router, router settings)
    "power_of_two": ("power_of_two", {}),
    "prefix_affinity": ("prefix_affinity", {}),
    "tessera": ("tessera", {}),
    # The directory alone: what the memory of routed blocks is worth.
    "tessera_directory_only": ("tessera", {"routed_memory_s": 0.0}),
    # Never spreading a hot prefix, as Ray's prefix-affinity router by default (its
    # imbalanced_threshold is infinite): tokens computed at the same balance policy.
    "tessera_no_spread": ("tessera", {"max_queue_gap": 1 << 20, "max_token_gap": 1 << 40}),
}
OTHERS = ("power_of_two", "prefix_affinity")
CALIBRATE = (64, 256, 512, 1024)  # cold prompt lengths (words) timed for the simulator's profile
TRANSFER_GB_S = 2.0  # NIXL between two processes on this kind of VM (bench_transport's order)
REASONS = ("tier", "routed", "balanced", "fallback")


def _measure(
    router: str, settings: dict[str, Any], fleet: DemoConfig, calibrate: tuple[int, ...] = ()
) -> dict[str, Any]:
    from tessera_ray.demo.endpoint import quantile
    from tessera_ray.demo.serve_demo import EngineDemoConfig, run_engine_demo

    report = run_engine_demo(
        EngineDemoConfig(fleet=fleet, router=router, router_settings=settings, calibrate=calibrate)
    )
    turns = report["turns"]
    times = [t["first_token_s"] for t in turns]
    prompt = sum(t["prompt_tokens"] for t in turns)
    return {
        "ttft_p50_ms": 1e3 * quantile(times, 0.5),
        "ttft_p99_ms": 1e3 * quantile(times, 0.99),
        "tokens_computed": sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns),
        "tier_share": sum(t["tier_tokens"] for t in turns) / prompt,
        "bytes_moved": sum(p.get("bytes_in", 0) for p in report["tier"]["pools"]),
        "start_s": report["start_s"],
        "choices": report.get("router_choices"),
        "report": report,
    }


def simulator_rows(fleet: DemoConfig, got: dict[str, dict[str, Any]]) -> list[Row]:
    """The fleet simulator's prediction of each router's run from a profile fitted to cold
    prefills timed in the first run, beside what the engines did (``_serve_sim.py``)."""
    from _serve_sim import SIM_ROUTERS, fit_profile, predict
    from transformers import AutoTokenizer

    from tessera_ray.models.hf_tiny import write_tokenizer

    first = got["power_of_two"]["report"]
    profile = fit_profile(
        first["calibration"],
        kv_bytes_per_token=first["kv_bytes_per_token"],
        engine_cache_tokens=first["engine_cache_bytes"] // first["kv_bytes_per_token"],
        pool_bytes_per_node=first["pool_blocks"] * first["block_bytes"],
        transfer_gb_s=TRANSFER_GB_S,
    )
    with tempfile.TemporaryDirectory() as tmp:  # the deployed model's tokenizer, rebuilt
        tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(Path(tmp)))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    fitted = (
        f"profile fitted to {len(first['calibration'])} cold prompts: "
        f"{1e3 * profile.request_overhead_s:.0f} ms outside the engine, "
        f"{1e6 * profile.prefill_s_per_token:.0f} us per token, "
        f"{1e9 * profile.attention_s_per_pair:.1f} ns per token pair"
    )
    rows = []
    for run in SIM_ROUTERS:
        sim = predict(fleet, profile, run, encode=encode)
        real = got[run]
        pairs = (
            ("tokens_computed", float(sim.computed_tokens), float(real["tokens_computed"]), 0.9),
            ("ttft_p50_ms", 1e3 * sim.ttft(0.5), real["ttft_p50_ms"], 0.7),
        )
        for name, predicted, measured, target in pairs:
            # Smaller over larger: 1 is exact, the target is the tolerance.
            low, high = sorted((predicted, measured))
            rows.append(
                Row(
                    name=f"simulator_vs_real_{run}_{name}",
                    value=low,
                    unit=f"{name} (smaller / larger of predicted, measured)",
                    baseline="the larger",
                    baseline_value=high,
                    target_ratio=target,
                    note=f"predicted {predicted:,.0f}, measured {measured:,.0f}; {fitted}",
                    derived_from="the simulator's replay and this run's row",
                    miss_reason=(
                        "the simulator gives each replica a core of its own; here two engines, "
                        "Serve's proxy, the router and the client share 2 cores"
                    ),
                )
            )
    return rows


def _choices(got: dict[str, Any]) -> str:
    c = got["choices"] or {}
    return ", ".join(f"{k} {c.get(k, 0)}" for k in REASONS)


def miss_reason(got: dict[str, dict[str, Any]]) -> str:
    """Why the tier-aware router did not beat both others, from the run's own counts."""
    return (
        f"router choices with the routed-block memory: {_choices(got['tessera'])}; directory "
        f"only: {_choices(got['tessera_directory_only'])} (the turns sharing a prefix arrive "
        "before its first prefill is stored, and with the directory alone the router balances "
        "them); the rest: the tier-aware router spreads a prefix once its replica's queue is 2 "
        "deeper than the shortest and Ray's prefix-affinity router never does, while here both "
        "simulated nodes share the machine's 2 cores, so a spread request adds no compute, only "
        "a second prefill of a prefix not yet stored; never spreading, the tier-aware router "
        f"computed {got['tessera_no_spread']['tokens_computed']:,} tokens, Ray's router "
        f"{got['prefix_affinity']['tokens_computed']:,}"
    )


def main() -> None:
    args = parse_args("serve")
    fleet = (
        DemoConfig(num_agents=6, num_rounds=2, ray_namespace="bench-serve")
        if args.quick
        else DemoConfig(num_agents=16, num_rounds=3, ray_namespace="bench-serve")
    )
    try:
        if not needs_engine_venv():
            raise ImportError("vLLM's CPU build is not installed (make test-engine creates it)")
        import openai  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        write_result("serve", args, [Row.unavailable("serve_fleet", "ms", str(exc))])
        return
    got = {
        run: _measure(router, settings, fleet, CALIBRATE if run == "power_of_two" else ())
        for run, (router, settings) in RUNS.items()
    }
    rows: list[Row] = []
    units = {
        "ttft_p50_ms": "ms",
        "ttft_p99_ms": "ms",
        "tokens_computed": "tokens",
        "tier_share": "fraction",
        "bytes_moved": "bytes",
    }
    for run, (router, _) in RUNS.items():
        for name, unit in units.items():
            rows.append(Row(name=f"{run}_{name}", value=got[run][name], unit=unit))
        if router == "tessera":
            choices = got[run]["choices"] or {}
            for reason in REASONS:
                rows.append(
                    Row(
                        name=f"{run}_route_{reason}",
                        value=choices.get(reason, 0),
                        unit="requests",
                        note="the router's own count (tessera_route_requests), scraped",
                    )
                )
    ours = got["tessera"]
    # Why a target was missed in a run where it was, from the run's own counts.
    reason = miss_reason(got)
    for name in ("tokens_computed", "ttft_p50_ms"):
        best = min(OTHERS, key=lambda r: got[r][name])
        # Lower is better: the row is the best other router over ours (above 1: ours is lower).
        rows.append(
            Row(
                name=f"tessera_{name}_gain",
                value=got[best][name],
                unit=f"{units[name]} ({best} over tessera; >1 better)",
                baseline=f"tessera_{name}",
                baseline_value=ours[name],
                target_ratio=1.0001,
                derived_from=f"{best}_{name} and tessera_{name}",
                miss_reason=reason,
            )
        )
    rows += simulator_rows(fleet, got)
    write_result(
        "serve",
        args,
        rows,
        versions={r: f"engine start {got[r]['start_s']:.0f} s" for r in RUNS},
    )


if __name__ == "__main__":
    main()
