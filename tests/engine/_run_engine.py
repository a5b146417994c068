"""Run one real vLLM engine (``vllm.LLM``, the default executor) through a list of jobs and write
what it generated as JSON: ``python -m tests.engine._run_engine SPEC.json OUT.json``.

Each engine runs in its own process (this script), as a user's engine would; vLLM spawns its
engine core and worker processes under it. The spec::

    {"model": dir, "block_size": int | null, "connector": {extra config} | null,
     "kv_transfer_config": {...} | null, "kv_role": "kv_both", "force_prefix_caching": bool,
     "enforce_eager": bool, "max_tokens": int, "env": {name: value}, "log_stats": bool,
     "connector_stats": bool,
     "jobs": [{"name": str, "prompt": [ids], "salt": str | null, "max_tokens": int,
               "repeat": int, "fresh_cache": bool}
              | {"name": str, "batch": [{"name", "prompt", "salt"}], "fresh_cache": bool}
              | {"kill_pools": ray namespace}
              | {"tier_status": ray namespace} | {"idle": str, "idle_s": float}]}

``connector`` is TesseraConnector's ``kv_connector_extra_config``; ``kv_transfer_config`` names
another connector whole (vLLM's own, for the benchmark's peers). A job's ``seconds`` is the
wall time of ``generate`` in this process (first token time with ``max_tokens`` 1), one per
``repeat``; the tokens and logprobs are the first run's, ``cached`` the first run's cached
prompt tokens and ``cached_runs`` every run's. ``fresh_cache`` empties vLLM's own
prefix cache before each run, so that a repeated prompt is a tier hit every time.

An ``idle`` job lets the engine sit (``settle_s``, default 3, then ``idle_s``) and records in
the output's ``idle[name]`` every process's CPU seconds over the ``idle_s`` window, per kind
of process (``tests/engine/_proc_cpu.py``), and the window; a generating job with ``"cpu":
true`` records the same over its runs as ``cpu`` (and ``cpu_window_s``).

A ``tier_status`` job records ``tessera-ray status --json`` of that tier in the output's
``tier_status`` (what a failing eviction test shows).

``force_prefix_caching``: vLLM's CPU build turns prefix caching off for MLA models on CPUs
without AMX (its reference MLA backend); a reference engine turns it back on, so that vLLM
itself computes a cached prefix, through the same context-attention path a tier hit takes.
The engine under test never sets it.

``log_stats``: vLLM's stat logging on (its periodic log line off). ``connector_stats`` implies
it, and each job's result gains ``connector``: the connector's counts over the job
(``tessera_ray.vllm.stats``), as vLLM's stat logger received them from the
scheduler and the workers. A benchmark that compares engines sets ``log_stats`` on all of them,
so that they differ only in the connector.

With ``"tries"`` instead of ``"jobs"`` (a list of connector configs), the engine is started
once per config and each start's outcome is recorded: a line ``=== try N ===`` on stderr
before each, so a test can find each failure's own message in the engine's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from tests.engine._proc_cpu import cpu_between, cpu_seconds

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _force_prefix_caching() -> None:
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_prefix_caching(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.cache_config.enable_prefix_caching
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = wanted

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_prefix_caching)  # type: ignore[assignment]


def _engine(spec: dict[str, Any], connector: dict[str, Any] | None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("force_prefix_caching"):
        kwargs["enable_prefix_caching"] = True
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    elif connector is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TesseraConnector",
            "kv_connector_module_path": "tessera_ray.vllm.connector",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector,
        }
    if spec.get("log_stats") or spec.get("connector_stats"):
        kwargs["disable_log_stats"] = False
        os.environ["VLLM_LOG_STATS_INTERVAL"] = "1e9"  # the jobs take the counts, not the log
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=spec.get("max_model_len", 8192),
        enforce_eager=spec.get("enforce_eager", True),
        seed=0,
        **kwargs,
    )


def _take_connector_counts(llm: Any) -> dict[str, Any]:
    """The connector counts vLLM's logging stat logger gathered since the last call."""
    manager = llm.llm_engine.logger_manager
    for stat_logger in manager.stat_loggers if manager is not None else ():
        for per_engine in getattr(stat_logger, "per_engine_stat_loggers", {}).values():
            logging = getattr(per_engine, "kv_connector_logging", None)
            if logging is not None:
                gathered = logging.transfer_stats_accumulator
                logging.reset()
                return dict(gathered.data) if gathered is not None else {}
    raise AssertionError("connector_stats: vLLM built no logging stat logger")


def _kill_pools(namespace: str) -> None:
    """Kill every pool actor of the tier in ``namespace`` (from another process: this one is
    not a Ray driver), and wait until each is gone."""
    code = (
        "import ray, time\n"
        f"ray.init(address='auto', namespace={namespace!r}, logging_level='ERROR')\n"
        "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)\n"
        f"         if a['namespace'] == {namespace!r} and a['name'].startswith('tessera-pool')]\n"
        "for n in names:\n"
        "    ray.kill(ray.get_actor(n), no_restart=True)\n"
        "for n in names:\n"
        "    while True:\n"
        "        try:\n"
        "            ray.get_actor(n)\n"
        "            time.sleep(0.1)\n"
        "        except ValueError:\n"
        "            break\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 0, f"no pool to kill in {namespace!r}"


def _tier_status(namespace: str) -> Any:
    """The tier's status in ``namespace`` as ``tessera-ray status --json`` prints it (pools'
    blocks, evictions, losses), for a failing test to show."""
    cli = os.path.join(os.path.dirname(sys.executable), "tessera-ray")
    out = subprocess.run(
        [cli, "status", "--ray-namespace", namespace, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.splitlines()[-1])


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    started = time.perf_counter()
    llm = _engine(spec, spec.get("connector"))
    config = llm.llm_engine.vllm_config
    out: dict[str, Any] = {
        "startup_s": time.perf_counter() - started,
        "block_size": config.cache_config.block_size,
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "results": {},
    }
    for job in spec["jobs"]:
        if "kill_pools" in job:
            _kill_pools(job["kill_pools"])
            continue
        if "idle" in job:
            time.sleep(job.get("settle_s", 3.0))
            before, t0 = cpu_seconds(), time.perf_counter()
            time.sleep(job["idle_s"])
            after, window = cpu_seconds(), time.perf_counter() - t0
            out.setdefault("idle", {})[job["idle"]] = {
                "cpu": cpu_between(before, after),
                "window_s": window,
            }
            continue
        if "tier_status" in job:
            out.setdefault("tier_status", {})[job["tier_status"]] = _tier_status(job["tier_status"])
            continue
        params = SamplingParams(
            max_tokens=job.get("max_tokens", spec.get("max_tokens", 8)),
            temperature=0.0,
            logprobs=1,
            detokenize=False,
        )
        if "batch" in job:  # prompts submitted together: vLLM schedules them in the same steps
            _run_batch(llm, job, params, out["results"])
            if spec.get("connector_stats"):
                out["results"][job["name"]] = {"connector": _take_connector_counts(llm)}
            continue
        prompt = _prompt_of(job)
        seconds, results = [], []
        cpu_before, cpu_t0 = (cpu_seconds(), time.perf_counter()) if job.get("cpu") else (None, 0.0)
        for _ in range(job.get("repeat", 1)):
            if job.get("fresh_cache"):
                llm.reset_prefix_cache()
            t0 = time.perf_counter()
            results += llm.generate([prompt], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
        out["results"][job["name"]] = {
            **_generated(results[0]),
            "cached_runs": [r.num_cached_tokens or 0 for r in results],
            "seconds": seconds[0] if len(seconds) == 1 else seconds,
        }
        if cpu_before is not None:
            out["results"][job["name"]]["cpu"] = cpu_between(cpu_before, cpu_seconds())
            out["results"][job["name"]]["cpu_window_s"] = time.perf_counter() - cpu_t0
        if spec.get("connector_stats"):
            out["results"][job["name"]]["connector"] = _take_connector_counts(llm)
    return out


def _prompt_of(job: dict[str, Any]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": job["prompt"]}
    if job.get("salt"):
        prompt["cache_salt"] = job["salt"]
    return prompt


def _generated(result: Any) -> dict[str, Any]:
    sample = result.outputs[0]
    assert sample.logprobs is not None
    return {
        "tokens": list(sample.token_ids),
        "logprobs": [
            lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)
        ],
        "cached": result.num_cached_tokens or 0,
    }


def _run_batch(llm: Any, job: dict[str, Any], params: Any, results: dict[str, Any]) -> None:
    """A ``batch`` job (``[{"name", "prompt", "salt"}]``) in one ``generate`` call."""
    if job.get("fresh_cache"):
        llm.reset_prefix_cache()
    outputs = llm.generate([_prompt_of(p) for p in job["batch"]], params, use_tqdm=False)
    for p, result in zip(job["batch"], outputs, strict=True):
        results[p["name"]] = _generated(result)


def _tries(spec: dict[str, Any]) -> dict[str, Any]:
    outcomes = []
    for i, connector in enumerate(spec["tries"]):
        print(f"=== try {i} ===", file=sys.stderr, flush=True)
        try:
            llm = _engine(spec, connector)
        except Exception as exc:
            outcomes.append({"started": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            outcomes.append({"started": True, "error": None})
            del llm
    print("=== done ===", file=sys.stderr, flush=True)
    return {"tries": outcomes}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.update(spec.get("env", {}))
    if spec.get("force_prefix_caching"):
        _force_prefix_caching()
    out = _tries(spec) if "tries" in spec else _run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
