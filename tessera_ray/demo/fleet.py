"""The main job end to end: an agent fleet on the tiny MLA model over the tier.

For each agent turn: compute the chained keys of the prompt's full blocks, ``fetch`` them into
the agent's pool (local hits stay; blocks in another pool move over NIXL or the object store;
blocks on disk are restored), run a real forward pass, store the blocks the tier did not have,
and for a sample of turns decode one step from the KV read back from the tier and from fresh KV
and compare the logits bit for bit. Only the public client API is used.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import LookupResult, Tier
from tessera_ray.actors.messages import PoolStatus
from tessera_ray.core.results import TokenKey
from tessera_ray.demo.engine import Engine
from tessera_ray.demo.report import DemoReport, RequestRecord, TierTotals
from tessera_ray.demo.workload import DemoConfig, Fleet, Request
from tessera_ray.errors import PoolExhaustedError
from tessera_ray.storage._progress import Progress

__all__ = ["run_demo"]


def run_demo(
    config: DemoConfig,
    *,
    progress: bool | None = None,
    pools_on: Sequence[str] | None = None,
) -> DemoReport:
    """Run the fleet and return what it measured.

    Starts an embedded local Ray when none is connected (and shuts it down at the end); on an
    already connected Ray (a test cluster) it leaves Ray running. The tier's actors live in
    ``config.ray_namespace`` and are stopped at the end; ``pools_on`` picks the nodes for the
    pools (default: every alive node, ``pools_per_node`` each). The disk tiers live in a
    temporary folder removed at the end.
    """
    t0 = time.perf_counter()
    engine = Engine(config.max_prompt_blocks() + 1)  # + 1: the partial tail block
    with tempfile.TemporaryDirectory(prefix="tessera-demo-", ignore_cleanup_errors=True) as disk:
        tier_config = TierConfig(
            model=engine.layout.model,
            pool=PoolServiceConfig(
                num_blocks=config.num_blocks_per_pool,
                disk_root=Path(disk),
                # A demo run holds a few MiB; a full disk tier would only hide spills.
                disk_capacity_bytes=1 << 30,
            ),
            num_shards=config.num_shards,
            ray_namespace=config.ray_namespace,
            pools_per_node=config.pools_per_node,
        )
        # Starts an embedded Ray when none is connected (and stop() shuts it down); the
        # actors' log lines (NIXL start-up) stay out of the summary.
        client = TesseraClient.start(
            tier_config, layout=engine.layout, pools_on=pools_on, quiet=True
        )
        try:
            client.wait_rebuilt()
            startup_s = time.perf_counter() - t0
            report = _run(client, engine, config, progress)
        finally:
            client.stop()
    report.startup_s = startup_s
    report.wall_s = time.perf_counter() - t0
    return report


def _run(
    client: TesseraClient, engine: Engine, config: DemoConfig, progress: bool | None
) -> DemoReport:
    fleet = Fleet(
        config,
        vocab_size=engine.model.config.vocab_size,
        block_tokens=engine.block_tokens,
        num_pools=len(client.pools),
    )
    requests = fleet.requests()
    bar = Progress(
        "demo requests",
        len(requests),
        enabled=Progress.wanted(len(requests), min_items=1, force=progress),
    )
    records: list[RequestRecord] = []
    skipped = 0
    for req in requests:
        record, was_skipped = _serve(client, engine, config, req)
        records.append(record)
        skipped += was_skipped
        bar.advance()
    bar.close()
    pools, shards = client.status()
    live = [p for p in pools if isinstance(p, PoolStatus)]
    notes = [f"unreachable at the end: {p}" for p in pools if isinstance(p, str)]
    notes += [f"unreachable at the end: {s}" for s in shards if isinstance(s, str)]
    stats = [s for s in shards if not isinstance(s, str)]
    tier = TierTotals(
        blocks_in_memory=sum(p.blocks_in_memory for p in live),
        blocks_on_disk=sum(p.blocks_on_disk for p in live),
        transfers_in=sum(p.transfers_in for p in live),
        bytes_in=sum(p.bytes_in for p in live),
        spills=sum(p.spills for p in live),
        restores=sum(p.restores for p in live),
        evictions=sum(p.evictions for p in live),
        dedup_hits=sum(p.dedup_hits for p in live),
        collisions=sum(p.collisions for p in live),
        lost_blocks=sum(p.lost_blocks for p in live),
        transports=sorted({p.transport for p in live}),
        directory_lookups=sum(s.lookups for s in stats),
        directory_hits=sum(s.hits for s in stats),
    )
    return DemoReport(
        config=dataclasses.asdict(config),
        pools=list(client.pools),
        block_bytes=engine.block_bytes,
        block_tokens=engine.block_tokens,
        requests=records,
        tier=tier,
        wall_s=0.0,
        startup_s=0.0,
        parity_skipped=skipped,
        notes=notes,
    )


def _serve(
    client: TesseraClient, engine: Engine, config: DemoConfig, req: Request
) -> tuple[RequestRecord, int]:
    """One agent turn; returns its record and 1 when its sampled parity check could not run."""
    started = time.perf_counter()
    ns, bt = config.tenant, engine.block_tokens
    pool = client.pools[req.pool_index]
    keys = engine.keys(ns, req.tokens)
    # Where each block is before the fetch, to say which tier served it: fetch reports only
    # "local" or "fetched".
    before = client.lookup(ns, keys)
    available, local, errors = _fetch(client, ns, keys, before, pool)
    served = 0
    while served < len(keys) and keys[served] in available:
        served += 1
    tiers = {"local": 0, "remote": 0, "disk": 0}
    for key, found in zip(keys[:served], before[:served], strict=True):
        if key in local:
            tiers["local"] += bt
        elif found is not None and any(
            r.tier == Tier.MEMORY and r.pool != pool for r in found.replicas
        ):
            tiers["remote"] += bt
        else:
            tiers["disk"] += bt
    pages = engine.prefill(req.tokens)  # a real forward pass
    missing = [i for i, k in enumerate(keys) if k not in available]
    if missing:
        client.store(ns, [keys[i] for i in missing], engine.payloads(pages, missing), pool=pool)
    parity: bool | None = None
    skipped = 0
    if req.index % config.parity_every == 0 and keys:
        parity = _parity(client, engine, ns, keys, pool, pages, req.tokens)
        skipped = int(parity is None)
    record = RequestRecord(
        index=req.index,
        round=req.round,
        agent=req.agent,
        pool=pool,
        tokens_requested=req.tokens.numel(),
        served_local=tiers["local"],
        served_remote=tiers["remote"],
        served_disk=tiers["disk"],
        tokens_computed=req.tokens.numel() - served * bt,
        blocks_requested=len(keys),
        blocks_stored=len(missing),
        parity=parity,
        fetch_errors=errors,
        elapsed_s=time.perf_counter() - started,
    )
    return record, skipped


def _fetch(
    client: TesseraClient,
    ns: str,
    keys: list[TokenKey],
    before: list[LookupResult | None],
    pool: str,
) -> tuple[set[TokenKey], set[TokenKey], int]:
    """Fetch the blocks into ``pool``, one owner at a time; returns the keys now available
    there, those that already were, and how many blocks a failed fetch left out.

    Why one owner at a time: ``fetch`` pulls from every owner concurrently, and concurrent
    pulls into one small pool can each find the other's reservations holding the slots it
    would evict (the pool then answers ``PoolExhaustedError``). The demo's pools are small on
    purpose, so it asks owner by owner, in the order ``fetch`` itself prefers replicas.
    """
    groups: dict[str, list[TokenKey]] = {}
    for key, found in zip(keys, before, strict=True):
        if found is None:
            continue
        best = min(found.replicas, key=lambda r: (r.tier != Tier.MEMORY, r.pool != pool))
        owner = pool if best.pool == pool and best.tier == Tier.MEMORY else best.pool
        groups.setdefault(owner, []).append(key)
    available: set[TokenKey] = set()
    local: set[TokenKey] = set()
    errors = 0
    for group in groups.values():
        try:
            result = client.fetch(ns, group, into=pool)
        except PoolExhaustedError:
            errors += len(group)  # a miss: the engine computes these blocks
            continue
        available |= result.available
        local |= set(result.local_hits)
    return available, local, errors


def _parity(
    client: TesseraClient,
    engine: Engine,
    ns: str,
    keys: list[TokenKey],
    pool: str,
    fresh: list[torch.Tensor],
    tokens: torch.Tensor,
) -> bool | None:
    """Decode one step from the tier's bytes and from fresh KV; ``None`` when the tier no longer
    has every block (evicted between the store and the read: a miss, never a wrong answer)."""
    rows = client.read(ns, keys, pool=pool)
    if any(r is None for r in rows):
        # Dropped from this pool's memory because a replica lives elsewhere: pull it back.
        _fetch(client, ns, keys, client.lookup(ns, keys), pool)
        rows = client.read(ns, keys, pool=pool)
    if any(r is None for r in rows):
        return None
    through = engine.pages_from([r for r in rows if r is not None])
    fresh_copy = [p.clone() for p in fresh]  # decode writes the new token's KV into the pages
    return bool(torch.equal(engine.decode(fresh_copy, tokens), engine.decode(through, tokens)))
