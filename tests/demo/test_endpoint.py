"""The fleet through an OpenAI endpoint (``tessera_ray.demo.endpoint``), against a stand-in
client that answers like vLLM over the tier: each response's cached tokens are the longest run
of 64-token blocks it has seen before, the tier's share is what another "replica" computed."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tessera_ray.demo.endpoint import (
    TurnResult,
    as_json,
    compare,
    plot_rounds,
    render_comparison,
    render_round,
    render_rounds,
    render_router_choices,
    rounds_from_json,
    run_fleet,
    summarize,
)
from tessera_ray.demo.workload import DemoConfig
from tessera_ray.vllm.connector import TIER_SOURCES_PARAM, TIER_TOKENS_PARAM


class _Endpoint:
    """Two replicas taken in turn; a block one of them computed is a tier hit for the other."""

    def __init__(self) -> None:
        self.seen: list[dict[tuple[int, ...], int]] = [{}, {}]
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.completions = SimpleNamespace(create=self.create)

    def create(self, **kw: Any) -> Any:
        with self.lock:
            self.calls.append(kw)
            replica = len(self.calls) % 2
            tokens, own, tier = kw["prompt"].split(), 0, 0
            for end in range(64, len(tokens) + 1, 64):
                block = tuple(tokens[:end])
                if block in self.seen[replica]:
                    own = end
                elif block in self.seen[1 - replica]:
                    tier = end - own
                else:
                    break
            for end in range(64, len(tokens) + 1, 64):
                self.seen[replica][tuple(tokens[:end])] = 1
        return SimpleNamespace(
            usage=SimpleNamespace(
                prompt_tokens=len(tokens),
                prompt_tokens_details=SimpleNamespace(cached_tokens=own + tier),
            ),
            # The other "replica" is another node: the tier read it from that node's pool.
            kv_transfer_params={
                TIER_TOKENS_PARAM: tier,
                TIER_SOURCES_PARAM: {"local": 0, "remote": tier, "disk": 0},
            },
        )


def test_every_turn_is_sent_round_by_round_and_counted_from_the_answers(tmp_path: Path) -> None:
    config = DemoConfig(num_agents=6, num_rounds=3, num_documents=2)
    endpoint = _Endpoint()
    ended: list[list[TurnResult]] = []
    results = run_fleet(
        endpoint, "m", config, vocab_size=1000, concurrency=3, salt="run-1", on_round=ended.append
    )
    assert len(results) == len(endpoint.calls) == 18
    assert [[t.round for t in turns] for turns in ended] == [[r] * 6 for r in range(3)]
    assert all(
        c["max_tokens"] == 1 and c["extra_body"] == {"cache_salt": "run-1"} for c in endpoint.calls
    )
    rounds_sent = [results[i].round for i in range(18)]
    assert rounds_sent == sorted(rounds_sent)  # no turn of round r + 1 before round r ended
    first = results[0]
    assert first.cached_tokens == first.tier_tokens == 0
    assert first.computed_tokens == first.prompt_tokens
    rounds = summarize(results)
    assert [r.requests for r in rounds] == [6, 6, 6]
    for r in rounds:
        these = [t for t in results if t.round == r.round]
        assert r.computed_tokens == sum(t.prompt_tokens - t.cached_tokens for t in these)
        assert r.tier_tokens == sum(t.tier_tokens for t in these) == r.tier_remote
        assert r.prompt_tokens == r.computed_tokens + r.vllm_cache_tokens + r.tier_tokens
        assert r.first_token_p50_s <= r.first_token_p99_s
    # Shared system prompt and documents, growing conversations: later rounds compute less.
    assert rounds[2].computed_tokens < rounds[0].computed_tokens
    assert sum(r.tier_tokens for r in rounds) > 0
    report = json.loads(json.dumps(as_json(results)))
    assert rounds_from_json(report) == rounds
    table = render_rounds(rounds)
    assert len(table.splitlines()) == 4 and f"{rounds[0].prompt_tokens:,}" in table
    pytest.importorskip("matplotlib")
    plot_rounds(rounds, tmp_path / "rounds.png")
    assert (tmp_path / "rounds.png").read_bytes()[:4] == b"\x89PNG"


def test_router_choices_render_as_one_line_with_the_blocks_each_choice_held() -> None:
    line = render_router_choices(
        {
            "tier": 30, "routed": 12, "balanced": 6, "fallback": 0,
            "held_blocks": {"tier": 195, "routed": 30, "balanced": 0, "fallback": 0},
        }
    )  # fmt: skip
    assert line == (
        "router: 48 requests: tier 30 (6.5 blocks held each), routed 12 (2.5 blocks held each), "
        "balanced 6, fallback 0"
    )


def _turn(round_: int, prompt: int, cached: int, tier: dict[str, int]) -> TurnResult:
    return TurnResult(0, round_, 0, prompt, cached, sum(tier.values()), 0.1 * cached, tier)


def test_the_comparison_counts_the_rounds_after_the_first_and_says_what_the_tier_did() -> None:
    """Round 0 is cold in both runs and left out; the tier's share is of the prompt tokens not
    computed; every printed number is in the comparison's JSON."""
    none = {"local": 0, "remote": 0, "disk": 0}
    off = [_turn(0, 1000, 0, none), _turn(1, 1000, 400, none), _turn(2, 1000, 500, none)]
    on = [
        _turn(0, 1000, 0, none),
        _turn(1, 1000, 900, {"local": 300, "remote": 100, "disk": 50}),
        _turn(2, 1000, 950, {"local": 400, "remote": 0, "disk": 0}),
    ]
    c = json.loads(json.dumps(compare(off, on)))
    assert c["rounds"] == [1, 2]
    assert c["tier_off"]["computed_tokens"] == 1100 and c["tier_on"]["computed_tokens"] == 150
    assert c["tier_on"]["tier_tokens"] == 850 and c["tier_on"]["vllm_cache_tokens"] == 1000
    assert (c["tier_on"]["tier_local"], c["tier_on"]["tier_remote"]) == (700, 100)
    assert c["tier_share_of_reused"] == pytest.approx(850 / 1850)
    assert c["tier_share_met"] and c["fewer_computed"] and c["computed_saved"] == 950
    text = render_comparison(c)
    assert "46% of the prompt tokens not computed came from the tier" in text
    assert "target 25%: met" in text and "computed 150 prompt tokens instead of 1,100" in text
    for number in ("1,100", "1,000", "850", "700"):
        assert number in text
    worse = compare(
        off, [_turn(r, 1000, 100, {"local": 10, "remote": 0, "disk": 0}) for r in (1, 2)]
    )
    assert not worse["tier_share_met"] and not worse["fewer_computed"]
    assert "MISSED" in render_comparison(worse)


def test_a_round_renders_as_one_line_whose_parts_add_up() -> None:
    (s,) = summarize([_turn(1, 1000, 900, {"local": 300, "remote": 100, "disk": 50})])
    line = render_round("tier on", s)
    assert line.startswith("tier on round 1: prompt 1,000 = computed 100 + vLLM cache 450 + ")
    assert "tier 450 (local 300, remote 100, disk 50)" in line
