"""Directory benchmark: batched lookups against a no-op actor call, memory per entry at 10^6
blocks, and store / lookup latency of one 32K-token DeepSeek-V3 request through the tier.

Rows:
- ``lookup_batch_{1,64,1024}``: keys looked up per second through one shard actor, batch of N
  keys per call; baseline: no-op actor calls per second in the same run (ratio = keys per
  no-op call time: how much one round trip carries).
- ``directory_bytes_per_entry``: Python heap bytes per registered block (one token key, one
  replica) of a DirectoryShard holding 10^6 blocks (10^5 with ``--quick``), tracemalloc.
- ``request_store_p50/p99``, ``request_lookup_p50/p99``: one request of 32,768 tokens of
  DeepSeek-V3 (512 blocks of 61 x 73,728 B = 2.3 GB) stored into a pool actor (reserve +
  commit with the bytes) and looked up (one call per shard); 4,096 tokens with ``--quick``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback

import numpy as np
import ray
from common import Row, parse_args, start_local_ray, write_result

if __package__ is None or __package__ == "":
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import (
    DirectoryShard,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.core import token_key
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.layout import preset_layout


@ray.remote(num_cpus=0)
class _Noop:
    def call(self, keys: list[bytes]) -> int:
        return len(keys)


def _keys(n: int, ns: str, fingerprint: str, salt: int = 0) -> list[TokenKey]:
    out, parent = [], None
    for i in range(n):
        parent = token_key(ns, fingerprint, parent, [salt, i] * 32)
        out.append(parent)
    return out


def _rate(fn: Callable[[], int], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


def entry_bytes(n: int) -> float:
    gc.collect()
    shard = DirectoryShard()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    step = 10_000
    for base in range(0, n, step):
        batch = [
            Registration(
                "tenant",
                TokenKey(os.urandom(32)),
                BlockHash(int.from_bytes(os.urandom(16), "big")),
                Replica("tessera-pool-node-0", Tier.MEMORY, base + i, 0),
            )
            for i in range(min(step, n - base))
        ]
        shard.register(batch)
        del batch
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert shard.stats().blocks == n
    return used / n


def main() -> None:
    args = parse_args("directory")
    rows: list[Row] = []
    n_entries = 100_000 if args.quick else 1_000_000
    rows.append(
        Row(
            name="directory_bytes_per_entry",
            value=entry_bytes(n_entries),
            unit="B",
            note=f"{n_entries:,} blocks, one key and one replica each",
        )
    )

    tokens = 4_096 if args.quick else 32_768
    layout = preset_layout("deepseek-v3")
    num_blocks = tokens // layout.block_tokens
    start_local_ray(object_store_bytes=(1 << 30) if args.quick else (6 << 30))
    config = TierConfig(
        model="deepseek-v3",
        pool=PoolServiceConfig(num_blocks=num_blocks),
        num_shards=2,
        ray_namespace="tessera-bench-directory",
    )
    client = TesseraClient.start(config, layout=layout)
    pool = client.pools[0]
    try:
        noop = _Noop.remote()  # type: ignore[attr-defined]
        ray.get(noop.call.remote([]))
        seconds = 1.0 if args.quick else 3.0
        noop_rate = _rate(lambda: ray.get(noop.call.remote([b"x" * 32])) or 1, seconds)
        ns = "bench"
        keys = [k for k in _keys(2400, ns, layout.fingerprint) if shard_of(k, 2) == 0][:1024]
        shard = client.shard(0)
        for batch in (1, 64, 1024):
            batch_keys = keys[:batch]
            rate = _rate(lambda b=batch_keys: len(ray.get(shard.lookup.remote(ns, b))), seconds)
            rows.append(
                Row(
                    name=f"lookup_batch_{batch}",
                    value=rate,
                    unit="keys/s",
                    baseline="noop_actor_call",
                    baseline_value=noop_rate,
                    note=f"{batch} keys per call to one shard actor",
                )
            )
        repeats = 3 if args.quick else 7
        store_s, lookup_s = [], []
        rng = np.random.default_rng(0)
        payload = rng.integers(0, 256, (num_blocks, layout.block_bytes), dtype=np.uint8)
        payload_ref = ray.put(payload)  # the bytes are already in the object store, as a
        # worker that produced them would have them
        for r in range(repeats):
            req_keys = _keys(num_blocks, f"req-{r}", layout.fingerprint, salt=r)
            start = time.perf_counter()
            actor = client.pool(pool)
            res = ray.get(actor.reserve.remote(num_blocks))
            ray.get(actor.commit.remote(res.id, f"req-{r}", req_keys, payload_ref))
            store_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            found = client.lookup(f"req-{r}", req_keys)
            lookup_s.append(time.perf_counter() - start)
            assert all(f is not None for f in found)
            ray.get(actor.evict.remote(num_blocks))
        gb = num_blocks * layout.block_bytes / 1e9
        for name, samples in (("request_store", store_s), ("request_lookup", lookup_s)):
            qs = statistics.quantiles(samples, n=100, method="inclusive")
            note = f"{tokens:,} tokens = {num_blocks} blocks ({gb:.2f} GB), {repeats} requests"
            rows.append(Row(name=f"{name}_p50", value=qs[49] * 1e3, unit="ms", note=note))
            rows.append(Row(name=f"{name}_p99", value=qs[98] * 1e3, unit="ms", note=note))
    finally:
        client.stop()
        ray.shutdown()
    write_result("directory", args, rows)


if __name__ == "__main__":
    main()
