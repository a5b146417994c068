"""The fleet simulator checked against the real fleet: ``bench_serve.py``'s agent workload
written as a trace, a profile fitted to prefills timed on this machine's engines, and the
simulator's prediction of each router's run beside what the engines did.

What the simulator is given: the workload (prompts, rounds, how many turns a client sends at
once), the deployment (two replicas, one per node, a pool on each, the engines' KV space) and
a profile measured here (:func:`fit_profile`). What it is not given: anything the real runs
measured. The comparison says whether a fleet's tokens and time can be predicted from the
engine's cost alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from _trace_input import ModelProfile, TraceRequest
from _trace_routers import PowerOfTwo, RayPrefixAffinity, TesseraRouter
from _trace_sim import Fleet, Router, RunStats, request_keys

from tessera_ray.demo.endpoint import prompt_text
from tessera_ray.demo.workload import DemoConfig
from tessera_ray.demo.workload import Fleet as Workload

__all__ = ["fleet_trace", "fit_profile", "predict", "SIM_ROUTERS"]

BLOCK_TOKENS = 64  # the workload's blocks (the tier's), the unit the demo's prompts are built in

SIM_ROUTERS = {  # bench_serve's run name -> the simulator's router
    "power_of_two": lambda seed, n: PowerOfTwo(seed),
    "prefix_affinity": lambda seed, n: RayPrefixAffinity(seed, n),
    "tessera": lambda seed, n: TesseraRouter(seed, tier=True),
}


def fleet_trace(
    config: DemoConfig, encode: Callable[[str], list[int]] | None = None
) -> tuple[list[TraceRequest], list[list[int]]]:
    """The workload's turns as trace requests and its rounds (request indices a client sends
    round after round). A turn is sent as text (:func:`prompt_text`); ``encode``, the engine's
    tokenizer, gives the tokens the engine and the tier see, which are cut into the tier's
    64-token blocks (one id per block, equal ids exactly where the prefix up to and including
    the block is equal). Without it, the workload's own tokens stand for them."""
    turns = Workload(config, vocab_size=1000, block_tokens=BLOCK_TOKENS, num_pools=1).requests()
    ids: dict[tuple[int, bytes], int] = {}
    requests = []
    for q in turns:
        words = q.tokens.tolist()
        tokens = encode(prompt_text(words)) if encode is not None else words
        parent, hash_ids = -1, []
        for at in range(0, len(tokens), BLOCK_TOKENS):
            chunk = np.asarray(tokens[at : at + BLOCK_TOKENS], dtype=np.int64).tobytes()
            parent = ids.setdefault((parent, chunk), len(ids))
            hash_ids.append(parent)
        requests.append(TraceRequest(q.index, 0.0, len(tokens), 0, tuple(hash_ids), BLOCK_TOKENS))
    rounds = [
        [r.index for r in requests if turns[r.index].round == n] for n in range(config.num_rounds)
    ]
    return requests, rounds


def fit_profile(
    calibration: Sequence[dict[str, Any]],
    *,
    kv_bytes_per_token: int,
    engine_cache_tokens: int,
    pool_bytes_per_node: int,
    transfer_gb_s: float,
) -> ModelProfile:
    """A profile from cold prompts timed one at a time: first-token time = overhead + a x
    tokens + b x token pairs, by least squares (a term that would come out negative is left
    out and the rest refitted)."""
    cold = [c for c in calibration if c["cached_tokens"] == 0]
    if len(cold) < 3:
        raise ValueError(f"fit_profile: needs 3 or more cold prompts, got {len(cold)}")
    n = np.array([c["prompt_tokens"] for c in cold], dtype=np.float64)
    t = np.array([c["first_token_s"] for c in cold], dtype=np.float64)
    columns = {"overhead": np.ones_like(n), "token": n, "pair": n * (n + 1) / 2}
    while True:
        names = list(columns)
        coef = np.linalg.lstsq(np.stack([columns[k] for k in names], axis=1), t, rcond=None)[0]
        fit = dict(zip(names, coef, strict=True))
        negative = [k for k, v in fit.items() if v < 0 and k != "token"]
        if not negative:
            break
        del columns[negative[0]]
    return ModelProfile(
        name="measured-serve-fleet",
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_s_per_token=max(float(fit["token"]), 1e-9),
        attention_s_per_pair=float(fit.get("pair", 0.0)),
        decode_s_per_token=0.0,  # every turn asks for one token: it comes with the prefill
        max_running=256,  # vLLM's default batch limit; the fleet never comes near it
        engine_cache_tokens=engine_cache_tokens,
        replicas_per_node=1,
        pool_bytes_per_node=pool_bytes_per_node,
        disk_bytes_per_node=0,
        same_node_gb_s=transfer_gb_s,
        cross_node_gb_s=transfer_gb_s,
        disk_gb_s=transfer_gb_s,
        request_overhead_s=float(fit.get("overhead", 0.0)),
    )


def predict(
    config: DemoConfig,
    profile: ModelProfile,
    run: str,
    *,
    replicas: int = 2,
    concurrency: int = 4,
    seed: int = 0,
    encode: Callable[[str], list[int]] | None = None,
) -> RunStats:
    """The simulator's run of bench_serve's ``run``: every router over the tier, as there."""
    requests, rounds = fleet_trace(config, encode)
    router: Router = SIM_ROUTERS[run](seed, replicas)
    fleet = Fleet(profile, replicas, tier=True, block_tokens=BLOCK_TOKENS)
    keys = request_keys(requests)
    return fleet.run(requests, keys, router, rounds=rounds, concurrency=concurrency)
