"""Running one real vLLM engine in its own process (``_run_engine.py``) and reading its report;
shared by the engine tests and ``benchmarks/bench_engine.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EngineRun",
    "run_engine",
    "ROOT",
    "same",
    "eviction_jobs",
    "EVICTION_ORDER",
    "check_eviction_run",
    "full_tokens",
]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class EngineRun:
    """What one engine process produced: its JSON report and its log."""

    report: dict[str, Any]
    log: str

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return self.report["results"]  # type: ignore[no-any-return]


def run_engine(spec: dict[str, Any], work: Path, name: str, timeout: float = 900) -> EngineRun:
    """Run one engine process on ``spec`` (see ``_run_engine.py``)."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    # vLLM's defaults, as a user's engine has them: nothing of this process's vLLM settings.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log_path = work / f"{name}.log"
    # The log goes to a file, not a pipe: a vLLM worker process that outlives the engine (its
    # shutdown can block on a message queue whose reader is gone) would hold a pipe open.
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engine._run_engine", str(spec_path), str(out_path)],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout)
        finally:
            _end_session(proc.pid)
    log = log_path.read_text(errors="replace")
    if returncode != 0 or not out_path.exists():
        raise AssertionError(f"engine {name} exited {returncode}; its log ends:\n{log[-4000:]}")
    return EngineRun(json.loads(out_path.read_text()), log)


def _end_session(session: int, grace_s: float = 30.0) -> None:
    """Let the engine's remaining processes (its session) exit, then kill what is left."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass


def full_tokens(prompt: list[int], tier: int) -> int:
    """Tokens of ``prompt`` in full tier blocks of ``tier`` tokens, its last token excluded
    (vLLM computes at least one token)."""
    return (len(prompt) - 1) // tier * tier


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Two runs generated the same tokens with the same logprobs."""
    return bool(got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"])


EVICTION_ORDER = ["q1", "q2", "q3", "q3", "q2", "q1"]
"""The prompts an eviction test runs, in order: three that the small tier cannot hold at once,
then back again, oldest last."""


def eviction_jobs(prompts: dict[str, list[int]], namespace: str) -> list[dict[str, Any]]:
    """The jobs of an eviction test over the small tier in ``namespace``: ``EVICTION_ORDER``,
    the tier's status, its pools killed, then ``q3`` and ``q4`` again.

    vLLM's own prefix cache is emptied before every run: it holds all of these prompts, and
    where the engine keeps prefix caching on (every GQA model; MLA and V4 on CPUs with AMX)
    a repeat would be its hit, not the tier's, and the tier's eviction would go untested."""
    jobs: list[dict[str, Any]] = [
        {"name": f"{n}/{i}", "prompt": prompts[n], "fresh_cache": True}
        for i, n in enumerate(EVICTION_ORDER)
    ]
    jobs += [{"tier_status": namespace}, {"kill_pools": namespace}]
    jobs += [
        {"name": f"{n}/after-kill", "prompt": prompts[n], "fresh_cache": True} for n in ("q3", "q4")
    ]
    return jobs


def check_eviction_run(small: EngineRun, reference: EngineRun, full: dict[str, int]) -> None:
    """An engine over a tier smaller than its working set ran :func:`eviction_jobs`: every
    answer is a full tier hit (``full[name]`` tokens, loaded by the connector) or a full
    recompute, each equal to the reference engine's run of that kind (``name/hit``,
    ``name/cold``); some were evicted; after the kill, all are recomputed."""
    hits = misses = 0
    counts = {k: r.get("connector") for k, r in small.results.items() if r.get("connector")}
    for i, name in enumerate(EVICTION_ORDER):
        got = small.results[f"{name}/{i}"]
        assert got["cached"] in (0, full[name]), f"{name}/{i}: partial hit {got['cached']}"
        kind = "hit" if got["cached"] else "cold"
        hits, misses = hits + (kind == "hit"), misses + (kind == "cold")
        assert same(got, reference.results[f"{name}/{kind}"]), f"{name}/{i} differs ({kind})"
        loaded = (got.get("connector") or {}).get("loaded_blocks")
        if kind == "hit" and loaded is not None:
            assert loaded > 0, f"{name}/{i}: a hit the tier did not load; counts {counts}"
    assert hits and misses > 3, (
        f"no eviction happened: {hits} hits, {misses} misses; connector counts {counts}; "
        f"tier {small.report.get('tier_status')}"
    )
    for name in ("q3", "q4"):
        assert same(small.results[f"{name}/after-kill"], reference.results[f"{name}/cold"])
