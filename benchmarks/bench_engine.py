"""Real vLLM engines (vLLM's CPU build) on the tiny MLA model: first-token time with a shared
prefix served by vLLM itself, by the tier, and by vLLM's own connectors, all in one run.

For each prefix length (prompt = prefix + 5 tokens; whole tier blocks, so vLLM's own hit and the
tier's cover the same tokens):

- ``ttft_cold_*``: a fresh prompt, no connector configured (the baseline);
- ``ttft_tier_hit_*``: a second engine process (``TesseraConnector``, default role) whose prefix
  comes from the tier, vLLM's own cache emptied before each run;
- ``ttft_vllm_hit_*``: vLLM's own prefix-cache hit in that same engine (the ceiling; prefix
  caching forced on where the CPU build turns it off for MLA); the ``*_vs_*`` rows compare the
  tier hit with the two above as first tokens per second;
- ``ttft_example_hit_*``, ``ttft_mooncake_hit_*``: the same through vLLM's own
  ``ExampleConnector`` (safetensors files on local disk) and ``MooncakeStoreConnector`` (a
  Mooncake master and its standalone store process on 127.0.0.1, TCP), each where it starts
  here; a row says why where not.

Also ``decode_*``: the connector's cost to a decode step, measured inside the engine (its own
hook time per step, from the counts vLLM collects from it, against the step's time), and decode
tokens per second with the connector against without across engines, with the spread of two
identical engines without a connector beside it; ``first_tier_hit_fresh_engine``: a new
engine's first tier hit (after one unrelated warm-up request, so vLLM's own first-request costs
are not counted) against a warm engine's.

``gqa_*``: the first-token rows and the decode step's connector cost again on a tiny
grouped-query full-attention model (Qwen2, 8 query heads over 2 KV heads, vLLM's CPU attention
backend), over a tier of its own layout; the peers and the cross-engine decode rows run on the
MLA model only.

Every engine runs with the same CPU reservation (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``): vLLM's CPU
build otherwise gives an engine with a connector another worker thread (docs/engine-parity.md),
and the comparison would measure that instead. Every engine also has prefix caching on (forced
where the CPU build turns it off for MLA), so that they differ only in the connector. Runs in
``.venv-engine`` (``make test-engine`` creates it); started from another interpreter it re-runs
itself there.

``--quick``: prefixes of 1k and 4k tokens, fewer repeats.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
# Before anything loads UCX: its ib module crashes a process at exit with some system
# libibverbs (this single-host benchmark has no use for RDMA); an operator's choice stays.
os.environ.setdefault("UCX_MODULES", "^ib")

from common import (  # noqa: E402
    NOT_AVAILABLE,
    Row,
    needs_engine_venv,
    parse_args,
    write_result,
)

TIER_BLOCK = 64
TAIL = 5
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
WARM = [7] * 69
"""A throwaway first request: vLLM's own first-request costs stay out of every timed run."""


def _rate(seconds: float) -> float:
    return 1.0 / seconds


def _median(x: float | list[float]) -> float:
    return statistics.median(x) if isinstance(x, list) else x


def _prompts(lengths: list[int]) -> dict[int, list[int]]:
    import random

    rng = random.Random(27)
    return {n: [rng.randrange(1, 1000) for _ in range(n + TAIL)] for n in lengths}


def _unavailable(args: Any, reason: str) -> None:
    rows = [Row.unavailable("ttft_tier_hit", "first tokens/s", reason)]
    write_result("engine", args, rows)


def main() -> None:
    args = parse_args("engine")
    if not needs_engine_venv():
        _unavailable(args, "vLLM's CPU build is not installed (make test-engine creates it)")
        return
    import _peers

    # Mooncake's TCP transport listens on every interface: the whole run (Ray included, all on
    # 127.0.0.1) moves into a loopback-only network namespace where one can be made.
    _peers.enter_loopback_namespace(sys.argv)

    import ray

    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.layout import MLAConfig, build_layout
    from tessera_ray.models.hf_tiny import write_tiny_mla
    from tests.engine._harness import run_engine

    lengths = [1024, 4096] if args.quick else [1024, 4096, 8192]
    repeat = 3 if args.quick else 5
    prompts = _prompts(lengths)
    decode_prompt = [11] * 37
    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    model = write_tiny_mla(work / "tiny-mla-4", 4, max_positions=16384)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
        runtime_env={"env_vars": {"UCX_MODULES": "^ib"}},
    )
    address = ray.get_runtime_context().gcs_address
    layout = build_layout(MLAConfig(name="bench-tiny-mla-4", num_layers=4, num_heads=4))
    TesseraClient.start(
        TierConfig(model=layout.model, pool=PoolServiceConfig(num_blocks=1024), num_shards=1),
        layout=layout,
        quiet=True,
    )
    tier = {"backend": "ray", "ray_address": address}
    base = {"model": str(model), "env": ENV, "max_model_len": max(lengths) + 256}
    decode_jobs = [
        {"name": "decode/1", "prompt": decode_prompt, "max_tokens": 1, "repeat": repeat},
        {"name": "decode/65", "prompt": decode_prompt, "max_tokens": 65, "repeat": repeat},
    ]
    plain_spec, plain, reader = _model_runs(base, tier, prompts, decode_jobs, repeat, work, "")
    # The same engine as the first, minutes later: how far two identical engines differ here.
    plain_again = run_engine({**plain_spec, "jobs": decode_jobs}, work, "plain-again")
    rows = _hit_rows("", plain, reader, lengths)
    first = lengths[0]
    fresh = reader.results["first"]["seconds"]
    warm_hit = _median(reader.results[f"tier/{first}"]["seconds"])
    rows.append(
        Row(
            name="first_tier_hit_fresh_engine",
            value=_rate(fresh),
            unit="first tokens/s",
            baseline="warm engine's tier hit",
            baseline_value=_rate(warm_hit),
            target_ratio=0.5,
            note=f"{fresh:.3f} s against {warm_hit:.3f} s, {first}-token prefix",
        )
    )

    rows += _decode_rows(plain, reader, plain_again)
    rows += _gqa_rows(work, tier, prompts, decode_jobs, repeat, max(lengths) + 256)
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "example-connector")},
    }
    peers = _peer_rows("Example", example, {}, base, prompts, repeat, work)
    peers += _mooncake_rows(base, prompts, repeat, work)
    rows += peers
    tier_4k = next(r.value for r in rows if r.name == "ttft_tier_hit_4k")
    reader_4k = reader.results["tier/4096"]
    for peer, target in (("example", None), ("mooncake", 1.0)):
        row = next((r for r in peers if r.name == f"ttft_{peer}_hit_4k"), None)
        unlike = row is not None and "NOT LIKE FOR LIKE" in (row.note or "")
        if row is None or row.value is None or tier_4k is None or unlike:
            reason = "the peer did not run" if row is None else (row.note or "no value")
            reason = reason.removeprefix(NOT_AVAILABLE)
            if unlike:
                reason = (
                    "no cross-engine hit to compare: the second engine's first run recomputed "
                    "the prefix"
                )
            rows.append(Row.unavailable(f"tier_hit_vs_{peer}_hit_4k", "first tokens/s", reason))
            continue
        rows.append(
            Row(
                name=f"tier_hit_vs_{peer}_hit_4k",
                value=_rate(tier_4k),
                unit="first tokens/s",
                baseline=f"{peer} connector hit",
                baseline_value=_rate(row.value),
                target_ratio=target,
                miss_reason=(
                    f"the tier hit's load on the forward path ({_load_note(reader_4k)}) "
                    f"against the whole gap of {(tier_4k - row.value) * 1e3:.0f} ms; "
                    f"the peer's runs: {(row.note or '').split(';')[0]}"
                ),
            )
        )
    versions = {"vllm-cpu": importlib.metadata.version("vllm-cpu")}
    write_result("engine", args, rows, versions=versions)


def _model_runs(
    base: dict[str, Any],
    tier: dict[str, Any],
    prompts: dict[int, list[int]],
    decode_jobs: list[dict[str, Any]],
    repeat: int,
    work: Path,
    tag: str,
) -> tuple[dict[str, Any], Any, Any]:
    """One model's engines: vLLM alone (cold prefill, decode), an engine that stores the
    prefixes in the tier, and a second, fresh process that reads them and measures vLLM's own
    prefix-cache hit too (the same engine: the ceiling). Returns (plain spec, plain, reader)."""
    from tests.engine._harness import run_engine

    plain_jobs: list[dict[str, Any]] = [{"name": "warm", "prompt": WARM, "max_tokens": 1}]
    plain_jobs += [{"name": f"cold/{n}", "prompt": p, "max_tokens": 1} for n, p in prompts.items()]
    plain_spec = {**base, "force_prefix_caching": True, "jobs": plain_jobs + decode_jobs}
    plain = run_engine(plain_spec, work, f"{tag}plain")
    store_jobs = [{"name": f"cold/{n}", "prompt": p, "max_tokens": 1} for n, p in prompts.items()]
    store = {**base, "connector": tier, "kv_role": "kv_producer", "jobs": store_jobs}
    run_engine(store, work, f"{tag}store")
    first = min(prompts)
    tier_jobs: list[dict[str, Any]] = [
        {"name": "warm", "prompt": WARM, "max_tokens": 1},
        {"name": "first", "prompt": prompts[first], "max_tokens": 1},
    ]
    for n, p in prompts.items():
        tier_jobs += [
            {
                "name": f"tier/{n}",
                "prompt": p,
                "max_tokens": 1,
                "repeat": repeat,
                "fresh_cache": True,
            },
            {"name": f"own/{n}", "prompt": p, "max_tokens": 1, "repeat": repeat},
        ]
    reader_spec = {**base, "connector": tier, "force_prefix_caching": True, "connector_stats": True}
    reader = run_engine({**reader_spec, "jobs": tier_jobs + decode_jobs}, work, f"{tag}tier")
    return plain_spec, plain, reader


def _hit_rows(prefix: str, plain: Any, reader: Any, lengths: list[int]) -> list[Row]:
    """First-token time of a tier hit against vLLM's own hit and against cold prefill."""
    rows: list[Row] = []
    for n in lengths:
        cold = plain.results[f"cold/{n}"]["seconds"]
        own = reader.results[f"own/{n}"]
        hit = reader.results[f"tier/{n}"]
        assert hit["cached"] == n == own["cached"], f"hits of {hit['cached']}, {own['cached']}"
        t, o = _median(hit["seconds"]), _median(own["seconds"])
        k = f"{n // 1024}k"
        rows += [
            Row(name=f"{prefix}ttft_cold_{k}", value=cold, unit="s", note="no connector"),
            Row(
                name=f"{prefix}ttft_vllm_hit_{k}", value=o, unit="s", note="vLLM's own, same engine"
            ),
            Row(name=f"{prefix}ttft_tier_hit_{k}", value=t, unit="s", note=_load_note(hit)),
            Row(
                name=f"{prefix}tier_hit_vs_vllm_hit_{k}",
                value=_rate(t),
                unit="first tokens/s",
                baseline="vLLM's own prefix hit, same engine",
                baseline_value=_rate(o),
                target_ratio=1 / 1.5 if n == 4096 else None,
                miss_reason=f"the tier hit's load on the forward path: {_load_note(hit)}",
            ),
            Row(
                name=f"{prefix}tier_hit_vs_cold_{k}",
                value=_rate(t),
                unit="first tokens/s",
                baseline="cold prefill, no connector",
                baseline_value=_rate(cold),
                target_ratio=3.0 if n == 4096 else None,
            ),
        ]
    return rows


def _gqa_rows(
    work: Path,
    tier: dict[str, Any],
    prompts: dict[int, list[int]],
    decode_jobs: list[dict[str, Any]],
    repeat: int,
    max_model_len: int,
) -> list[Row]:
    """The same first-token rows, and the decode step's connector cost, on the tiny
    grouped-query model (Qwen2, 8 query heads over 2 KV heads) over its own tier."""
    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.layout import FullAttentionConfig, build_layout
    from tessera_ray.models.hf_tiny import GQA_HEADS, GQA_KV_HEADS, write_tiny_gqa

    model = write_tiny_gqa(work / "tiny-gqa-4", 4, max_positions=16384)
    geometry = FullAttentionConfig(
        name="bench-tiny-gqa-4",
        num_layers=4,
        num_heads=GQA_HEADS,
        num_kv_heads=GQA_KV_HEADS,
        head_dim=256 // GQA_HEADS,
    )
    layout = build_layout(geometry)
    namespace = "tessera-bench-gqa"
    pool = PoolServiceConfig(num_blocks=2048)
    config = TierConfig(model=layout.model, pool=pool, num_shards=1, ray_namespace=namespace)
    TesseraClient.start(config, layout=layout, quiet=True)
    base = {"model": str(model), "env": ENV, "max_model_len": max_model_len}
    gqa_tier = {**tier, "ray_namespace": namespace}
    _, plain, reader = _model_runs(base, gqa_tier, prompts, decode_jobs, repeat, work, "gqa-")
    rows = _hit_rows("gqa_", plain, reader, sorted(prompts))
    cost = _decode_rows(plain, reader, plain)[0]
    rows.append(dataclasses.replace(cost, name=f"gqa_{cost.name}"))
    return rows


def _load_note(hit: dict[str, Any]) -> str:
    """Per run of a tier hit: the connector's time on the forward path (the wait for the read,
    its verification and the copy into vLLM's cache), and the blocks loaded."""
    counts, runs = hit["connector"], len(hit["seconds"])
    return (
        f"{counts['forward_s'] / runs * 1e3:.0f} ms per run in the connector's forward-path "
        f"hooks, {counts['loaded_blocks'] // runs} blocks loaded"
    )


def _decode_rows(plain: Any, reader: Any, plain_again: Any) -> list[Row]:
    def step_s(run: Any) -> float:
        one = _median(run.results["decode/1"]["seconds"])
        many = _median(run.results["decode/65"]["seconds"])
        return (many - one) / 64

    # The connector's time per step over the 65-token runs: its hooks on the scheduler's and
    # the worker's paths, and the background stores' CPU time counted as if all of it were
    # taken from the step.
    counts = reader.results["decode/65"]["connector"]
    steps = counts["worker_steps"]
    parts = {k: counts.get(k, 0.0) / steps for k in ("forward_s", "scheduler_s", "store_cpu_s")}
    cost, step = sum(parts.values()), step_s(reader)
    us = ", ".join(f"{k.removesuffix('_s')} {v * 1e6:.0f}" for k, v in parts.items())
    return [
        Row(
            name="decode_step_connector_cost",
            value=1 / step,
            unit="steps/s",
            baseline="the same steps without the connector's time",
            baseline_value=1 / (step - cost),
            target_ratio=0.95,
            note=(
                f"{cost * 1e6:.0f} us of {step * 1e3:.2f} ms per decode step ({us} us), "
                f"{steps} steps; measured inside the engine"
            ),
            miss_reason=(
                f"the connector's own hooks: {parts['forward_s'] * 1e6:.0f} us per step on the "
                f"forward path, {parts['scheduler_s'] * 1e6:.0f} us on the scheduler's"
            ),
        ),
        Row(
            name="decode_with_connector",
            value=1 / step,
            unit="tokens/s",
            baseline="another engine without a connector",
            baseline_value=1 / step_s(plain),
            note="64 greedy tokens after a 37-token prompt; across engines, see the next row",
        ),
        Row(
            name="decode_engine_spread",
            value=1 / step_s(plain_again),
            unit="tokens/s",
            baseline="the same engine without a connector, started earlier",
            baseline_value=1 / step_s(plain),
            note=(
                "two identical engines, no connector: the run-to-run floor of any "
                "comparison between engine processes on this machine"
            ),
        ),
    ]


def _peer_rows(
    peer: str,
    transfer: dict[str, Any],
    env: dict[str, str],
    base: dict[str, Any],
    prompts: dict[int, list[int]],
    repeat: int,
    work: Path,
) -> list[Row]:
    """One of vLLM's own connectors on the same prompts: an engine stores them, a second,
    fresh one loads them (after one unrelated warm-up request, as the tier's engine; vLLM's
    own cache emptied before each run)."""
    from tests.engine._harness import run_engine

    spec = {**base, "kv_transfer_config": transfer, "env": {**base["env"], **env}}
    slug = peer.lower()
    try:
        cold = [{"name": f"cold/{n}", "prompt": p, "max_tokens": 1} for n, p in prompts.items()]
        run_engine({**spec, "jobs": cold}, work, f"{slug}-store")
        jobs = [{"name": "warm", "prompt": WARM, "max_tokens": 1}]
        jobs += [
            {
                "name": f"hit/{n}",
                "prompt": p,
                "max_tokens": 1,
                "repeat": repeat,
                "fresh_cache": True,
            }
            for n, p in prompts.items()
        ]
        loader = run_engine({**spec, "jobs": jobs}, work, f"{slug}-load")
    except AssertionError as exc:
        return [Row.unavailable(f"ttft_{slug}_hit", "s", f"{peer} did not run: {_cause(str(exc))}")]
    rows = []
    for n in prompts:
        hit = loader.results[f"hit/{n}"]
        runs = hit["seconds"] if isinstance(hit["seconds"], list) else [hit["seconds"]]
        # A first run far slower than the rest, without the prefix counted cached, computed
        # it: the second engine did not find what the first stored, and its later "hits" read
        # what it stored itself.
        recomputed = hit["cached"] < n and runs[0] > 5 * min(runs)
        note = (
            f"runs {', '.join(f'{x:.3f}' for x in runs)} s; {hit['cached']} tokens counted cached"
        )
        if recomputed:
            note += "; NOT LIKE FOR LIKE: the first run recomputed the prefix"
        rows.append(
            Row(name=f"ttft_{slug}_hit_{n // 1024}k", value=_median(runs), unit="s", note=note)
        )
    return rows


def _cause(log: str) -> str:
    """The engine's own error line in a failed engine's log (the last one naming an error)."""
    lines = [ln.strip() for ln in log.splitlines() if re.search(r"(Error|error)\b", ln)]
    line = lines[-1] if lines else log.splitlines()[0]
    return re.sub(r"^.*?\] ", "", line)[:300]


def _mooncake_rows(
    base: dict[str, Any], prompts: dict[int, list[int]], repeat: int, work: Path
) -> list[Row]:
    """vLLM's MooncakeStoreConnector over a Mooncake master and Mooncake's standalone store
    process on 127.0.0.1 (TCP), where the wheel imports and a loopback-only network namespace
    keeps their listeners off the network. The engines mount no memory of their own
    (``standalone-store``): what the first engine stores outlives it, as in the tier."""
    import _peers

    problem = _peers.mooncake_problem()
    if problem is not None:
        return [Row.unavailable("ttft_mooncake_hit", "s", problem)]
    with (
        _peers.mooncake_master() as master,
        _peers.mooncake_store_process(master, 1 << 30),
    ):
        config = work / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "256MB",
                }
            )
        )
        transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        env = {"MOONCAKE_CONFIG_PATH": str(config)}
        return _peer_rows("Mooncake", transfer, env, base, prompts, repeat, work)


if __name__ == "__main__":
    main()
