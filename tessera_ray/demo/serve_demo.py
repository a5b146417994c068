"""``tessera-ray demo --engine vllm``: the agent fleet on real vLLM engines, through Ray Serve
LLM's OpenAI endpoint, over the tier, on an embedded local Ray.

It writes a tiny random-weight model (nothing downloaded), starts the tier from its
``config.json`` (a pool on each of ``num_nodes`` simulated nodes), deploys
:func:`tessera_ray.serve.llm.openai_app` with one vLLM replica per node (vLLM's CPU build, or
GPU engines where there are GPUs), and runs the fleet's turns
through the endpoint with the ``openai`` client (:mod:`tessera_ray.demo.endpoint`). Needs vLLM,
pyarrow and openai in the environment (``make demo-engine`` builds one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera_ray._loopback import LOOPBACK_ENV, ray_on_loopback
from tessera_ray.demo.endpoint import (
    TurnResult,
    as_json,
    compare,
    render_round,
    run_fleet,
    summarize,
    time_cold_prompts,
)
from tessera_ray.demo.workload import DemoConfig
from tessera_ray.serve.routing import RouteReason

__all__ = [
    "AppEndpoint",
    "EngineDemoConfig",
    "run_engine_demo",
    "run_tier_comparison",
    "run_app_comparison",
]

REASONS = tuple(r.value for r in RouteReason)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineDemoConfig:
    fleet: DemoConfig
    model_kind: str = "gqa"
    """``gqa`` (Qwen2: vLLM's CPU build keeps its own prefix cache on) or ``mla``
    (DeepSeek-V2: on a CPU without AMX vLLM turns its own prefix cache off, so every reuse is
    the tier's)."""
    num_layers: int = 2
    num_nodes: int = 2
    """Simulated Ray nodes on the local host, a pool and an engine replica on each."""
    device: str = "cpu"
    num_blocks: int = 2048
    """Each pool's memory, in tier blocks."""
    disk: bool = False
    """A disk tier under each pool (in a temporary folder): blocks a full pool evicts stay
    readable from it."""
    engine_cache_tokens: int | None = None
    """Each replica's own KV cache in tokens (vLLM's ``kv_cache_memory_bytes``, whatever block
    size its platform picks); ``None``: what ``VLLM_CPU_KVCACHE_SPACE`` holds."""
    max_model_len: int = 4096
    connector: bool = True
    """False: engines without the tier's connector, behind the same router (the baseline)."""
    concurrency: int = 4
    """Turns of a round in flight at once."""
    port: int = 8000
    start_timeout_s: float = 900.0
    router: str = "tessera"
    calibrate: tuple[int, ...] = ()
    """Prompt lengths to time cold, one at a time, before the fleet runs (the report's
    ``calibration``)."""
    router_settings: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`~tessera_ray.serve.llm.ServeLLMSettings`' router fields
    (``balance_on``, ``max_token_gap``, ``max_queue_gap``, ``routed_memory_s``,
    ``lookup_timeout_s``)."""


def _wait_ready(client: Any, model: str, timeout_s: float) -> None:
    """Until one completion succeeds (every replica is up once Serve reports the app
    running; the first answer proves the path end to end)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get("llm")
        if status is not None and status.status == "RUNNING":
            # Text: Ray's prefix-affinity router fails on a token-id prompt (no text to match).
            client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=1)
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"the Serve LLM app failed to deploy: {status.message}")
        time.sleep(1.0)  # Serve offers no blocking wait for an app started without blocking
    raise TimeoutError(f"the Serve LLM app did not start within {timeout_s:.0f} s")


_KVCACHE_GIB = 1  # each engine's KV cache: small, as the 24 GiB host is shared
_NODE_RESOURCE = "tessera_demo_node"  # one per simulated node: one engine replica per node


def _start_nodes(num_nodes: int) -> Any:
    """An embedded Ray of ``num_nodes`` simulated nodes on 127.0.0.1; this process joins it."""
    import ray
    from ray.cluster_utils import Cluster

    if not ray_on_loopback():
        raise RuntimeError(
            f"simulated Ray nodes need {LOOPBACK_ENV}=0 set before Ray is imported "
            "(tessera_ray._loopback.keep_ray_on_loopback)"
        )

    # Logical CPUs, not cores: each replica, its engine worker and the ingress claim one.
    node: dict[str, Any] = {
        "num_cpus": 4,
        "node_ip_address": "127.0.0.1",
        "resources": {_NODE_RESOURCE: 1},
    }
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(num_nodes - 1):
        cluster.add_node(**node)
    ray.init(
        address=cluster.address,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    cluster.wait_for_nodes()
    return cluster


def _replica_nodes() -> list[str]:
    """The node of each engine replica of the app (asked of each replica's actor)."""
    import ray

    def node(_: Any) -> str:
        return str(ray.get_runtime_context().get_node_id())

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "LLMServer" in a["name"]
    ]
    handles = [ray.get_actor(n, namespace="serve") for n in names]
    return sorted(ray.get([h.__ray_call__.remote(node) for h in handles], timeout=30))


_SCRAPE_DEADLINE_S = 60.0


def _router_choices(ray_namespace: str, routed_at_least: int) -> dict[str, Any]:
    """The tier-aware router's decisions so far on this cluster, as its metrics say on the
    nodes' Prometheus endpoints (the router runs in Serve's ingress process, not here):
    requests per reason, and per reason the leading blocks the chosen replica's pool held,
    summed (``held_blocks``), both counted by the router when it chose."""
    import ray

    from tessera_ray.metrics_scrape import scrape_until, total

    ports = [int(n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    name = "tessera_route_requests_total"

    def arrived(s: Any) -> bool:
        return (total(s, name, ray_namespace=ray_namespace) or 0.0) >= routed_at_least

    samples = scrape_until(ports, arrived, _SCRAPE_DEADLINE_S)
    out: dict[str, Any] = {
        r: int(total(samples, name, ray_namespace=ray_namespace, reason=r) or 0) for r in REASONS
    }
    out["held_blocks"] = {
        r: int(
            total(samples, "tessera_route_held_blocks_total", ray_namespace=ray_namespace, reason=r)
            or 0
        )
        for r in REASONS
    }
    return out


def _since(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """Router counts of one run: the cluster's totals less what earlier runs counted."""
    if before is None:
        return now
    out: dict[str, Any] = {r: now[r] - before.get(r, 0) for r in REASONS}
    held = before.get("held_blocks", {})
    out["held_blocks"] = {r: now["held_blocks"][r] - held.get(r, 0) for r in REASONS}
    return out


Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class _Stack:
    """What both runs of a comparison share: the model, the cluster's tier."""

    name: str
    model: Path
    vocab_size: int
    layout: Any
    tier: Any


@contextlib.contextmanager
def _stack(config: EngineDemoConfig, work: Path | None) -> Iterator[_Stack]:
    """The model written, the simulated nodes up and the tier started on them (a pool per
    node, with its disk tier where asked); everything stopped on exit."""
    import ray
    from ray import serve

    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.layout import build_layout
    from tessera_ray.layout.hf import config_from_hf
    from tessera_ray.models.hf_tiny import write_tiny_gqa, write_tiny_mla

    with tempfile.TemporaryDirectory(prefix="tessera-engine-demo-") as tmp:
        root = work or Path(tmp)
        write = write_tiny_gqa if config.model_kind == "gqa" else write_tiny_mla
        name = f"tiny-{config.model_kind}"
        model = write(root / name, config.num_layers)
        hf = json.loads((model / "config.json").read_text())
        layout = build_layout(config_from_hf(hf, name=name, source=str(model)))
        cluster = _start_nodes(config.num_nodes)
        tier = None
        try:
            pool = PoolServiceConfig(
                num_blocks=config.num_blocks,
                disk_root=root / "disk" if config.disk else None,
            )
            tier = TesseraClient.start(
                TierConfig(
                    model=name,
                    pool=pool,
                    num_shards=config.fleet.num_shards,
                    ray_namespace=config.fleet.ray_namespace,
                ),
                layout=layout,
            )
            serve.start(
                proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": config.port}
            )
            yield _Stack(name, model, int(hf["vocab_size"]), layout, tier)
        finally:
            serve.shutdown()  # type: ignore[no-untyped-call]
            if tier is not None:
                tier.stop()
            ray.shutdown()
            cluster.shutdown()


def _settings(config: EngineDemoConfig, stack: _Stack) -> Any:
    from tessera_ray.serve.llm import ServeLLMSettings

    engine_kwargs: dict[str, Any] = {
        "dtype": "bfloat16",
        "max_model_len": config.max_model_len,
        "enforce_eager": True,
    }
    if config.engine_cache_tokens is not None:
        bytes_per_token = int(stack.layout.paged_bytes_per_token)
        engine_kwargs["kv_cache_memory_bytes"] = config.engine_cache_tokens * bytes_per_token
    settings = ServeLLMSettings(
        model_source=str(stack.model),
        model_id=stack.name,
        num_replicas=config.num_nodes,
        bundle_per_worker={"CPU": 1, _NODE_RESOURCE: 1},
        device=config.device,
        ray_namespace=config.fleet.ray_namespace,
        router=config.router,
        connector=config.connector,
        engine_kwargs=engine_kwargs,
        # The CPU build lets this variable override kv_cache_memory_bytes: unset when sized.
        env_vars={}
        if config.engine_cache_tokens
        else {"VLLM_CPU_KVCACHE_SPACE": str(_KVCACHE_GIB)},
    )
    return dataclasses.replace(settings, **config.router_settings)


def _run_app(
    config: EngineDemoConfig,
    stack: _Stack,
    say: Say,
    label: str,
    router_before: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Deploy the app of ``config`` on ``stack``, run the fleet through it, delete the app;
    the run's report (turns, rounds, router choices, tier status). ``router_before``: the
    router counts earlier runs on this cluster left (this run's are the difference)."""
    import openai
    from ray import serve

    from tessera_ray._cli_status import status_json
    from tessera_ray.serve.llm import openai_app

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
    )
    started = time.perf_counter()
    serve.run(openai_app(_settings(config, stack)), name="llm", blocking=False)
    try:
        _wait_ready(client, stack.name, config.start_timeout_s)
        start_s = time.perf_counter() - started
        say(f"{label.rstrip()}: {config.num_nodes} vLLM replicas up in {start_s:.0f} s")
        # Ray's log setup (redone when Serve starts) leaves the root logger at INFO: the
        # client's line per request would bury the report.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        calibration = (
            time_cold_prompts(client, stack.name, config.calibrate, vocab_size=stack.vocab_size)
            if config.calibrate
            else None
        )
        results: list[TurnResult] = run_fleet(
            client,
            stack.name,
            config.fleet,
            vocab_size=stack.vocab_size,
            concurrency=config.concurrency,
            on_round=lambda turns: say(render_round(label, summarize(turns)[0])),
        )
        report = as_json(results)
        report["start_s"] = start_s
        report["model"] = stack.name
        report["replicas"] = config.num_nodes
        report["router"] = config.router
        report["connector"] = config.connector
        report["tier"] = json.loads(status_json(*stack.tier.status()))
        report["replica_nodes"] = _replica_nodes()
        report["kv_bytes_per_token"] = int(stack.layout.paged_bytes_per_token)
        report["block_bytes"] = stack.layout.block_bytes
        report["pool_blocks"] = config.num_blocks
        report["engine_cache_bytes"] = (
            config.engine_cache_tokens * report["kv_bytes_per_token"]
            if config.engine_cache_tokens is not None
            else _KVCACHE_GIB << 30
        )
        if calibration is not None:
            report["calibration"] = calibration
        if config.router == "tessera":
            before = sum(router_before[r] for r in REASONS) if router_before else 0
            now = _router_choices(config.fleet.ray_namespace, before + len(results))
            report["router_totals"] = now
            report["router_choices"] = _since(now, router_before)
        return report
    finally:
        serve.delete("llm")


def run_engine_demo(config: EngineDemoConfig, work: Path | None = None) -> dict[str, Any]:
    """Run the fleet once on real engines; a JSON-ready report (turns, rounds, tier status)."""
    with _stack(config, work) as stack:
        return _run_app(config, stack, _quiet, "fleet")


def run_tier_comparison(
    config: EngineDemoConfig, work: Path | None = None, say: Say = _quiet
) -> dict[str, Any]:
    """The same fleet twice on one cluster, first with engines that run vLLM's own caches only
    and then through the tier, behind the same router (the first run stores nothing in the
    tier, so the second starts from an empty one): both runs' reports and :func:`compare`'s
    verdict. ``say`` gets a line per replica start-up and per round."""
    with _stack(config, work) as stack:
        off = _run_app(dataclasses.replace(config, connector=False), stack, say, "tier off")
        on = _run_app(
            dataclasses.replace(config, connector=True),
            stack,
            say,
            "tier on ",
            off.get("router_totals"),
        )
    turns_off = [TurnResult(**t) for t in off["turns"]]
    turns_on = [TurnResult(**t) for t in on["turns"]]
    setup = {
        "fleet": dataclasses.asdict(config.fleet),
        "model": on["model"],
        "replicas": config.num_nodes,
        "engine_cache_tokens": config.engine_cache_tokens,
        "pool_blocks": config.num_blocks,
        "disk": config.disk,
        "router": config.router,
        "router_settings": dict(config.router_settings),
    }
    return {
        "setup": setup,
        "tier_off": off,
        "tier_on": on,
        "comparison": compare(turns_off, turns_on),
    }


@dataclass(frozen=True)
class AppEndpoint:
    """The deployed app, as a client that measures it reaches it."""

    base_url: str
    """``http://127.0.0.1:<port>`` (the OpenAI routes are under ``/v1``)."""
    model: str
    """The served model's name."""
    model_path: Path
    """The model's directory (its tokenizer, for a client that makes prompts)."""


def run_app_comparison(
    config: EngineDemoConfig,
    measure: Callable[[AppEndpoint], dict[str, Any]],
    work: Path | None = None,
    requests: int = 3,
    settle_s: float = 5.0,
) -> dict[str, Any]:
    """The app deployed on one cluster with the tier off (vLLM's own caches behind Ray's prefix
    router) and then on (the connector behind the tier-aware router), each ready, ``requests``
    prompts of whole tier blocks served (so the connector has made its first contact with the
    tier and stored), ``settle_s`` waited, then ``measure(endpoint)`` called (idle, or driving
    it with a client). Both runs' results, and each run's start."""
    import openai
    from ray import serve

    from tessera_ray.serve.llm import openai_app

    base_url = f"http://127.0.0.1:{config.port}"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    runs = {
        "tier_off": dataclasses.replace(config, connector=False, router="prefix_affinity"),
        "tier_on": dataclasses.replace(config, connector=True, router="tessera"),
    }
    out: dict[str, Any] = {}
    with _stack(config, work) as stack:
        words = 2 * stack.layout.block_tokens  # whitespace-split words: at least a token each
        endpoint = AppEndpoint(base_url, stack.name, stack.model)
        for label, run in runs.items():
            started = time.perf_counter()
            serve.run(openai_app(_settings(run, stack)), name="llm", blocking=False)
            try:
                _wait_ready(client, stack.name, run.start_timeout_s)
                start_s = time.perf_counter() - started
                for i in range(requests):
                    prompt = " ".join(f"w{i}x{j}" for j in range(words))
                    client.completions.create(model=stack.name, prompt=prompt, max_tokens=1)
                time.sleep(settle_s)
                out[label] = {"start_s": start_s, "measured": measure(endpoint)}
            finally:
                serve.delete("llm")
            time.sleep(settle_s)  # the replicas' processes gone before the next run
    return out
