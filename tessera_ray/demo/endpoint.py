"""The agent fleet through an OpenAI-compatible endpoint (a Ray Serve LLM app over the tier):
every turn of :class:`~tessera_ray.demo.workload.Fleet` sent as a text prompt (one tokenizer
word per workload token), round after round, the agents of a round at once. No Ray here: the
endpoint may run anywhere.

Each turn asks for one token, so its wall time is its first-token time; what it computed and
what the tier supplied come from the response itself (``usage``'s cached prompt tokens and
``kv_transfer_params``' tier tokens), not from estimates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera_ray.demo.workload import DemoConfig, Fleet, Request
from tessera_ray.models.hf_tiny import TOKENIZER_WORDS
from tessera_ray.vllm.backend import SOURCES
from tessera_ray.vllm.scheduler import TIER_SOURCES_PARAM, TIER_TOKENS_PARAM

__all__ = [
    "TurnResult",
    "RoundSummary",
    "run_fleet",
    "summarize",
    "render_rounds",
    "render_router_choices",
    "render_round",
    "token_split",
    "render_comparison",
    "compare",
    "as_json",
    "rounds_from_json",
    "plot_rounds",
    "prompt_text",
    "time_cold_prompts",
    "quantile",
]


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One agent turn as the endpoint answered it."""

    index: int
    round: int
    agent: int
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens not computed: vLLM's own prefix cache and the tier together."""
    tier_tokens: int
    """Of those, the ones the tier supplied."""
    first_token_s: float
    tier_sources: dict[str, int] = field(default_factory=dict)
    """``tier_tokens`` by where the tier read them (``local``: the replica's node's pool,
    ``remote``: another node's pool, ``disk``), as the connector reported them."""

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class RoundSummary:
    round: int
    requests: int
    prompt_tokens: int
    computed_tokens: int
    tier_tokens: int
    first_token_p50_s: float
    first_token_p99_s: float
    vllm_cache_tokens: int = 0
    """Prompt tokens vLLM's own prefix cache held (neither computed nor from the tier)."""
    tier_local: int = 0
    tier_remote: int = 0
    tier_disk: int = 0


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``: the value at rank ``int(q * n)`` of the sorted list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompt_text(tokens: Sequence[int]) -> str:
    """A turn's prompt as text, one word of the tiny models' tokenizer per workload token.
    Text, not token ids: Ray's prefix-affinity router reads prompts as text. Equal token
    prefixes give equal text prefixes, and the tokenizer splits at spaces, so they tokenize to
    equal token prefixes too."""
    return " ".join(TOKENIZER_WORDS[t % len(TOKENIZER_WORDS)] for t in tokens)


def _turn(client: Any, model: str, request: Request, salt: str | None) -> TurnResult:
    extra: dict[str, Any] = {"cache_salt": salt} if salt else {}
    t0 = time.perf_counter()
    r = client.completions.create(
        model=model,
        prompt=prompt_text(request.tokens.tolist()),
        max_tokens=1,
        temperature=0.0,
        extra_body=extra,
    )
    elapsed = time.perf_counter() - t0
    details = r.usage.prompt_tokens_details
    params = getattr(r, "kv_transfer_params", None) or {}
    sources = params.get(TIER_SOURCES_PARAM) or {}
    return TurnResult(
        index=request.index,
        round=request.round,
        agent=request.agent,
        prompt_tokens=r.usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
        tier_tokens=int(params.get(TIER_TOKENS_PARAM, 0)),
        first_token_s=elapsed,
        tier_sources={k: int(sources.get(k, 0)) for k in SOURCES},
    )


def run_fleet(
    client: Any,
    model: str,
    config: DemoConfig,
    *,
    vocab_size: int,
    concurrency: int = 4,
    salt: str | None = None,
    on_round: Callable[[list[TurnResult]], None] | None = None,
) -> list[TurnResult]:
    """Every turn of the fleet ``config`` describes, through ``client`` (an ``openai.OpenAI``).
    Rounds run in order (a conversation grows by one question a round); the turns of a round
    run ``concurrency`` at a time. ``salt``: the ``cache_salt`` of every turn (a fresh one makes
    a run independent of what earlier runs left in the tier and in vLLM's caches).
    ``on_round``: called with each round's turns once it ended."""
    # Block size only shapes the prompts (64-token blocks of the tier); pools are the router's.
    fleet = Fleet(config, vocab_size=vocab_size, block_tokens=64, num_pools=1)
    requests = fleet.requests()
    out: list[TurnResult] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for r in range(config.num_rounds):
            turns = [q for q in requests if q.round == r]
            done = list(pool.map(lambda q: _turn(client, model, q, salt), turns))
            out += done
            if on_round is not None:
                on_round(done)
    return out


def time_cold_prompts(
    client: Any, model: str, lengths: Sequence[int], *, vocab_size: int, repeats: int = 2
) -> list[dict[str, Any]]:
    """One at a time, prompts of ``lengths`` workload tokens (words of the prompt text) that
    nothing has cached (a fresh ``cache_salt`` each): what a prefill of that length costs end to
    end here, and how many engine tokens the text became (``bench_serve.py`` fits its profile
    to them)."""
    import random

    rng = random.Random(7)
    out = []
    for i in range(repeats):
        for n in lengths:
            tokens = [rng.randrange(vocab_size) for _ in range(n)]
            request = Request(i, 0, 0, 0, 0, torch.tensor(tokens))
            got = _turn(client, model, request, f"calibrate-{i}-{n}-{rng.random()}")
            out.append(
                {
                    "words": n,
                    "prompt_tokens": got.prompt_tokens,
                    "cached_tokens": got.cached_tokens,
                    "first_token_s": got.first_token_s,
                }
            )
    return out


def token_split(turns: Sequence[TurnResult]) -> dict[str, int]:
    """Where the prompt tokens of ``turns`` came from: computed, vLLM's own cache, the tier,
    and the tier's part by source (``tier_local``, ``tier_remote``, ``tier_disk``)."""
    tier = sum(t.tier_tokens for t in turns)
    return {
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "computed_tokens": sum(t.computed_tokens for t in turns),
        "vllm_cache_tokens": sum(t.cached_tokens for t in turns) - tier,
        "tier_tokens": tier,
        **{f"tier_{k}": sum(t.tier_sources.get(k, 0) for t in turns) for k in SOURCES},
    }


def summarize(results: Sequence[TurnResult]) -> list[RoundSummary]:
    rounds = sorted({r.round for r in results})
    out = []
    for n in rounds:
        these = [r for r in results if r.round == n]
        times = [r.first_token_s for r in these]
        out.append(
            RoundSummary(
                round=n,
                requests=len(these),
                first_token_p50_s=statistics.median(times),
                first_token_p99_s=quantile(times, 0.99),
                **token_split(these),
            )
        )
    return out


def render_rounds(rounds: Sequence[RoundSummary]) -> str:
    """A table of the rounds: tokens asked, computed and supplied by the tier, first-token
    times."""
    header = f"{'round':>5}  {'turns':>5}  {'prompt':>8}  {'computed':>8}  {'tier':>8}  "
    header += f"{'ttft p50':>9}  {'ttft p99':>9}"
    lines = [header]
    for s in rounds:
        lines.append(
            f"{s.round:>5}  {s.requests:>5}  {s.prompt_tokens:>8,}  {s.computed_tokens:>8,}  "
            f"{s.tier_tokens:>8,}  {s.first_token_p50_s * 1e3:>7.0f}ms  "
            f"{s.first_token_p99_s * 1e3:>7.0f}ms"
        )
    return "\n".join(lines)


def render_round(label: str, s: RoundSummary) -> str:
    """One round on one line: where its prompt tokens came from, and first-token time."""
    return (
        f"{label} round {s.round}: prompt {s.prompt_tokens:,} = computed {s.computed_tokens:,}"
        f" + vLLM cache {s.vllm_cache_tokens:,} + tier {s.tier_tokens:,} (local "
        f"{s.tier_local:,}, remote {s.tier_remote:,}, disk {s.tier_disk:,}); "
        f"ttft p50 {s.first_token_p50_s * 1e3:.0f} ms"
    )


def _split(turns: Sequence[TurnResult]) -> dict[str, Any]:
    return {
        "turns": len(turns),
        **token_split(turns),
        "first_token_p50_s": statistics.median(t.first_token_s for t in turns) if turns else 0.0,
    }


TIER_SHARE_TARGET = 0.25
"""Of the prompt tokens not computed after the first round, the share the tier must supply
(issue 44's acceptance)."""


def compare(off: Sequence[TurnResult], on: Sequence[TurnResult]) -> dict[str, Any]:
    """The same fleet without and with the tier, over the rounds after the first (the first is
    cold in both): each run's split of the prompt tokens, the tier's share of the tokens not
    computed, and whether the tier computed fewer."""
    later_off = [t for t in off if t.round > 0]
    later_on = [t for t in on if t.round > 0]
    a, b = _split(later_off), _split(later_on)
    reused = b["prompt_tokens"] - b["computed_tokens"]
    share = b["tier_tokens"] / reused if reused else 0.0
    return {
        "rounds": sorted({t.round for t in later_on}),
        "tier_off": a,
        "tier_on": b,
        "tier_share_of_reused": share,
        "tier_share_target": TIER_SHARE_TARGET,
        "computed_saved": a["computed_tokens"] - b["computed_tokens"],
        "tier_share_met": share >= TIER_SHARE_TARGET,
        "fewer_computed": b["computed_tokens"] < a["computed_tokens"],
    }


def render_comparison(c: dict[str, Any]) -> str:
    """The tier-off / tier-on table and its verdict (every number from :func:`compare`)."""
    rounds = c["rounds"]
    span = f"rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else f"round {rounds[0]}"
    lines = [
        f"{span} (round 0 is cold in both):",
        f"{'':9}{'prompt':>9}{'computed':>10}{'vLLM cache':>12}{'tier':>9}"
        f"{'local':>9}{'remote':>8}{'disk':>7}{'ttft p50':>10}",
    ]
    for label in ("tier_off", "tier_on"):
        r = c[label]
        lines.append(
            f"{label.replace('_', ' '):9}{r['prompt_tokens']:>9,}{r['computed_tokens']:>10,}"
            f"{r['vllm_cache_tokens']:>12,}{r['tier_tokens']:>9,}{r['tier_local']:>9,}"
            f"{r['tier_remote']:>8,}{r['tier_disk']:>7,}{r['first_token_p50_s'] * 1e3:>7.0f} ms"
        )
    off, on = c["tier_off"]["computed_tokens"], c["tier_on"]["computed_tokens"]
    saved = f"{c['computed_saved'] / off:.0%}" if off else "n/a"
    lines.append(
        f"with the tier: {c['tier_share_of_reused']:.0%} of the prompt tokens not computed came "
        f"from the tier (target {c['tier_share_target']:.0%}: "
        f"{'met' if c['tier_share_met'] else 'MISSED'}); computed {on:,} prompt tokens "
        f"instead of {off:,} ({saved} fewer)"
    )
    return "\n".join(lines)


def render_router_choices(choices: dict[str, Any]) -> str:
    """One line: the tier-aware router's requests per reason (``tier``: the directory placed
    the prefix; ``routed``: the router's memory of where it sent it did; ``balanced``: no
    replica held any of it; ``fallback``: the tier did not answer), and for the first two the
    leading blocks the chosen replica's pool held, per request (the router's own count)."""
    reasons = [k for k in ("tier", "routed", "balanced", "fallback") if k in choices]
    held = choices.get("held_blocks", {})
    parts = []
    for k in reasons:
        n = int(choices[k])
        part = f"{k} {n}"
        if k in ("tier", "routed") and n:
            part += f" ({held.get(k, 0) / n:.1f} blocks held each)"
        parts.append(part)
    routed = sum(int(choices[k]) for k in reasons)
    return f"router: {routed} requests: " + ", ".join(parts)


def as_json(results: Sequence[TurnResult]) -> dict[str, Any]:
    return {
        "turns": [asdict(r) for r in results],
        "rounds": [asdict(s) for s in summarize(results)],
    }


def rounds_from_json(report: dict[str, Any]) -> list[RoundSummary]:
    return [RoundSummary(**r) for r in report["rounds"]]


def plot_rounds(rounds: Sequence[RoundSummary], path: Path) -> None:
    """Per round: prompt tokens computed and supplied by the tier, and first-token times."""
    from tessera_ray._plot import pyplot

    plt = pyplot()
    fig, (tokens, times) = plt.subplots(1, 2, figsize=(10, 4))
    x = [s.round for s in rounds]
    computed = [s.computed_tokens for s in rounds]
    tier = [s.tier_tokens for s in rounds]
    own = [s.prompt_tokens - c - t for s, c, t in zip(rounds, computed, tier, strict=True)]
    tokens.bar(x, computed, label="computed")
    tokens.bar(x, tier, bottom=computed, label="from the tier")
    tokens.bar(
        x,
        own,
        bottom=[c + t for c, t in zip(computed, tier, strict=True)],
        label="vLLM's own cache",
    )
    tokens.set_xlabel("round")
    tokens.set_ylabel("prompt tokens")
    tokens.legend()
    times.plot(x, [s.first_token_p50_s * 1e3 for s in rounds], marker="o", label="p50")
    times.plot(x, [s.first_token_p99_s * 1e3 for s in rounds], marker="o", label="p99")
    times.set_xlabel("round")
    times.set_ylabel("first-token time (ms)")
    times.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
