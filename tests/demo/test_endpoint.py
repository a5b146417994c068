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
    as_json,
    plot_rounds,
    render_rounds,
    render_router_choices,
    rounds_from_json,
    run_fleet,
    summarize,
)
from tessera_ray.demo.workload import DemoConfig
from tessera_ray.vllm.connector import TIER_TOKENS_PARAM


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
            kv_transfer_params={TIER_TOKENS_PARAM: tier},
        )


def test_every_turn_is_sent_round_by_round_and_counted_from_the_answers(tmp_path: Path) -> None:
    config = DemoConfig(num_agents=6, num_rounds=3, num_documents=2)
    endpoint = _Endpoint()
    results = run_fleet(endpoint, "m", config, vocab_size=1000, concurrency=3, salt="run-1")
    assert len(results) == len(endpoint.calls) == 18
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
        assert r.tier_tokens == sum(t.tier_tokens for t in these)
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


def test_router_choices_render_as_one_line() -> None:
    line = render_router_choices(
        {"tier": 30, "routed": 12, "balanced": 6, "fallback": 0, "local_blocks_mean": 7.25}
    )
    assert line == (
        "router: 48 requests (tier 30, routed 12, balanced 6, fallback 0); "
        "7.2 local blocks per choice"
    )
