"""Directory benchmark: the compact shard in process (memory per entry, batched lookups,
rebuild at 10^6 and 10^7 entries), batched lookups through a shard actor against a no-op actor
call, and store / lookup latency of one 32K-token DeepSeek-V3 request through the tier.

Rows:
- ``directory_bytes_per_entry_1e6`` / ``_1e7``: bytes per registered block (one token key, one
  block, one replica) of a DirectoryShard holding exactly 10^6 / 10^7 blocks, registered in
  batches of 65,536; tracemalloc over the registration (numpy's arrays are traced), the tables'
  array bytes in the note. Asserted here to stay at most 128 B (issue #42's bound).
- ``directory_lookups_per_s_1e6`` / ``_1e7``: keys looked up per second in process, one thread,
  batches of 1,024 registered keys, the answer left as columns (what a shard actor pickles);
  baseline: ``dict.get`` of the same keys in a dict holding them, the same batches.
- ``directory_lookup_results_per_s_1e6``: the same lookups with every ``LookupResult`` built
  (what an in-process caller iterating the answer pays).
- ``directory_rebuild_s_1e7``: a restarted shard rebuilt from 10 pool inventories of 10^6
  blocks each (``rebuild_from`` per inventory, the inventories built beforehand, untimed).
- ``lookup_batch_{1,64,1024}``: keys looked up per second through one shard actor, batch of N
  keys per call; baseline: no-op actor calls per second in the same run (ratio = keys per
  no-op call time: how much one round trip carries).
- ``request_store_p50/p99``, ``request_lookup_p50/p99``: one request of 32,768 tokens of
  DeepSeek-V3 (512 blocks of 61 x 73,728 B = 2.3 GB) stored into a pool actor (reserve +
  commit with the bytes) and looked up (one call per shard); 4,096 tokens with ``--quick``.

``--quick`` measures the in-process rows at 10^5 and 3 x 10^5 entries (rows named so).
"""

from __future__ import annotations

import functools
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from itertools import repeat
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
    Registrations,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.actors.tenancy import MAX_BATCH_KEYS
from tessera_ray.core import token_key
from tessera_ray.core.results import TokenKey
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


MAX_BYTES_PER_ENTRY = 128
"""Issue #42's bound on a shard's memory per entry at 10^7 entries."""
POOL = "tessera-pool-node-0"
LOOKUP_BATCH = 1024
_new_replica = functools.partial(tuple.__new__, Replica)
_new_registration = functools.partial(tuple.__new__, Registration)


def _batch(seed: int, index: int, first: int, n: int) -> tuple[list[TokenKey], Registrations]:
    """Batch ``index`` of a run: ``n`` random keys and block hashes (the same for the same
    arguments, so a later phase can ask for keys registered earlier without keeping them),
    one replica each on one pool. Built without Python code per entry so that generating
    10^7 takes seconds (the named tuples' own constructors are Python functions)."""
    rng = np.random.default_rng([seed, index])
    blob = rng.bytes(32 * n)
    keys = [TokenKey(blob[i : i + 32]) for i in range(0, 32 * n, 32)]
    words = rng.integers(0, 2**64, (n, 2), dtype=np.uint64).tolist()
    hashes = [hi << 64 | lo for hi, lo in words]
    replicas = map(
        _new_replica, zip(repeat(POOL), repeat(Tier.MEMORY), range(first, first + n), repeat(0))
    )
    entries = Registrations(map(_new_registration, zip(repeat("tenant"), keys, hashes, replicas)))
    return keys, entries


def _batches(n: int, size: int) -> list[tuple[int, int, int]]:
    """(index, first entry, entries) of each batch of ``n`` entries."""
    return [(i, first, min(size, n - first)) for i, first in enumerate(range(0, n, size))]


def fill(shard: DirectoryShard, n: int, seed: int) -> tuple[float, int]:
    """Register ``n`` entries in batches of MAX_BATCH_KEYS; returns the seconds spent in
    ``register`` and the bytes tracemalloc saw stay allocated (the batches are freed)."""
    # A throwaway shard first: what the first use of numpy's functions allocates for good is not
    # the shard's.
    DirectoryShard().register(_batch(seed + 1, 0, 0, 1024)[1])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    spent = 0.0
    for index, first, size in _batches(n, MAX_BATCH_KEYS):
        entries = _batch(seed, index, first, size)[1]  # the keys freed with it
        start = time.perf_counter()
        shard.register(entries)
        spent += time.perf_counter() - start
        del entries
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert shard.stats().blocks == n
    return spent, used


def _sample(n: int, seed: int, keys: int) -> list[TokenKey]:
    """About ``keys`` keys registered by :func:`fill`, from batches spread over the run."""
    batches = _batches(n, MAX_BATCH_KEYS)
    picked = batches[:: max(1, len(batches) * MAX_BATCH_KEYS // keys)]
    return [k for index, first, size in picked for k in _batch(seed, index, first, size)[0]]


def _lookup_rows(shard: DirectoryShard, label: str, n: int, seed: int, seconds: float) -> list[Row]:
    sample = _sample(n, seed, 1 << 17)
    rng = random.Random(seed)
    batches = [rng.sample(sample, LOOKUP_BATCH) for _ in range(256)]
    held = dict.fromkeys(sample, 1)
    answers = iter(range(1 << 62))

    def columns() -> int:
        return len(shard.lookup("tenant", batches[next(answers) % len(batches)]))

    def results() -> int:
        return len(list(shard.lookup("tenant", batches[next(answers) % len(batches)])))

    def dict_get() -> int:
        return len(list(map(held.get, batches[next(answers) % len(batches)])))

    assert all(r is not None for r in shard.lookup("tenant", batches[0]))
    columns()  # warm
    base = _rate(dict_get, seconds)
    rate = _rate(columns, seconds)
    note = (
        f"{n:,} entries, batches of {LOOKUP_BATCH} registered keys, one thread; "
        f"target >= 1,000,000 keys/s: {'met' if rate >= 1e6 else 'MISSED'}"
    )
    rows = [
        Row(
            name=f"directory_lookups_per_s_{label}",
            value=rate,
            unit="keys/s",
            baseline="dict_get_same_keys",
            baseline_value=base,
            note=note,
        )
    ]
    if label in ("1e5", "1e6"):
        rows.append(
            Row(
                name=f"directory_lookup_results_per_s_{label}",
                value=_rate(results, seconds),
                unit="keys/s",
                baseline=f"directory_lookups_per_s_{label}",
                baseline_value=rate,
                note=f"{n:,} entries, the same lookups with every LookupResult built",
            )
        )
    return rows


def shard_rows(n: int, label: str, seconds: float, *, rebuild: bool) -> list[Row]:
    """The in-process rows at ``n`` entries; the shard is freed before returning."""
    seed = n
    shard = DirectoryShard()
    register_s, used = fill(shard, n, seed)
    per_entry = used / n
    tables = shard.table_bytes()
    arrays = sum(tables.values()) / n
    by_table = ", ".join(f"{name} {size / n:.1f}" for name, size in tables.items())
    assert per_entry <= MAX_BYTES_PER_ENTRY, f"{per_entry:.1f} B per entry at {n:,} entries"
    rows = [
        Row(
            name=f"directory_bytes_per_entry_{label}",
            value=per_entry,
            unit="B",
            note=(
                f"{n:,} blocks, one key and one replica each (tracemalloc); the tables' arrays "
                f"{arrays:.1f} B ({by_table}); registered in {register_s:.1f} s (tracemalloc "
                f"on); at most {MAX_BYTES_PER_ENTRY} B asserted"
            ),
        ),
        *_lookup_rows(shard, label, n, seed, seconds),
    ]
    del shard
    if rebuild:
        rows.append(rebuild_row(n, label, seed))
    return rows


def rebuild_row(n: int, label: str, seed: int) -> Row:
    """A fresh shard learns the same ``n`` entries from 10 pools' inventories."""
    gc.collect()
    shard = DirectoryShard()
    pools = 10
    spent = 0.0
    batches = _batches(n, MAX_BATCH_KEYS)
    for part in np.array_split(np.arange(len(batches)), pools):
        # One pool's inventory: its part of the run's batches, as one list.
        inventory = Registrations()
        for b in part.tolist():
            inventory += _batch(seed, *batches[b])[1]
        start = time.perf_counter()
        shard.rebuild_from(inventory)
        spent += time.perf_counter() - start
        del inventory
    assert shard.stats().blocks == n
    return Row(
        name=f"directory_rebuild_s_{label}",
        value=spent,
        unit="s",
        note=f"{n:,} blocks from {pools} pool inventories, rebuild_from per inventory",
    )


def main() -> None:
    args = parse_args("directory")
    rows: list[Row] = []
    seconds = 1.0 if args.quick else 3.0
    sizes = (
        ((100_000, "1e5"), (300_000, "3e5"))
        if args.quick
        else (
            (1_000_000, "1e6"),
            (10_000_000, "1e7"),
        )
    )
    for n, label in sizes:
        rows += shard_rows(n, label, seconds, rebuild=n == sizes[-1][0])

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
