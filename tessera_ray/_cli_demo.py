"""``tessera-ray demo``: the agent fleet on an embedded local Ray (Ray, torch and matplotlib are
imported lazily, so other subcommands stay fast)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tessera_ray._loopback import keep_ray_on_loopback
from tessera_ray.serve.llm import ROUTERS

__all__ = ["add_demo_command"]


def _cmd_engine_demo(ns: argparse.Namespace, config: object) -> int:
    """The fleet on real vLLM engines behind Ray Serve LLM (``--engine vllm``)."""
    from tessera_ray.demo.endpoint import (
        plot_rounds,
        render_rounds,
        render_router_choices,
        rounds_from_json,
    )
    from tessera_ray.demo.serve_demo import EngineDemoConfig, run_engine_demo
    from tessera_ray.demo.workload import DemoConfig

    assert isinstance(config, DemoConfig)
    report = run_engine_demo(
        EngineDemoConfig(
            fleet=config,
            model_kind=ns.model_kind,
            num_nodes=ns.nodes,
            device=ns.device,
            router=ns.router,
        )
    )
    print(
        f"{report['model']}: {report['replicas']} vLLM replicas behind Ray Serve LLM "
        f"({report['router']} router), up in {report['start_s']:.0f} s"
    )
    rounds = rounds_from_json(report)
    print(render_rounds(rounds))
    if "router_choices" in report:
        print(render_router_choices(report["router_choices"]))
    if ns.report is not None:
        Path(ns.report).write_text(json.dumps(report, indent=1))
        print(f"report: {ns.report}")
    if ns.plot is not None:
        plot_rounds(rounds, Path(ns.plot))
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
    config = DemoConfig(
        num_agents=ns.agents,
        num_rounds=ns.rounds,
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
    demo.add_argument("--agents", type=int, default=16, help="agents in the fleet (default 16)")
    demo.add_argument("--rounds", type=int, default=3, help="turns per agent (default 3)")
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
    demo.set_defaults(handler=_cmd_demo)
