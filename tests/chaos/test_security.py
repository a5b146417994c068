"""Hostile input on the running tier: a forced-collision campaign across tenants, tenant
namespaces with credentials, forged leases and credentials, path traversal, malformed and
oversized requests (each refused with nothing changed), and Ray's token authentication."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tessera_ray.actors.client import POOL_PREFIX, PoolActor, TesseraClient
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.tenancy import MAX_BATCH_KEYS, Credential
from tessera_ray.core import token_key
from tessera_ray.errors import InvalidKeyError, TenantError, TesseraError
from tessera_ray.storage import DiskTier
from tests.chaos.conftest import SECRET
from tests.chaos.ledger import Ledger
from tests.conftest import SimCluster
from tests.metrics._weak_hash import BITS, weak_hash

pytestmark = pytest.mark.ray


def _keys(client: TesseraClient, ns: str, n: int, salt: int) -> list[bytes]:
    out, parent = [], None
    for i in range(n):
        parent = token_key(ns, client.layout.fingerprint, parent, [salt, i] * 32)
        out.append(parent)
    return out


def _rows(client: TesseraClient, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, client.layout.block_bytes), dtype=np.uint8)


def _state(client: TesseraClient, pool: str) -> tuple[int, ...]:
    s = ray.get(client.pool(pool).status.remote())
    shards = [ray.get(client.shard(i).stats.remote()) for i in range(client.config.num_shards)]
    return (
        s.blocks_in_memory,
        s.blocks_free,
        s.blocks_on_disk,
        s.reservations,
        s.pins,
        sum(d.token_keys for d in shards),
    )


def test_forced_collisions_across_tenants_serve_nothing_wrong(
    chaos_tier: TesseraClient, tessera_cluster: SimCluster, ledger: Ledger
) -> None:
    """A pool sealing with a 4-bit content hash: nearly every page collides, across tenants
    too; byte comparison keeps every tenant's blocks its own."""
    name = f"{POOL_PREFIX}weak-chaos"
    cfg = PoolServiceConfig(num_blocks=96, lease_s=5.0)
    ns = chaos_tier.config.ray_namespace
    actor = PoolActor.options(  # type: ignore[attr-defined]
        name=name,
        namespace=ns,
        scheduling_strategy=NodeAffinitySchedulingStrategy(tessera_cluster.node_ids[0], False),
    ).remote(name, chaos_tier.layout, cfg, ns, chaos_tier.config.num_shards, weak_hash, SECRET)
    ray.get(actor.ready.remote())
    try:
        tenants = {t: chaos_tier.issue_credential(t) for t in ("collide-a", "collide-b")}
        shared = _rows(chaos_tier, 6, 99)  # identical bytes stored by both tenants
        data = {}
        for i, (t, cred) in enumerate(tenants.items()):
            rows = np.concatenate([_rows(chaos_tier, 34, i), shared])
            keys = _keys(chaos_tier, t, len(rows), 7)
            chaos_tier.store(cred, keys, rows, pool=name)
            data[t] = (keys, rows)
        for t, cred in tenants.items():
            keys, rows = data[t]
            got = ray.get(actor.read.remote(cred, keys))
            for k, r, want in zip(keys, got, rows, strict=True):
                assert ledger.check(t, k, r, want)
        status = ray.get(actor.status.remote())
        pages = sum(len(d[1]) for d in data.values()) * len(chaos_tier.layout.groups[0].layers)
        ledger.figures["collision_campaign"] = {
            "hash_bits": BITS,
            "tenants": len(tenants),
            "pages_sealed": pages,
            "collisions_detected": status.collisions,
            "dedup_hits": status.dedup_hits,
            "wrong_pages_served": 0,
        }
        assert status.collisions > pages // 2
        assert ledger.wrong_pages == 0
    finally:
        ray.kill(actor, no_restart=True)


def test_tenants_cannot_reach_each_other_without_a_grant(
    chaos_tier: TesseraClient, ledger: Ledger
) -> None:
    a, b = chaos_tier.issue_credential("tenant-a"), chaos_tier.issue_credential("tenant-b")
    pool, other = chaos_tier.pools[0], chaos_tier.pools[1]
    keys, rows = _keys(chaos_tier, "tenant-a", 4, 1), _rows(chaos_tier, 4, 1)
    chaos_tier.store(a, keys, rows, pool=pool)
    before = _state(chaos_tier, other)
    # B holds A's token keys, under its own credential: nothing.
    assert chaos_tier.lookup(b, keys) == [None] * 4
    result = chaos_tier.fetch(b, keys, into=other)
    assert set(result.missed) == set(keys) and not result.fetched
    assert chaos_tier.read(b, keys, pool=pool) == [None] * 4
    attempts: dict[str, Any] = {
        "namespace named by a plain string": "tenant-a",
        "credential with another tenant's MAC": Credential("tenant-a", (), b.mac),
        "credential with a widened grant": dataclasses.replace(b, reads=("tenant-a",)),
        "credential redirected to another namespace": dataclasses.replace(b, acting_on="tenant-a"),
        "credential signed with another secret": Credential("tenant-a", (), bytes(32)),
    }
    calls: list[Callable[[Any], object]] = [
        lambda acc: chaos_tier.lookup(acc, keys),
        lambda acc: chaos_tier.fetch(acc, keys, into=other),
        lambda acc: chaos_tier.read(acc, keys, pool=pool),
        lambda acc: chaos_tier.check_blocks(acc, keys, pool=pool),
        lambda acc: chaos_tier.store(
            acc, _keys(chaos_tier, "tenant-a", 1, 9), rows[:1], pool=other
        ),
    ]
    for what, access in attempts.items():
        for call in calls:
            with pytest.raises(TenantError) as info:
                call(access)
            unchanged = _state(chaos_tier, other) == before
            ledger.rejection(
                what, rejected=True, unchanged=unchanged, error=type(info.value).__name__
            )
            assert unchanged
    # Explicit sharing: the operator grants B reads of A; writes stay A's alone.
    granted = chaos_tier.issue_credential("tenant-b", reads=["tenant-a"]).on("tenant-a")
    assert all(r is not None for r in chaos_tier.lookup(granted, keys))
    assert set(chaos_tier.fetch(granted, keys, into=other).fetched) == set(keys)
    got = chaos_tier.read(granted, keys, pool=other)
    assert all(ledger.check("tenant-a", k, r, w) for k, r, w in zip(keys, got, rows, strict=True))
    with pytest.raises(TenantError, match="not write it"):
        chaos_tier.store(granted, _keys(chaos_tier, "tenant-a", 1, 8), rows[:1], pool=other)
    ledger.rejection(
        "write through a read grant", rejected=True, unchanged=True, error="TenantError"
    )


def test_malformed_and_forged_requests_change_nothing(
    chaos_tier: TesseraClient, ledger: Ledger
) -> None:
    cred = chaos_tier.issue_credential("hostile")
    pool = chaos_tier.pools[2]
    actor = chaos_tier.pool(pool)
    good_keys = _keys(chaos_tier, "hostile", 2, 3)
    good_rows = _rows(chaos_tier, 2, 3)
    chaos_tier.store(cred, good_keys, good_rows, pool=pool)
    ticket = ray.get(actor.pin.remote(cred, good_keys))
    ray.get(actor.unpin.remote(ticket.id))
    bb = chaos_tier.layout.block_bytes

    def store(keys: list[bytes], rows: np.ndarray) -> None:
        # The client's two-phase store: a refused commit is aborted before the error arrives.
        chaos_tier.store(cred, keys, rows, pool=pool)

    # Each case raises, from the call itself or from ray.get of the call's answer.
    cases: dict[str, Callable[[], Any]] = {
        "payload of the wrong dtype": lambda: store(good_keys, good_rows.astype(np.int16)),
        "payload of the wrong shape": lambda: store(good_keys, np.zeros((2, bb - 1), np.uint8)),
        "fewer payload rows than keys": lambda: store(good_keys, good_rows[:1]),
        "token key of 31 bytes": lambda: store([b"x" * 31], good_rows[:1]),
        "token key that is a str": lambda: actor.contains.remote(cred, ["k" * 32]),
        "oversized batch (65,537 keys)": lambda: actor.contains.remote(
            cred, good_keys[:1] * (MAX_BATCH_KEYS + 1)
        ),
        "oversized lookup (65,537 keys)": lambda: chaos_tier.shard(0).lookup.remote(
            cred, [bytes(32)] * (MAX_BATCH_KEYS + 1)
        ),
        "negative block count": lambda: actor.reserve.remote(-1),
        "bool block count": lambda: actor.reserve.remote(True),
        "block count beyond the pool": lambda: actor.reserve.remote(10**9),
        "lease beyond the maximum": lambda: actor.reserve.remote(1, 10**9),
        "forged reservation id": lambda: actor.commit.remote(
            12345, cred, good_keys[:1], good_rows[:1]
        ),
        "forged pin id (the last one + 1)": lambda: actor.read_pinned.remote(ticket.id + 1),
        "reused (released) pin id": lambda: actor.read_pinned.remote(ticket.id),
        "attention on a layer the model lacks": lambda: actor.attend.remote(
            cred, good_keys, [0], 999, None, 64, 1.0
        ),
        "credential whose MAC is not bytes": lambda: actor.contains.remote(
            dataclasses.replace(cred, mac="00" * 32), good_keys
        ),
        "tenant name with a NUL byte": lambda: actor.contains.remote(
            dataclasses.replace(cred, tenant="host\x00ile"), good_keys
        ),
    }
    for what, make in cases.items():
        before = _state(chaos_tier, pool)
        with pytest.raises(TesseraError) as info:
            ray.get(make())
        unchanged = _state(chaos_tier, pool) == before
        ledger.rejection(what, rejected=True, unchanged=unchanged, error=type(info.value).__name__)
        assert unchanged, what
    # What was stored before the barrage is still served, byte-exact.
    got = chaos_tier.read(cred, good_keys, pool=pool)
    assert all(
        ledger.check("hostile", k, r, w) for k, r, w in zip(good_keys, got, good_rows, strict=True)
    )


def test_forged_page_handles_are_rejected_in_the_pool_engine(ledger: Ledger) -> None:
    """Handles are plain numbers: every forged region, offset, length, generation or stale
    handle (the core suite's cases) is refused, with the pool's records and bytes unchanged."""
    from tests.core.test_pool_errors import CASES, pool_with_handles, snapshot

    for name, error, call in CASES:
        pool, handles = pool_with_handles()
        before = snapshot(pool)
        with pytest.raises(error) as info:
            call(pool, handles)
        after = snapshot(pool)
        unchanged = (
            after[0] == before[0] and after[2] == before[2] and bool((after[1] == before[1]).all())
        )
        ledger.rejection(
            f"page handle / page call: {name}",
            rejected=True,
            unchanged=unchanged,
            error=type(info.value).__name__,
        )
        assert unchanged, name


def test_path_traversal_never_reaches_the_filesystem(
    chaos_tier: TesseraClient, tmp_path: Path, ledger: Ledger
) -> None:
    tier = DiskTier(tmp_path / "tier", 1 << 20, fingerprint=chaos_tier.layout.fingerprint)
    for key in ("../../etc/passwd", "/etc/passwd", "..", "a" * 31 + "/", "A" * 32, "\x00" * 32):
        with pytest.raises(InvalidKeyError):
            asyncio.run(tier.put(key, b"x" * 64))
        with pytest.raises(InvalidKeyError):
            asyncio.run(tier.get(key))
        ledger.rejection(
            "disk key with a path in it", rejected=True, unchanged=True, error="InvalidKeyError"
        )
    # A tenant whose name is a path: its blocks land inside the pool's disk root, nowhere else.
    root = chaos_tier.config.pool.disk_root
    assert root is not None
    outside = {p for p in Path(root).parent.rglob("*")} - set(Path(root).rglob("*"))
    evil = chaos_tier.issue_credential("../../../escape")
    keys = _keys(chaos_tier, "../../../escape", 2, 5)
    chaos_tier.store(evil, keys, _rows(chaos_tier, 2, 5), pool=chaos_tier.pools[0])
    after = {p for p in Path(root).parent.rglob("*")} - set(Path(root).rglob("*"))
    assert after == outside
    assert not any("escape" in p.name for p in Path(root).rglob("*"))
    ledger.rejection(
        "tenant name that is a path (stored, contained)", rejected=True, unchanged=True, error="-"
    )


def test_ray_token_authentication_is_on(tessera_cluster: SimCluster, ledger: Ledger) -> None:
    @ray.remote(num_cpus=0)
    def auth_enabled() -> bool:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return bool(is_token_auth_enabled())

    assert ray.get(auth_enabled.remote())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-cluster-token"}
    probe = (
        "import ray\n"
        f"ray.init(address={tessera_cluster.address!r}, _node_ip_address='127.0.0.1')\n"
        "print('CONNECTED', ray.cluster_resources())\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=90
        )
        refused = done.returncode != 0 and "CONNECTED" not in done.stdout
    except subprocess.TimeoutExpired:
        refused = True  # it never got in
    ledger.rejection(
        "driver with a wrong Ray auth token", rejected=refused, unchanged=True, error="refused"
    )
    assert refused
