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

import dataclasses
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera_ray._loopback import LOOPBACK_ENV, ray_on_loopback
from tessera_ray.demo.endpoint import TurnResult, as_json, run_fleet, time_cold_prompts
from tessera_ray.demo.workload import DemoConfig

__all__ = ["EngineDemoConfig", "run_engine_demo"]

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
    """The tier-aware router's decisions, as its metrics say on the nodes' Prometheus
    endpoints (the router runs in Serve's ingress process, not here): requests per reason
    and the mean count of local blocks at the chosen replica."""
    import ray

    from tessera_ray.metrics_scrape import scrape_until, total
    from tessera_ray.serve.routing import RouteReason

    ports = [int(n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    name = "tessera_route_requests_total"

    def arrived(s: Any) -> bool:
        # The counter and the histogram travel separately: wait for both.
        routed = total(s, name, ray_namespace=ray_namespace) or 0.0
        fallbacks = total(s, name, ray_namespace=ray_namespace, reason="fallback") or 0.0
        chosen = total(s, "tessera_route_local_blocks_count", ray_namespace=ray_namespace) or 0.0
        return routed >= routed_at_least and chosen >= routed - fallbacks

    samples = scrape_until(ports, arrived, _SCRAPE_DEADLINE_S)
    out: dict[str, Any] = {
        r.value: int(total(samples, name, ray_namespace=ray_namespace, reason=r.value) or 0)
        for r in RouteReason
    }
    count = total(samples, "tessera_route_local_blocks_count", ray_namespace=ray_namespace)
    blocks = total(samples, "tessera_route_local_blocks_sum", ray_namespace=ray_namespace)
    out["local_blocks_mean"] = (blocks or 0.0) / count if count else 0.0
    return out


def run_engine_demo(config: EngineDemoConfig, work: Path | None = None) -> dict[str, Any]:
    """Run the fleet once on real engines; a JSON-ready report (turns, rounds, tier status)."""
    import openai
    import ray
    from ray import serve

    from tessera_ray._cli_status import status_json
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.layout import build_layout
    from tessera_ray.layout.hf import config_from_hf
    from tessera_ray.models.hf_tiny import write_tiny_gqa, write_tiny_mla
    from tessera_ray.serve.llm import ServeLLMSettings, openai_app

    with tempfile.TemporaryDirectory(prefix="tessera-engine-demo-") as tmp:
        root = work or Path(tmp)
        write = write_tiny_gqa if config.model_kind == "gqa" else write_tiny_mla
        name = f"tiny-{config.model_kind}"
        model = write(root / name, config.num_layers)
        hf = json.loads((model / "config.json").read_text())
        layout = build_layout(config_from_hf(hf, name=name, source=str(model)))
        ns = config.fleet.ray_namespace
        cluster = _start_nodes(config.num_nodes)
        tier = None
        try:
            tier = TesseraClient.start(
                TierConfig(
                    model=name,
                    pool=PoolServiceConfig(num_blocks=config.num_blocks),
                    num_shards=config.fleet.num_shards,
                    ray_namespace=ns,
                ),
                layout=layout,
            )
            serve.start(
                proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": config.port}
            )
            settings = ServeLLMSettings(
                model_source=str(model),
                model_id=name,
                num_replicas=config.num_nodes,
                bundle_per_worker={"CPU": 1, _NODE_RESOURCE: 1},
                device=config.device,
                ray_namespace=ns,
                router=config.router,
                engine_kwargs={"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True},
                env_vars={"VLLM_CPU_KVCACHE_SPACE": str(_KVCACHE_GIB)},
            )
            settings = dataclasses.replace(settings, **config.router_settings)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{config.port}/v1",
                api_key="unused",
                max_retries=0,
                timeout=600,
            )
            started = time.perf_counter()
            serve.run(openai_app(settings), name="llm", blocking=False)
            _wait_ready(client, name, config.start_timeout_s)
            start_s = time.perf_counter() - started
            # Ray's log setup (redone when Serve starts) leaves the root logger at INFO: the
            # client's line per request would bury the report.
            logging.getLogger("httpx").setLevel(logging.WARNING)
            calibration = (
                time_cold_prompts(client, name, config.calibrate, vocab_size=int(hf["vocab_size"]))
                if config.calibrate
                else None
            )
            results: list[TurnResult] = run_fleet(
                client, name, config.fleet, vocab_size=int(hf["vocab_size"])
            )
            report = as_json(results)
            report["start_s"] = start_s
            report["model"] = name
            report["replicas"] = config.num_nodes
            report["router"] = config.router
            report["tier"] = json.loads(status_json(*tier.status()))
            report["replica_nodes"] = _replica_nodes()
            report["kv_bytes_per_token"] = int(layout.paged_bytes_per_token)
            report["block_bytes"] = layout.block_bytes
            report["pool_blocks"] = config.num_blocks
            report["engine_cache_bytes"] = _KVCACHE_GIB << 30
            if calibration is not None:
                report["calibration"] = calibration
            if config.router == "tessera":
                report["router_choices"] = _router_choices(ns, len(results))
            return report
        finally:
            serve.shutdown()  # type: ignore[no-untyped-call]
            if tier is not None:
                tier.stop()
            ray.shutdown()
            cluster.shutdown()
