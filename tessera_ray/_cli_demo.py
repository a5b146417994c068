"""``tessera-ray demo``: the agent fleet on an embedded local Ray (Ray, torch and matplotlib are
imported lazily, so other subcommands stay fast)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tessera_ray._loopback import keep_ray_on_loopback
from tessera_ray.serve.llm import ROUTERS

if TYPE_CHECKING:
    from tessera_ray.demo.serve_demo import EngineDemoConfig

__all__ = ["add_demo_command", "engine_demo_config"]


# The engine demo's fleet: more agents and documents than each replica's own KV cache holds
# (ENGINE_CACHE_TOKENS), and pools that spill to their disk tiers, so reuse has to come from
# the tier; see docs/engine-demo.md.
ENGINE_FLEET = {
    "num_agents": 24,
    "num_documents": 6,
    "num_rounds": 3,
    "system_blocks": 1,
    "document_blocks": 2,
}
ENGINE_MAX_LEN = 4096
# vLLM's least: one prompt of the longest length, plus a block for its null block.
ENGINE_CACHE_TOKENS = ENGINE_MAX_LEN + 256
ENGINE_POOL_BLOCKS = 192  # tier blocks of 64 tokens per pool, with a disk tier below
ENGINE_MAX_TOKEN_GAP = 2048  # prompt tokens: a busy holder's agents move to the other replica


@contextlib.contextmanager
def _logs_to(path: Path | None) -> Iterator[TextIO]:
    """Everything this process and the ones it starts print (Ray, Serve, vLLM) goes to
    ``path``; the demo's own lines go to the stream yielded (the terminal). ``None``: no
    redirection."""
    if path is None:
        yield sys.stdout
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
        terminal.close()


def engine_demo_config(**overrides: Any) -> EngineDemoConfig:
    """The deployment ``make demo-engine`` runs (its pools with a disk tier, engine caches of
    about one long prompt), as the benchmarks that drive the same app take it; ``overrides``
    set any other field (the fleet by default: :class:`DemoConfig`'s)."""
    from tessera_ray.demo.serve_demo import EngineDemoConfig
    from tessera_ray.demo.workload import DemoConfig

    settings: dict[str, Any] = {
        "fleet": DemoConfig(),
        "num_blocks": ENGINE_POOL_BLOCKS,
        "disk": True,
        "engine_cache_tokens": ENGINE_CACHE_TOKENS,
        "max_model_len": ENGINE_MAX_LEN,
    }
    return EngineDemoConfig(**{**settings, **overrides})


def _cmd_engine_demo(ns: argparse.Namespace, config: object) -> int:
    """The fleet on real vLLM engines behind Ray Serve LLM (``--engine vllm``), without and
    with the tier."""
    from tessera_ray.demo.endpoint import render_comparison, render_router_choices
    from tessera_ray.demo.serve_demo import run_tier_comparison
    from tessera_ray.demo.workload import DemoConfig

    assert isinstance(config, DemoConfig)
    log_path = None if ns.verbose else Path(ns.log).resolve()
    engine = engine_demo_config(
        fleet=config,
        model_kind=ns.model_kind,
        num_nodes=ns.nodes,
        device=ns.device,
        router=ns.router,
        router_settings={"max_token_gap": ENGINE_MAX_TOKEN_GAP},
    )
    print(
        f"{config.num_agents} agents, {config.num_documents} shared documents, "
        f"{config.num_rounds} rounds on {ns.nodes} vLLM replicas (tiny-{ns.model_kind}, "
        f"{ENGINE_CACHE_TOKENS:,} tokens of KV cache each) behind Ray Serve LLM "
        f"({ns.router} router); the same fleet without, then with the tier (a pool of "
        f"{ENGINE_POOL_BLOCKS} tier blocks and a disk tier per node)",
        flush=True,
    )
    if log_path is not None:
        print(f"Ray, Serve and vLLM logs: {log_path} (--verbose shows them here)", flush=True)
    with _logs_to(log_path) as out:
        report = run_tier_comparison(engine, say=lambda line: print(line, file=out))
    print(render_comparison(report["comparison"]))
    for label in ("tier_off", "tier_on"):
        choices = report[label].get("router_choices")
        if choices is not None:
            print(f"{label.replace('_', ' ')}: {render_router_choices(choices)}")
    report["log"] = str(log_path) if log_path is not None else None
    if ns.report is not None:
        Path(ns.report).write_text(json.dumps(report, indent=1))
        print(f"report: {ns.report}")
    if ns.plot is not None:
        from tessera_ray.demo.endpoint import plot_rounds, rounds_from_json

        plot_rounds(rounds_from_json(report["tier_on"]), Path(ns.plot))
        print(f"plot: {ns.plot}")
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    if ns.engine == "vllm":
        # Simulated nodes on one host: every Ray address on loopback. Ray reads this when it is
        # imported (below), and the nodes' processes inherit it.
        keep_ray_on_loopback()
    from tessera_ray.demo import DemoConfig, plot_report, render_summary, run_demo

    if ns.plot is not None:
        from tessera_ray._plot import pyplot

        pyplot()  # a missing plot extra is refused before the run, not after it
    sizes: dict[str, int] = ENGINE_FLEET if ns.engine == "vllm" else {}
    asked = {"num_agents": ns.agents, "num_rounds": ns.rounds}
    config = DemoConfig(
        **{**sizes, **{k: v for k, v in asked.items() if v is not None}},
        parity_every=ns.parity_every,
        seed=ns.seed,
        ray_namespace=ns.ray_namespace,
    )
    if ns.engine == "vllm":
        return _cmd_engine_demo(ns, config)
    report = run_demo(config, progress=True if ns.progress else None)
    print(render_summary(report))
    if ns.report is not None:
        report.write_json(Path(ns.report))
        print(f"report: {ns.report}")
    if ns.plot is not None:
        plot_report(report, Path(ns.plot))
        print(f"plot: {ns.plot}")
    return 0


def add_demo_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = sub.add_parser(
        "demo",
        help="an agent fleet on the tiny MLA model over the tier, on an embedded local Ray",
        description="Start a local Ray and the tier (several pools, a sharded directory, a disk "
        "tier in a temporary folder), run an agent fleet with real forward passes, and print "
        "what the tier served, stored, moved and spilled.",
    )
    demo.add_argument(
        "--agents", type=int, default=None, help="agents in the fleet (default 16; vllm: 24)"
    )
    demo.add_argument("--rounds", type=int, default=None, help="turns per agent (default 3)")
    demo.add_argument(
        "--parity-every", type=int, default=2, help="check decode parity every n-th request"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of every prompt")
    demo.add_argument("--ray-namespace", default="tessera-demo", help="Ray namespace of the tier")
    demo.add_argument("--report", default=None, help="write the JSON report here")
    demo.add_argument("--plot", default=None, help="write the PNG plot here")
    demo.add_argument("--progress", action="store_true", help="progress bar even off a TTY")
    demo.add_argument(
        "--engine",
        choices=("tiny", "vllm"),
        default="tiny",
        help="tiny: the project's own model in this process (default); vllm: real vLLM engines "
        "behind Ray Serve LLM's OpenAI endpoint (needs vllm, pyarrow; see make demo-engine)",
    )
    demo.add_argument(
        "--model-kind", choices=("gqa", "mla"), default="gqa", help="--engine vllm: the model"
    )
    demo.add_argument(
        "--nodes", type=int, default=2, help="--engine vllm: simulated nodes, a replica on each"
    )
    demo.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="--engine vllm: where engines run"
    )
    demo.add_argument(
        "--router",
        choices=sorted(ROUTERS),
        default="tessera",
        help="--engine vllm: Serve's request router (default: the tier-aware one)",
    )
    demo.add_argument(
        "--log",
        default="demo_engine.log",
        help="--engine vllm: where Ray's, Serve's and vLLM's output goes (default demo_engine.log)",
    )
    demo.add_argument(
        "--verbose", action="store_true", help="--engine vllm: show that output here instead"
    )
    demo.set_defaults(handler=_cmd_demo)
