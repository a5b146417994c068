"""Where a tier hit's time goes on the connector's path, stage by stage and process by process,
against what the machine does with the same bytes and no code of ours (issue #51's "measure
first").

One node, two pools (``pools_per_node=2``); this process plays the engine's connector: the
scheduler's lookup and the worker's read and store, through the road an engine takes
(``NodeTier``: the pool's channel, no Ray) and, for comparison, the Ray road (``RayTier``).
The hit is ``TOKENS`` tokens of a 27-layer MLA model (DeepSeek-V2-Lite's geometry: 576 bf16
values per token per layer), 64-token blocks.

Rows, each the hit's bytes over the stage's median wall time (GB/s), against one thread's
memcpy of the same bytes measured in the same run:

- ``read_local_node``: the worker's read of a hit this node's pool holds: pin over the channel,
  the pages read where they lie in the pool's mapped memory and every layer's hashes checked
  (the worker checks each layer's just before it copies them into vLLM's cache, a copy this row
  does not make), unpin;
- ``read_pulled_node``: a hit only the other pool holds: the lookup (which starts the pull into
  this node's pool), then the read (waits for the pull, pins, copies);
- ``read_answer_node``: the same read with no mapped reader (the road of a hybrid layout's
  blocks): the pool copies the blocks into a shared-memory slab of the engine's, which it maps;
- ``read_local_ray`` and ``read_answer_ray``: the same two reads on the Ray road (the answer
  through Ray's object store);
- ``store_node`` and ``store_ray``: one store of the hit's blocks (one call either way);
- ``lookup_node`` and ``lookup_ray``: the scheduler's lookup of the hit's keys, all held here
  (µs per lookup over ``LOOKUPS`` in a row, no baseline).

Each row's note gives the CPU time of this process and of the pool processes per run.
``--quick``: a 1,024-token hit, 3 runs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ.setdefault("UCX_MODULES", "^ib")

from _engine_rows import memcpy_seconds  # noqa: E402
from common import Row, parse_args, start_local_ray, write_result  # noqa: E402

TOKENS = 4096
RUNS = 7
BLOCK_TOKENS = 64
LOOKUPS = 50
NS = "bench"
_T = TypeVar("_T")


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Stage:
    """Wall and CPU time of one stage over its runs."""

    def __init__(self, pool_pids: list[int]) -> None:
        self.pool_pids = pool_pids
        self.wall: list[float] = []
        self.engine_cpu: list[float] = []
        self.pool_cpu: list[float] = []

    def time(self, fn: Callable[[], _T]) -> _T:
        pools0 = sum(_cpu_s(p) for p in self.pool_pids)
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        self.wall.append(time.perf_counter() - t0)
        self.engine_cpu.append(time.process_time() - cpu0)
        self.pool_cpu.append(sum(_cpu_s(p) for p in self.pool_pids) - pools0)
        return out

    def note(self) -> str:
        ms = [1e3 * statistics.median(x) for x in (self.wall, self.engine_cpu, self.pool_cpu)]
        return (
            f"median of {len(self.wall)} runs: wall {ms[0]:.1f} ms, CPU of this process "
            f"{ms[1]:.1f} ms, of the pool processes {ms[2]:.1f} ms"
        )

    def gbps(self, nbytes: int) -> float:
        return nbytes / statistics.median(self.wall) / 1e9


def _lookups(road: Any, keys: list[bytes]) -> None:
    """The scheduler's lookup, :data:`LOOKUPS` times in a row (one alone is too short to time
    beside the rest)."""
    for _ in range(LOOKUPS):
        road.lookup(NS, keys)


def _checked_read(road: Any, keys: list[bytes], hits: Any, layers: int) -> Any:
    """The worker's read with every page checked against its seal: a read in place hands the
    check to its caller, which runs it layer by layer as it lands them (the worker)."""
    got = road.read(NS, keys, hits)
    if got.check_layer is not None:
        rows = range(len(got.payloads))
        bad = [b for layer in range(layers) for b in got.check_layer(layer, rows)]
        assert not bad, f"pages {bad} do not match their seals"
    return got


def _lookup_then_read(road: Any, keys: list[bytes]) -> Any:
    """The scheduler's lookup (which starts the pull), then the worker's read."""
    return road.read(NS, keys, road.lookup(NS, keys))


def measure(tokens: int, runs: int) -> list[Row]:
    import ray

    from tessera_ray.actors.client import TesseraClient
    from tessera_ray.actors.config import PoolServiceConfig, TierConfig
    from tessera_ray.core import token_key
    from tessera_ray.layout import MLAConfig, build_layout
    from tessera_ray.transport import TransportConfig
    from tessera_ray.vllm.config import TesseraConnectorConfig
    from tessera_ray.vllm.node_tier import NodeTier, announced_pool
    from tessera_ray.vllm.ray_tier import RayTier

    layout = build_layout(
        MLAConfig(name="bench-mla-27", num_layers=27, num_heads=16, block_tokens=BLOCK_TOKENS)
    )
    blocks = tokens // BLOCK_TOKENS
    rng = np.random.default_rng(0)

    def hit(seed: int) -> tuple[list[bytes], np.ndarray]:
        keys = [token_key(NS, layout.fingerprint, None, [seed, i] * 8) for i in range(blocks)]
        rows = rng.integers(0, 256, (blocks, layout.block_bytes), dtype=np.uint8)
        return keys, rows

    capacity = blocks * (2 * runs + 4)
    start_local_ray(object_store_bytes=max(512 << 20, 4 * blocks * layout.block_bytes))
    config = TierConfig(
        model=layout.model,
        pool=PoolServiceConfig(num_blocks=capacity, transport=TransportConfig(kind="nixl")),
        num_shards=2,
        pools_per_node=2,
        ray_namespace="tessera-bench-connector",
    )
    client = TesseraClient.start(config, layout=layout, quiet=True)
    try:
        here, there = client.pools[0], client.pools[1]
        pids = [
            ray.get(client.pool(p).__ray_call__.remote(lambda s: os.getpid()))
            for p in (here, there)
        ]
        cfg = TesseraConnectorConfig(
            ray_namespace=config.ray_namespace,
            pool=here,
            nixl_staging_bytes=2 * blocks * layout.block_bytes,
        )
        entry = announced_pool(cfg)
        assert entry is not None, "the pool announced no channel"
        node = NodeTier(cfg, entry)
        answers = NodeTier(
            TesseraConnectorConfig(
                ray_namespace=config.ray_namespace, pool=here, nixl_staging_bytes=0
            ),
            entry,
        )
        by_ray = RayTier(cfg)
        answers_by_ray = RayTier(
            TesseraConnectorConfig(
                ray_namespace=config.ray_namespace, pool=here, nixl_staging_bytes=0
            )
        )
        for road in (node, answers, by_ray, answers_by_ray):
            road.prepare_reads()
        stages = {
            name: _Stage(pids)
            for name in (
                "store_node",
                "store_ray",
                "lookup_node",
                "lookup_ray",
                "read_local_node",
                "read_answer_node",
                "read_local_ray",
                "read_answer_ray",
                "read_pulled_node",
            )
        }
        nbytes = blocks * layout.block_bytes
        keys, rows = hit(1)
        node.store(NS, keys, rows)  # warms both roads (a first call connects)
        by_ray.store(NS, keys, rows)
        found = node.lookup(NS, keys)
        reads = {
            "read_local_node": node,
            "read_answer_node": answers,
            "read_local_ray": by_ray,
            "read_answer_ray": answers_by_ray,
        }
        for r in range(runs):
            # Each stage starts with the pools idle: a store's registration with the directory
            # ends after its answer, and would slow whatever came next.
            stages["lookup_node"].time(partial(_lookups, node, keys))
            stages["lookup_ray"].time(partial(_lookups, by_ray, keys))
            for name, road in reads.items():
                read = partial(_checked_read, road, keys, found, layout.num_layers)
                got = stages[name].time(read)
                assert all(g is not None for g in got), f"{name} missed"
            stages["store_node"].time(partial(node.store, NS, *hit(100 + r)))
            time.sleep(0.2)
            stages["store_ray"].time(partial(by_ray.store, NS, *hit(200 + r)))
            time.sleep(0.2)
            away, away_rows = hit(300 + r)
            client.store(NS, away, away_rows, pool=there)
            got = stages["read_pulled_node"].time(partial(_lookup_then_read, node, away))
            assert np.array_equal(np.stack([g.payload for g in got]), away_rows)
        carrier = node.read(NS, keys, None).carrier
        for road in (node, answers, by_ray, answers_by_ray):
            road.release_reads()
    finally:
        client.stop()
        ray.shutdown()
    memcpy = rows.nbytes / memcpy_seconds(rows.nbytes, runs) / 1e9
    gb = dict(baseline="memcpy_one_thread", baseline_value=memcpy)
    out = [
        Row(
            name="memcpy_one_thread",
            value=memcpy,
            unit="GB/s",
            note=f"the hit's {nbytes / 1e6:.0f} MB, np.copyto",
        )
    ]
    for name in (
        "read_local_node",
        "read_pulled_node",
        "read_answer_node",
        "read_local_ray",
        "read_answer_ray",
        "store_node",
        "store_ray",
    ):
        note = stages[name].note()
        if name == "read_local_node":
            note += f"; carried by {carrier!r}"
        out.append(Row(name=name, value=stages[name].gbps(nbytes), unit="GB/s", note=note, **gb))
    for name in ("lookup_node", "lookup_ray"):
        us = 1e6 * statistics.median(stages[name].wall) / LOOKUPS
        out.append(
            Row(
                name=name,
                value=us,
                unit="us",
                note=f"{blocks} keys, all held here, {LOOKUPS} lookups a run; "
                + stages[name].note(),
            )
        )
    return out


def main() -> None:
    args = parse_args("connector")
    tokens, runs = (1024, 3) if args.quick else (TOKENS, RUNS)
    write_result("connector", args, measure(tokens, runs))


if __name__ == "__main__":
    main()
