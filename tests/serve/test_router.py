"""The Serve request router around the routing rule: the keys it computes are the connector's,
its choice follows the directory's answer, and it keeps routing (counted) when the tier is
silent. Serve's real ``RequestRouter`` base class, replicas and tier stood in for."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve._private.request_router.common import PendingRequest

from tessera_ray.actors.client import POOL_PREFIX, TesseraClient
from tessera_ray.actors.directory import LookupResult, Replica, Tier
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryUnavailableError, TierConfigError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.serve.router import TesseraRequestRouter, request_prompt
from tessera_ray.serve.routing import RouteChoice, RouteReason
from tessera_ray.vllm.keys import prompt_keys
from tessera_ray.vllm.router_word import ROUTER_MISS_PARAM
from tessera_ray.vllm.scheduler import SchedulerPlanner
from tests.conftest import SimCluster

LAYOUT = build_layout(MLAConfig(name="router-mla", num_layers=2, num_heads=4))
NODES = ("a" * 28 + "0001", "b" * 28 + "0002")


@dataclass
class _Replica:
    replica_id: str
    node_id: str
    max_ongoing_requests: int = 8


class _FakeTier:
    """Pools on the two nodes; ``held`` maps a key to the pools holding it in memory."""

    def __init__(self) -> None:
        self.layout = LAYOUT
        self.pools = [f"{POOL_PREFIX}{n[:12]}-0" for n in NODES]
        self.held: dict[TokenKey, list[str]] = {}
        self.down = False
        self.lookups = 0

    node_pool = TesseraClient.node_pool  # the client's own node-to-pool rule

    async def alookup(self, namespace: str, keys: list[TokenKey], *, strict: bool = False) -> Any:
        self.lookups += 1
        if self.down:
            raise DirectoryUnavailableError("directory shard 0: killed")
        return [
            LookupResult(k, BlockHash(1), tuple(Replica(p, Tier.MEMORY, 0, 1) for p in pools))
            if (pools := self.held.get(k))
            else None
            for k in keys
        ]


def _router(tier: _FakeTier, **kwargs: Any) -> TesseraRequestRouter:
    router = TesseraRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    settings = {"model_name": "m", "client": tier, "seed": 1, **kwargs}
    router.initialize_state(**settings)
    return router


def _pending(body: Any, request_id: str | None = None) -> PendingRequest:
    metadata = SimpleNamespace(internal_request_id=request_id)
    return SimpleNamespace(args=[body], kwargs={}, metadata=metadata)  # type: ignore[return-value]


def _route(
    router: TesseraRequestRouter, replicas: list[_Replica], body: Any, request_id: str | None = None
) -> _Replica:
    pending = _pending(body, request_id)
    ranked = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    assert sorted(r.replica_id for group in ranked for r in group) == sorted(
        r.replica_id for r in replicas
    )
    return ranked[0][0]


def _blocks(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)


def _keys(tokens: list[int], salt: str | None = None) -> list[TokenKey]:
    return prompt_keys(LAYOUT.fingerprint, "m", tokens, 64, salt)


def _salt_extra_keys(request: Any, start: int, end: int, mm_index: int) -> tuple[Any, int]:
    """vLLM's extra keys of a plain-text request (tests/vllm checks the router against vLLM's
    own function): its salt on the block at position 0."""
    salt = request.cache_salt
    return ((("cache_salt", salt),) if start == 0 and salt else None), mm_index


def test_router_keys_are_the_connectors_keys() -> None:
    """The router looks up exactly the keys the connector's scheduler stores and loads under."""
    tokens = list(range(7, 7 + 200))
    planner = SchedulerPlanner(
        SimpleNamespace(), LAYOUT, namespace="vllm", model_name="m", block_tokens=64,  # type: ignore[arg-type]
        can_load=True, can_save=True, extra_keys=_salt_extra_keys,
    )  # fmt: skip
    for salt in (None, "tenant-a"):
        request = SimpleNamespace(request_id=f"r-{salt}", all_token_ids=tokens, cache_salt=salt)
        tracked = planner._track(request)  # type: ignore[arg-type]
        assert planner._keys(tracked, 3) == _keys(tokens, salt)
    assert len(_keys(tokens[:63])) == 0 and _keys(tokens)[0] != _keys(tokens, "tenant-a")[0]


def test_request_prompt_reads_openai_bodies() -> None:
    assert request_prompt([{"prompt": [1, 2], "cache_salt": "s"}]) == ([1, 2], "s")
    chat = SimpleNamespace(messages=[{"role": "user", "content": "hi"}], cache_salt=None)
    assert request_prompt([chat]) == (chat.messages, None)
    assert request_prompt([{"model": "m"}]) is None and request_prompt([]) is None


def test_a_request_goes_to_the_replica_whose_pool_holds_its_prefix() -> None:
    tier, tokens = _FakeTier(), list(range(300))
    for k in _keys(tokens)[:3]:
        tier.held[k] = [tier.pools[1]]
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    router = _router(tier)
    assert _route(router, replicas, {"prompt": tokens}).replica_id == "r1"
    assert router.last_choice == RouteChoice("r1", 3, RouteReason.TIER)
    for _ in range(5):  # not a coin flip; the 4th block was routed to r1 too, not yet stored
        assert _route(router, replicas, {"prompt": tokens}).replica_id == "r1"
        assert router.last_choice == RouteChoice("r1", 4, RouteReason.ROUTED)
    # Another tenant's keys differ: nothing is held for it, the shorter queue wins.
    router._replica_queue_len_cache.update("r1", 1)
    assert _route(router, replicas, {"prompt": tokens, "cache_salt": "t"}).replica_id == "r0"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.BALANCED


def test_a_hot_prefix_spreads_once_its_replica_queue_is_deeper_than_the_bound() -> None:
    tier, tokens = _FakeTier(), list(range(300))
    for k in _keys(tokens):
        tier.held[k] = [tier.pools[0]]
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    router = _router(tier, max_queue_gap=2, balance_on="requests")
    router._replica_queue_len_cache.update("r0", 2)
    assert _route(router, replicas, {"prompt": tokens}).replica_id == "r0"  # within the bound
    router._replica_queue_len_cache.update("r0", 3)
    assert _route(router, replicas, {"prompt": tokens}).replica_id == "r1"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.BALANCED


def test_by_prompt_tokens_a_hot_prefix_spreads_once_its_holder_carries_more_than_the_gap() -> None:
    """The default load is the prompt tokens of the requests a replica has not finished, as the
    router counts them, not Serve's queue lengths: a deep queue of short prompts weighs less
    than one long prompt."""
    tier, tokens = _FakeTier(), list(range(300))
    for k in _keys(tokens):
        tier.held[k] = [tier.pools[0]]
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    router = _router(tier, max_token_gap=500)
    router._replica_queue_len_cache.update("r0", 10)  # not what this mode weighs
    assert _route(router, replicas, {"prompt": tokens}, "q1").replica_id == "r0"  # 300 after
    assert _route(router, replicas, {"prompt": tokens}, "q2").replica_id == "r0"  # 300 <= 500
    # r0 carries 600 > 0 + 500: the next goes to r1, which loads the prefix through the tier.
    assert _route(router, replicas, {"prompt": tokens}, "q3").replica_id == "r1"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.BALANCED
    router.on_request_completed("r0", "q1")
    router.on_request_completed("r0", "q2")
    assert _route(router, replicas, {"prompt": tokens}, "q4").replica_id == "r0"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.TIER
    # Serve sent q4 to r1 after all (r0 was full): the load moves with it.
    router.on_request_routed(_pending({}, "q4"), "r1", None)
    assert router._outstanding.of("r1") == 600 and router._outstanding.of("r0") == 0
    # A silent tier: power-of-two choices on the same load.
    tier.down = True
    assert _route(router, replicas, {"prompt": tokens}, "q5").replica_id == "r0"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.FALLBACK


def test_a_prefix_returns_to_the_replica_it_was_sent_to_among_its_nodes_replicas() -> None:
    """Two replicas share node 0's pool, which holds the prefix: the first request picks one,
    and the next ones follow it there (its own engine cache), not to its equally loaded
    neighbour."""
    tier, tokens = _FakeTier(), list(range(300))
    for k in _keys(tokens):
        tier.held[k] = [tier.pools[0]]
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[0]), _Replica("r2", NODES[1])]
    router = _router(tier, max_token_gap=10_000)
    first = _route(router, replicas, {"prompt": tokens}, "a").replica_id
    assert first in ("r0", "r1")
    for i in range(6):
        router.on_request_completed(first, "a" if i == 0 else f"b{i - 1}")  # equal loads again
        assert _route(router, replicas, {"prompt": tokens}, f"b{i}").replica_id == first


def test_requests_sharing_a_prefix_that_is_not_yet_stored_are_grouped() -> None:
    """Turns that share a prefix arrive before the first has stored anything: the router
    remembers where it sent the blocks and sends the next turns there (within the queue bound)
    instead of balancing them, so one replica computes the prefix. With the memory off they
    are balanced."""
    shared = list(range(256))
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    for memory_s, expect in ((30.0, RouteReason.ROUTED), (0.0, RouteReason.BALANCED)):
        tier = _FakeTier()
        router = _router(tier, routed_memory_s=memory_s, balance_on="requests")
        first = _route(router, replicas, {"prompt": [*shared, 1000]})
        assert router.last_choice is not None and router.last_choice.reason is RouteReason.BALANCED
        router._replica_queue_len_cache.update(first.replica_id, 1)
        second = _route(router, replicas, {"prompt": [*shared, 2000]})
        assert router.last_choice is not None and router.last_choice.reason is expect
        assert (second is first) == (expect is RouteReason.ROUTED)
    # Once the directory holds the blocks where they were routed, the choice is the tier's.
    for k in _keys(shared):
        tier.held[k] = [tier.pools[0]]
    router = _router(tier)
    _route(router, replicas, {"prompt": shared})
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.TIER


def test_a_silent_tier_or_unknown_tokens_fall_back_to_power_of_two() -> None:
    tier, tokens = _FakeTier(), list(range(300))
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    router = _router(tier, balance_on="requests")
    router._replica_queue_len_cache.update("r0", 5)
    tier.down = True
    assert _route(router, replicas, {"prompt": tokens}).replica_id == "r1"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.FALLBACK
    tier.down, tier.lookups = False, 0
    _route(router, replicas, {"prompt": "text, and no tokenizer configured"})
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.FALLBACK
    assert tier.lookups == 0
    # Shorter than a block: nothing to look up, but the tier is not silent: balanced.
    assert _route(router, replicas, {"prompt": list(range(10))}).replica_id == "r1"
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.BALANCED
    assert tier.lookups == 0


def test_a_slow_tier_is_not_waited_for() -> None:
    class _Slow(_FakeTier):
        slow = True

        async def alookup(self, *args: Any, **kwargs: Any) -> Any:
            if self.slow:
                await asyncio.sleep(5)
            return await super().alookup(*args, **kwargs)

    tier = _Slow()
    router = _router(tier, lookup_timeout_s=0.05)
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    tokens = list(range(300))
    first = _route(router, replicas, {"prompt": tokens})
    assert router.last_choice is not None and router.last_choice.reason is RouteReason.FALLBACK
    # Still silent: the prefix follows the blocks the router sent, not a coin flip.
    router._replica_queue_len_cache.update(first.replica_id, 1)
    for _ in range(4):
        assert _route(router, replicas, {"prompt": tokens}) is first
        assert router.last_choice is not None
        assert router.last_choice.reason is RouteReason.FALLBACK


def test_router_settings_are_checked() -> None:
    with pytest.raises(TierConfigError, match="model_name"):
        _router(_FakeTier(), model_name="")
    with pytest.raises(TierConfigError, match="max_queue_gap"):
        _router(_FakeTier(), max_queue_gap=-1)
    with pytest.raises(TierConfigError, match="routed_memory_s"):
        _router(_FakeTier(), routed_memory_s=-1.0)
    with pytest.raises(TierConfigError, match="max_token_gap"):
        _router(_FakeTier(), max_token_gap=-1)
    with pytest.raises(TierConfigError, match="balance_on must be one of"):
        _router(_FakeTier(), balance_on="bytes")


def test_a_strict_lookup_tells_a_dead_shard_from_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's lookup answers misses for a shard that is down (a reader recomputes), but a
    router must know the tier did not answer: ``strict`` raises instead."""
    from ray.exceptions import ActorDiedError

    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig

    async def died() -> None:
        raise ActorDiedError()

    dead = SimpleNamespace(remote=lambda *a: died())
    dead_shard = SimpleNamespace(lookup=dead, channel=dead)
    client = TesseraClient(
        TierConfig(model="tiny-mla", pool=PoolServiceConfig(num_blocks=4), num_shards=1),
        LAYOUT,
        ["p"],
    )
    monkeypatch.setattr(client._actors, "get", lambda name: dead_shard)
    keys = _keys(list(range(128)))
    assert asyncio.run(client.alookup("vllm", keys)) == [None, None]
    with pytest.raises(DirectoryUnavailableError, match="shard 0"):
        asyncio.run(client.alookup("vllm", keys, strict=True))


@pytest.mark.ray
def test_serve_routes_a_prompt_to_the_replica_on_the_node_holding_it(
    tessera_cluster: SimCluster,
) -> None:
    """Serve instantiates the router from a deployment's config; two replicas on two nodes; a
    prompt whose blocks live on one node's pool goes to that node's replica, every time."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig

    namespace = "tessera-test-router"
    config = TierConfig(
        model="router-mla", pool=PoolServiceConfig(num_blocks=8), num_shards=1,
        ray_namespace=namespace,
    )  # fmt: skip
    tier = TesseraClient.start(config, layout=LAYOUT, pools_on=tessera_cluster.node_ids)

    @serve.deployment(
        num_replicas=2,
        max_replicas_per_node=1,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="tessera_ray.serve.router:TesseraRequestRouter",
            request_router_kwargs={"model_name": "m", "ray_namespace": namespace},
        ),
    )
    class Where:
        def __call__(self, body: dict[str, Any]) -> str:
            return str(ray.get_runtime_context().get_node_id())

    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    try:
        handle = serve.run(Where.bind(), name="router-test", route_prefix=None)
        nodes = {handle.remote({"model": "m"}).result(timeout_s=60) for _ in range(40)}
        assert len(nodes) == 2  # no prompt: power-of-two spreads over both replicas
        target = sorted(nodes)[1]
        tokens = list(range(3, 3 + 3 * 64 + 5))
        tier.store("vllm", _keys(tokens), _blocks(3), pool=tier.pool_on(target))
        routed = [handle.remote({"prompt": tokens}).result(timeout_s=60) for _ in range(8)]
        assert routed == [target] * 8
    finally:
        serve.shutdown()
        tier.stop()


def test_the_deploy_example_routes_on_the_connectors_keys() -> None:
    """The Serve LLM example's router names the connector's model and namespace (else no key it
    looks up would match), and Serve's own config type accepts it."""
    from pathlib import Path

    import yaml
    from ray.serve.config import RequestRouterConfig

    from tessera_ray.vllm.connector import TesseraConnectorConfig

    root = Path(__file__).resolve().parents[2]
    app = yaml.safe_load((root / "deploy" / "serve_llm_tessera.yaml").read_text())
    (llm,) = app["applications"][0]["args"]["llm_configs"]
    routing = RequestRouterConfig(**llm["deployment_config"]["request_router_config"])
    assert routing.get_request_router_class() is TesseraRequestRouter
    extra = llm["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    connector = TesseraConnectorConfig.from_extra_config(extra)
    kwargs = routing.request_router_kwargs
    assert (kwargs["model_name"], kwargs["namespace"], kwargs["ray_namespace"]) == (
        connector.model_name,
        connector.namespace,
        connector.ray_namespace,
    )
    router = _router(_FakeTier(), **{k: v for k, v in kwargs.items() if k != "model_name"})
    assert router._tokenizer_path == kwargs["tokenizer"]


def test_without_a_tier_the_router_routes_and_tries_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.errors import PoolUnavailableError

    attempts: list[str] = []

    def connect(ray_namespace: str, **_: Any) -> TesseraClient:
        attempts.append(ray_namespace)
        raise PoolUnavailableError(f"no tessera-ray pools in Ray namespace {ray_namespace!r}")

    monkeypatch.setattr(TesseraClient, "connect", connect)
    router = TesseraRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state(model_name="m", ray_namespace="not-started")
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    for _ in range(3):
        _route(router, replicas, {"prompt": list(range(300))})
        assert router.last_choice is not None
        assert router.last_choice.reason is RouteReason.FALLBACK
    assert attempts == ["not-started"]  # one attempt per retry interval, not per request


def test_a_prompt_found_nowhere_carries_the_routers_word_to_the_engine() -> None:
    """The router's lookup found none of the prompt's blocks, nor sent them anywhere lately:
    the request's ``kv_transfer_params`` say so, naming the first block's key, so that the
    engine need not look again. A prompt held somewhere, or routed a moment ago, says nothing."""
    tier, tokens = _FakeTier(), list(range(300))
    replicas = [_Replica("r0", NODES[0]), _Replica("r1", NODES[1])]
    router = _router(tier, routed_memory_s=30.0)
    body: dict[str, Any] = {"prompt": tokens, "kv_transfer_params": {"mine": 1}}
    _route(router, replicas, body)
    assert body["kv_transfer_params"] == {"mine": 1, ROUTER_MISS_PARAM: _keys(tokens)[0].hex()}
    again: dict[str, Any] = {"prompt": tokens}  # routed a moment ago: it may be on its way
    _route(router, replicas, again)
    assert "kv_transfer_params" not in again
    other = list(range(1000, 1300))
    tier.held[_keys(other)[0]] = [tier.pools[0]]
    held: dict[str, Any] = {"prompt": other}
    _route(router, replicas, held)
    assert "kv_transfer_params" not in held
    tier.down = True  # no answer: no word
    silent: dict[str, Any] = {"prompt": list(range(2000, 2300))}
    _route(router, replicas, silent)
    assert "kv_transfer_params" not in silent
