"""Faults injected under a running agent workload on the 3-node simulated cluster: pools
killed (5 times), directory shards killed (3 times), clients killed mid-store, disk records
corrupted while serving, a NIXL owner killed mid-read. Every page served is checked against
the tiny model's recomputation; at the end every acknowledged block must still be served
byte-exact. Figures go to the ledger (RELIABILITY.md)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from tessera_ray.actors.client import FetchResult, TesseraClient
from tessera_ray.actors.messages import PoolStatus, StoredBlock
from tessera_ray.actors.tenancy import Credential
from tessera_ray.core.results import TokenKey
from tessera_ray.demo.engine import Engine
from tessera_ray.errors import PoolUnavailableError
from tests.chaos.ledger import Ledger
from tests.chaos.workload import Agents, flip_bytes, process_of, wait_alive

pytestmark = pytest.mark.ray

_KILL_GAP_S = 1.5


def _status(client: TesseraClient, pool: str) -> PoolStatus:
    status: PoolStatus = ray.get(client.pool(pool).status.remote())
    return status


def _progress_after(agents: Agents, turns: int, timeout_s: float = 60.0) -> bool:
    """True once the workload completed a turn after ``turns`` (it survived the fault)."""
    deadline = time.monotonic() + timeout_s
    while agents.turns <= turns and time.monotonic() < deadline:
        time.sleep(0.1)
    return agents.turns > turns


def _fresh(engine: Engine, seed: int, blocks: int) -> tuple[torch.Tensor, int]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    tokens = torch.randint(0, engine.model.config.vocab_size, (blocks * 64,), generator=gen)
    return tokens, blocks


def test_pool_kills_under_load(agents: Agents, chaos_tier: TesseraClient, ledger: Ledger) -> None:
    for req in agents.requests[:6]:  # a warm tier: every pool holds blocks
        agents.turn(req)
    thread, stop = agents.background()
    try:
        for i in range(5):
            time.sleep(_KILL_GAP_S)
            victim = chaos_tier.pools[i % len(chaos_tier.pools)]
            turns = agents.turns
            pid = process_of(chaos_tier, victim)
            killed = time.monotonic()
            ray.kill(chaos_tier.pool(victim), no_restart=False)
            back = wait_alive(chaos_tier, victim, killed=pid)
            note = f"back in {time.monotonic() - killed:.1f} s"
            ok = back and _progress_after(agents, turns)
            ledger.fault("pool actor killed (Ray restarts it)", survived=ok, note=note)
            assert ok, f"pool {victim} did not come back or the workload stalled"
    finally:
        stop.set()
        thread.join(120)
    assert not agents.errors, agents.errors[:3]
    assert ledger.wrong_pages == 0, ledger.wrong
    # A restarted pool re-announced its disk tier: what it acknowledged is listed again.
    for pool in chaos_tier.pools:
        assert _status(chaos_tier, pool).blocks_on_disk > 0


def test_directory_shard_kills_under_load(
    agents: Agents, chaos_tier: TesseraClient, ledger: Ledger
) -> None:
    thread, stop = agents.background()
    try:
        for i in range(3):
            time.sleep(_KILL_GAP_S)
            turns = agents.turns
            killed = time.monotonic()
            ray.kill(chaos_tier.shard(i % chaos_tier.config.num_shards), no_restart=False)
            rebuilt = chaos_tier.wait_rebuilt(60)
            note = f"rebuilt in {time.monotonic() - killed:.1f} s"
            ok = rebuilt and _progress_after(agents, turns)
            ledger.fault("directory shard killed (restarts, rebuilds)", survived=ok, note=note)
            assert ok
    finally:
        stop.set()
        thread.join(120)
    assert not agents.errors, agents.errors[:3]
    assert ledger.wrong_pages == 0, ledger.wrong


def test_clients_killed_mid_store(
    chaos_tier: TesseraClient, engine: Engine, agents: Agents, ledger: Ledger
) -> None:
    pool = chaos_tier.pools[1]
    cred = agents.cred

    @ray.remote(num_cpus=0, max_retries=0)
    def die_mid_store(name: str, ns: str, keys: list[bytes], rows: np.ndarray, phase: str) -> None:
        import os

        actor = ray.get_actor(name, namespace=ns)
        res = ray.get(actor.reserve.remote(len(keys), 1.0))
        if phase == "commit":
            actor.commit.remote(res.id, cred, keys, rows)  # in flight when the process dies
            time.sleep(0.01)
        os._exit(1)

    cases = []
    for seed, phase in enumerate(["reserve", "commit", "commit"]):
        tokens, n = _fresh(engine, seed, 3)
        keys = engine.keys(cred.namespace, tokens)
        rows = engine.payloads(engine.prefill(tokens), range(n))
        with pytest.raises(ray.exceptions.RayError):
            ray.get(die_mid_store.remote(pool, chaos_tier.config.ray_namespace, keys, rows, phase))
        cases.append((phase, keys, rows))
    deadline = time.monotonic() + 15
    while _status(chaos_tier, pool).reservations and time.monotonic() < deadline:
        time.sleep(0.25)  # the 1 s leases expire; the pool's reaper returns the slots
    after = _status(chaos_tier, pool)
    for phase, keys, rows in cases:
        # All or nothing: a block is either served exactly as the client sent it, or absent.
        served = chaos_tier.read(cred, keys, pool=pool)
        whole = all(r is not None for r in served) or all(r is None for r in served)
        exact = all(
            ledger.check(cred.namespace, k, r, rows[i])
            for i, (k, r) in enumerate(zip(keys, served, strict=True))
            if r is not None
        )
        for i, (k, r) in enumerate(zip(keys, served, strict=True)):
            if r is not None:
                ledger.acknowledge(cred.namespace, k, rows[i])
        ok = after.reservations == 0 and whole and exact
        ledger.fault(
            f"client killed mid-store (after {phase})",
            survived=ok,
            note=f"{sum(r is not None for r in served)}/{len(keys)} blocks landed",
        )
        assert ok, (phase, after.reservations, [r is None for r in served])


def test_disk_records_corrupted_while_serving(
    agents: Agents, chaos_tier: TesseraClient, ledger: Ledger
) -> None:
    victim = chaos_tier.pools[2]
    cred = agents.cred
    ns = cred.namespace
    root = chaos_tier.config.pool.disk_root
    assert root is not None
    disk = Path(root) / victim
    acknowledged = [k for (n, k) in ledger.truth if n == ns]
    held = chaos_tier.pool(victim).contains.remote(cred, acknowledged)
    on_disk = [k for k, t in zip(acknowledged, ray.get(held), strict=True) if t is not None]
    assert len(on_disk) >= 4
    quarantined = _status(chaos_tier, victim).quarantines
    segments = sorted(
        (
            p
            for p in disk.rglob("*")
            if p.is_file() and "blocks" in p.parts and p.stat().st_size > 4096
        ),
        key=lambda p: p.stat().st_size,
    )
    assert segments, f"no disk records under {disk}"
    thread, stop = agents.background()
    corrupted = 0
    try:
        rng = np.random.default_rng(7)
        for seg in segments[-3:]:
            size = seg.stat().st_size
            flip_bytes(seg, sorted(int(x) for x in rng.integers(size // 4, size, 3)))
            corrupted += 1
        chaos_tier.evict(victim, chaos_tier.config.pool.num_blocks)  # reads must go to disk
        refused: list[bytes] = []
        for i in range(0, len(on_disk), 12):
            batch = on_disk[i : i + 12]
            rows = chaos_tier.read(cred, batch, pool=victim)
            for k, r in zip(batch, rows, strict=True):
                if r is None:
                    refused.append(k)
                else:
                    ledger.check_digest(ns, k, r)
    finally:
        stop.set()
        thread.join(120)
    status = _status(chaos_tier, victim)
    detected = status.quarantines - quarantined
    with ledger.lock:
        ledger.destroyed |= {(ns, k) for k in refused}
    ok = detected > 0 and ledger.wrong_pages == 0 and not agents.errors
    ledger.fault(
        "disk segment corrupted while serving (3 bytes flipped)",
        survived=ok,
        note=f"{corrupted} files, {detected} records quarantined, {len(refused)} blocks refused",
    )
    for _ in range(corrupted - 1):
        ledger.fault("disk segment corrupted while serving (3 bytes flipped)", survived=ok)
    assert ok, (detected, ledger.wrong, agents.errors[:3])


def _store_when_back(
    client: TesseraClient, cred: Credential, keys: list[TokenKey], rows: np.ndarray, pool: str
) -> list[StoredBlock]:
    """Store into a pool killed a moment ago. A clean-clone run saw the restarted process
    killed again half a second after it first answered (the GCS logs a second KillLocalActor
    for the same ray.kill), so a store meeting a restart waits for the pool and retries."""
    for _ in range(3):
        try:
            return client.store(cred, keys, rows, pool=pool)
        except PoolUnavailableError:
            assert wait_alive(client, pool)
    return client.store(cred, keys, rows, pool=pool)


def test_nixl_owner_killed_mid_read(
    chaos_tier: TesseraClient, engine: Engine, agents: Agents, ledger: Ledger
) -> None:
    cred = agents.cred
    reader, owner = chaos_tier.pools[0], chaos_tier.pools[1]
    for attempt, delay_s in enumerate([0.0, 0.02, 0.1]):
        tokens, n = _fresh(engine, 100 + attempt, 7)
        keys = engine.keys(cred.namespace, tokens)
        rows = engine.payloads(engine.prefill(tokens), range(n))
        stored = _store_when_back(chaos_tier, cred, keys, rows, owner)
        for s in stored:
            ledger.acknowledge(cred.namespace, s.token_key, rows[keys.index(s.token_key)])
        result: list[FetchResult] = []
        errors: list[Exception] = []

        def fetch(keys: list[bytes], result: list[FetchResult], errors: list[Exception]) -> None:
            try:
                result.append(chaos_tier.fetch(cred, keys, into=reader))
            except Exception as exc:  # recorded and asserted below
                errors.append(exc)

        pid = process_of(chaos_tier, owner)
        t = threading.Thread(target=fetch, args=(keys, result, errors))
        t.start()
        time.sleep(delay_s)
        ray.kill(chaos_tier.pool(owner), no_restart=False)
        t.join(120)
        assert wait_alive(chaos_tier, owner, killed=pid)
        fetched = set(result[0].fetched) if result else set()
        got = chaos_tier.read(cred, [k for k in keys if k in fetched], pool=reader)
        exact = all(
            ledger.check(cred.namespace, k, r, rows[keys.index(k)])
            for k, r in zip([k for k in keys if k in fetched], got, strict=True)
        )
        deadline = time.monotonic() + 15
        while _status(chaos_tier, reader).reservations and time.monotonic() < deadline:
            time.sleep(0.25)
        clean = _status(chaos_tier, reader).reservations == 0
        ok = exact and clean and not errors
        ledger.fault(
            "NIXL owner killed mid-read",
            survived=ok,
            note=f"after {delay_s * 1000:.0f} ms: {len(fetched)}/{n} fetched",
        )
        assert ok, (errors, exact, clean)


def test_every_acknowledged_block_is_served_at_the_end(
    chaos_tier: TesseraClient, agents: Agents, ledger: Ledger
) -> None:
    for pool in chaos_tier.pools:
        assert wait_alive(chaos_tier, pool)
    assert chaos_tier.wait_rebuilt(60)
    cred = agents.cred
    keys = [k for (n, k) in ledger.truth if n == cred.namespace]
    present, lost = 0, []
    reader = chaos_tier.pools[0]
    for i in range(0, len(keys), 12):
        batch = keys[i : i + 12]
        chaos_tier.fetch(cred, batch, into=reader)
        rows = chaos_tier.read(cred, batch, pool=reader)
        for k, r in zip(batch, rows, strict=True):
            if ledger.check_digest(cred.namespace, k, r):
                present += 1
            elif (cred.namespace, k) not in ledger.destroyed:
                # Where the tier thinks it is, and which pools hold it: tells a directory that
                # forgot a block from a pool that lost it.
                known = chaos_tier.lookup(cred, [k])[0]
                held = [
                    ray.get(chaos_tier.pool(p).contains.remote(cred, [k]))[0]
                    for p in chaos_tier.pools
                ]
                lost.append(f"{k[:6].hex()}: directory {known is not None}, pools hold {held}")
    destroyed_gone = len(keys) - present - len(lost)
    ledger.figures["final_accounting"] = {
        "acknowledged": len(keys),
        "served_byte_exact": present,
        "destroyed_by_injected_corruption": destroyed_gone,
        "lost": len(lost),
    }
    ledger.figures["workload_turns"] = agents.turns
    assert not lost, lost
    assert ledger.wrong_pages == 0, ledger.wrong
    # The tier's own loss counter agrees: write-through leaves no last copy to lose.
    assert all(_status(chaos_tier, p).lost_blocks == 0 for p in chaos_tier.pools)
