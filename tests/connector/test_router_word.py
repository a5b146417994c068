"""The tier-aware router's word to the engine (:mod:`tessera_ray.vllm.router_word`): a request
whose first tier block the router found nowhere is not looked up again by the engine's
scheduler, within the word's time, for that key only, and never over this engine's own
stores."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from tessera_ray.core.results import TokenKey
from tessera_ray.vllm.records import NewScheduled
from tessera_ray.vllm.router_word import (
    ROUTER_MISS_PARAM,
    ROUTER_WORD_S,
    ROUTER_WORD_TAKEN_PARAM,
    router_missed,
    tell_miss,
)
from tessera_ray.vllm.scheduler import SchedulerPlanner
from tests.connector.test_connector_config import (
    _Clock,
    _Request,
    _store_saves,
    _Tier,
    _waiting_planner,
)

TOKENS = list(range(1, 201))


@dataclass
class _Routed(_Request):
    kv_transfer_params: dict[str, Any] | None = None


def _first_key(planner: SchedulerPlanner, tokens: list[int], salt: str | None = None) -> TokenKey:
    tracked = planner._track(_Request(f"probe-{salt}", tokens, salt))
    key = planner._keys(tracked, 1)[0]
    planner.finished(tracked.request.request_id)
    return key


def _word(key: TokenKey, **other: Any) -> dict[str, Any]:
    return {**other, ROUTER_MISS_PARAM: key.hex()}


def test_a_request_the_router_found_nowhere_is_not_looked_up_until_the_word_is_old() -> None:
    tier, clock = _Tier(), _Clock()
    planner = _waiting_planner(tier, clock)
    request = _Routed("a", TOKENS, kv_transfer_params=_word(_first_key(planner, TOKENS)))
    assert planner.matched_tokens(request, 0) == 0
    clock.now += ROUTER_WORD_S / 2  # still waiting to be scheduled: the word still stands
    assert planner.matched_tokens(request, 0) == 0
    assert tier.calls == 0 and planner.counters.take()["router_misses"] == 2  # type: ignore[index]
    supply = planner.finished("a")
    assert supply.router_word and supply.params()[ROUTER_WORD_TAKEN_PARAM] is True
    # A request that waits past the word's time is looked up: the tier may hold it by now.
    late = _Routed("b", TOKENS, kv_transfer_params=_word(_first_key(planner, TOKENS)))
    assert planner.matched_tokens(late, 0) == 0
    for key, h in zip(planner._keys(planner._track(late), 3), (1, 2, 3), strict=True):
        tier.held[("app", key)] = h  # type: ignore[assignment]
    clock.now += ROUTER_WORD_S
    assert planner.matched_tokens(late, 0) == 192 and tier.calls == 1
    assert ROUTER_WORD_TAKEN_PARAM not in planner.finished("c").params()


def test_the_word_counts_only_for_the_engines_own_first_key_and_a_first_ask() -> None:
    tier, clock = _Tier(), _Clock()
    planner = _waiting_planner(tier, clock)
    writer = _waiting_planner(tier, clock)  # another engine stored the prompt
    writer.matched_tokens(_Request("w", TOKENS), 0)
    _store_saves(tier, writer.build([NewScheduled("w", [1, 2, 3, 4], 0, 200)], []))
    # Another tenant's key (another salt), or a word that is not a key: the engine looks.
    other = _word(_first_key(planner, TOKENS, "tenant-b"))
    for params in (other, {ROUTER_MISS_PARAM: 7}, {"unrelated": 1}, None):
        request = _Routed(f"r{len(str(params))}", TOKENS, kv_transfer_params=params)
        assert planner.matched_tokens(request, 0) == 192
    # vLLM's own cache holds the first block: the word is about block 0 only, so the engine looks.
    held_here = _Routed("h", TOKENS, kv_transfer_params=_word(_first_key(planner, TOKENS)))
    assert planner.matched_tokens(held_here, 64) == 128
    assert not router_missed(None, TokenKey(b"k")) and router_missed(_word(b"k"), TokenKey(b"k"))  # type: ignore[arg-type]


def test_the_word_is_not_taken_over_blocks_this_engine_is_storing() -> None:
    """The router cannot see this engine's stores still on their way (nor routed there by
    another router): the engine waits for them as without a word."""
    tier, clock = _Tier(), _Clock()
    planner = _waiting_planner(tier, clock)
    planner.matched_tokens(_Request("a", TOKENS), 0)
    plan = planner.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], [])
    planner.finished("a")
    again = _Routed("b", TOKENS, kv_transfer_params=_word(_first_key(planner, TOKENS)))
    assert planner.matched_tokens(again, 0) is None  # asks again until the stores land
    _store_saves(tier, plan)
    clock.now += 0.05
    assert planner.matched_tokens(again, 0) == 192
    assert ROUTER_WORD_TAKEN_PARAM not in planner.finished("b").params()


def test_tell_miss_writes_the_word_beside_what_the_request_carries() -> None:
    key = TokenKey(bytes(range(32)))
    body: dict[str, Any] = {"prompt": [1], "kv_transfer_params": {"mine": 1}}
    assert tell_miss(body, key)
    assert body["kv_transfer_params"] == {"mine": 1, ROUTER_MISS_PARAM: key.hex()}
    model = SimpleNamespace(prompt=[1], kv_transfer_params=None)
    assert tell_miss(model, key) and router_missed(model.kv_transfer_params, key)
    bare = SimpleNamespace(prompt=[1])
    assert not tell_miss(bare, key) and not hasattr(bare, "kv_transfer_params")
