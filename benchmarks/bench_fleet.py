"""Agent fleet: 16 agents sharing a 32K-token prefix on the tiny MLA model, over the tier.

The prefix's KV is computed once with the tiny model (chunked causal prefill, ``_prefill.py``;
checked against the model's dense prefill) and stored by the first agent into one pool. Then:

- ``recompute_block_ms``: recomputing the prefix's last block (64 tokens) over the other cached
  blocks, the cheapest a miss of one block can cost the engine (measured before the tier
  starts, so its NIXL progress threads take no core from it). ``recompute_prefix_s``: the whole
  prefix computed from nothing, what a miss of the shared prefix costs.
- ``reuse_block_fetch_ms``: one block fetched by token key into another pool (directory lookup,
  owner pin, NIXL READ, verify, seal), through the public client; ``reuse_prefix_fetch_s``: the
  whole prefix fetched into a third pool in one call, the first contact between the two pools
  included; ``reuse_prefix_refetch_s``: the same again after evicting it there, the median of
  several (the steady state). The ``*_vs_recompute`` rows compare the two as blocks per second.
- ``fleet_bytes_*``: after every agent fetched the prefix into its pool (agents spread over
  three pools), computed its own last block and stored it: the bytes the agents' prompts hold
  (what a cache keyed per request stores, without dedup), the distinct blocks the tier holds
  (with dedup), and the bytes in the pools' memory counting each pool's replica.

``--quick``: a 2,048-token prefix.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
# Before anything loads UCX: its ib module crashes a process at exit with some system
# libibverbs (this single-host benchmark has no use for RDMA); an operator's choice stays.
os.environ.setdefault("UCX_MODULES", "^ib")

import ray  # noqa: E402
import torch  # noqa: E402
from _prefill import ChunkedPrefill  # noqa: E402
from common import Row, parse_args, start_local_ray, write_result  # noqa: E402

from tessera_ray.actors.client import TesseraClient  # noqa: E402
from tessera_ray.actors.config import PoolServiceConfig, TierConfig  # noqa: E402
from tessera_ray.actors.messages import PoolStatus  # noqa: E402
from tessera_ray.demo.engine import Engine  # noqa: E402

NUM_AGENTS = 16
BUILD_CHUNK = 512
"""Tokens per chunk when computing the prefix (a typical chunked-prefill size)."""


def _timed(fn: object, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    args = parse_args("fleet")
    prefix_tokens = 2_048 if args.quick else 32_768
    reps = 5 if args.quick else 9
    engine = Engine(1)
    bt = engine.block_tokens
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, engine.model.config.vocab_size, (prefix_tokens,), generator=gen)
    own = torch.randint(0, engine.model.config.vocab_size, (NUM_AGENTS, bt), generator=gen)
    ChunkedPrefill.check(engine.model, prefix[: 4 * bt], chunk=bt)

    cache = ChunkedPrefill(engine.model, prefix_tokens + bt)
    start = time.perf_counter()
    for at in range(0, prefix_tokens, BUILD_CHUNK):
        cache.extend(prefix[at : at + BUILD_CHUNK], kv_only=True)
    recompute_prefix_s = time.perf_counter() - start
    payloads = cache.payloads(bt).numpy()

    def recompute_last() -> None:
        cache.truncate(prefix_tokens - bt)
        cache.extend(prefix[-bt:])

    recompute_last()  # warm-up
    recompute_block_s = _timed(recompute_last, reps)

    start_local_ray()
    num_blocks = prefix_tokens // bt + NUM_AGENTS + 8
    config = TierConfig(
        model=engine.layout.model,
        pool=PoolServiceConfig(num_blocks=num_blocks),
        num_shards=2,
        ray_namespace="tessera-bench-fleet",
        pools_per_node=3,
    )
    client = TesseraClient.start(config, layout=engine.layout, quiet=True)
    ns = "fleet"
    try:
        owner, single, whole = client.pools[:3]
        keys = engine.keys(ns, prefix)
        client.store(ns, keys, payloads, pool=owner)

        # One block at a time, each a block the target pool does not hold yet.
        sample = iter(keys[-(reps + 1) :])

        def fetch_one() -> None:
            result = client.fetch(ns, [next(sample)], into=single)
            assert len(result.fetched) == 1, result

        fetch_one()  # warm-up
        reuse_block_s = _timed(fetch_one, reps)
        start = time.perf_counter()
        result = client.fetch(ns, keys, into=whole)
        reuse_prefix_s = time.perf_counter() - start
        assert len(result.fetched) == len(keys), result
        # The same prefix again into that pool once its copy was evicted: connections, peers
        # and channels are set up by now, so this is the public fetch's steady-state cost.
        refetch = []
        for _ in range(reps):
            report = client.evict(whole, len(keys))
            assert len(report.dropped) == len(keys), report  # the owner still holds them
            start = time.perf_counter()
            again = client.fetch(ns, keys, into=whole)
            refetch.append(time.perf_counter() - start)
            assert len(again.fetched) == len(keys), again
        reuse_prefix_refetch_s = statistics.median(refetch)

        requested = 0
        for agent in range(NUM_AGENTS):
            pool = client.pools[agent % 3]
            tokens = torch.cat([prefix, own[agent]])
            agent_keys = engine.keys(ns, tokens)
            requested += len(agent_keys)
            got = client.fetch(ns, agent_keys, into=pool)
            assert got.available >= set(keys), "the shared prefix must be served by the tier"
            cache.truncate(prefix_tokens)
            cache.extend(own[agent])  # the agent's own block, over the shared prefix
            mine = cache.payloads(bt, first=prefix_tokens // bt).numpy()
            client.store(ns, agent_keys[-1:], mine, pool=pool)
        pools, shards = client.status()
        held = sum(p.blocks_in_memory for p in pools if isinstance(p, PoolStatus))
        distinct = sum(s.blocks for s in shards if not isinstance(s, str))
    finally:
        client.stop()
        ray.shutdown()

    block_bytes = engine.block_bytes
    blocks = prefix_tokens // bt
    what = f"{NUM_AGENTS} agents, {prefix_tokens:,}-token prefix"
    what += f" ({blocks} blocks of {block_bytes:,} B)"
    without = requested * block_bytes
    rows = [
        Row(name="recompute_block_ms", value=recompute_block_s * 1e3, unit="ms",
            note=f"tiny MLA model, last 64-token block over {blocks - 1} cached blocks"),
        Row(name="reuse_block_fetch_ms", value=reuse_block_s * 1e3, unit="ms",
            note="one block into another pool: lookup, pin, NIXL READ, verify, seal"),
        Row(name="reuse_block_vs_recompute", value=1 / reuse_block_s, unit="blocks/s",
            baseline="recompute_block", baseline_value=1 / recompute_block_s,
            derived_from="reuse_block_fetch_ms and recompute_block_ms (blocks/s = 1 / time)",
            note="one block fetched vs recomputed (ratio: how many times faster reuse is)"),
        Row(name="recompute_prefix_s", value=recompute_prefix_s, unit="s",
            note=f"tiny MLA model, {prefix_tokens:,} tokens in chunks of {BUILD_CHUNK}, KV only"),
        Row(name="reuse_prefix_fetch_s", value=reuse_prefix_s, unit="s",
            note=f"{blocks} blocks into another pool, one fetch call"),
        Row(name="reuse_prefix_refetch_s", value=reuse_prefix_refetch_s, unit="s",
            note=f"the same {blocks} blocks into that pool again after evicting them there "
            f"(median of {reps}; first contact with the owner done): "
            f"{blocks * block_bytes / reuse_prefix_refetch_s / 1e9:.2f} GB/s through the "
            "public client (directory lookup, pin, READ, verify, seal, register)"),
        Row(name="reuse_prefix_vs_recompute", value=1 / reuse_prefix_s, unit="prefixes/s",
            baseline="recompute_prefix", baseline_value=1 / recompute_prefix_s,
            derived_from="reuse_prefix_fetch_s and recompute_prefix_s (prefixes/s = 1 / time)",
            note="whole shared prefix fetched vs recomputed"),
        Row(name="fleet_bytes_without_dedup", value=without, unit="B",
            note=f"{what}: every agent's prompt blocks, as a cache keyed per request stores them"),
        Row(name="fleet_bytes_with_dedup", value=distinct * block_bytes, unit="B",
            baseline="fleet_bytes_without_dedup", baseline_value=without,
            note=f"{what}: distinct blocks the tier holds ({distinct})"),
        Row(name="fleet_bytes_in_pool_memory", value=held * block_bytes, unit="B",
            baseline="fleet_bytes_without_dedup", baseline_value=without,
            note=f"{what}: blocks in the 3 pools' memory ({held}), each pool's replica counted"),
    ]  # fmt: skip
    write_result("fleet", args, rows)


if __name__ == "__main__":
    main()
