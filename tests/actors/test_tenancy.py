"""Tenant credentials and request limits, without Ray: the gate, a pool and the directory on a
tier started with a tenant secret."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import MAX_BATCH_KEYS, Credential, TenantGate
from tessera_ray.errors import BadRequestError, LeaseError, TenantError, TierConfigError
from tests.actors.test_pool_service import LAYOUT, keys, payloads, run

SECRET = b"0123456789abcdef-test-secret"


def closed_tier(disk: Path | None = None) -> tuple[TenantGate, PoolService, LocalDirectory]:
    gate = TenantGate(SECRET)
    directory = LocalDirectory(2, gate)
    cfg = PoolServiceConfig(num_blocks=8, disk_root=disk, lease_s=10.0)
    return gate, PoolService("p0", LAYOUT, cfg, directory=directory, gate=gate), directory


def test_gate_verifies_credentials_and_grants() -> None:
    gate = TenantGate(SECRET)
    a = gate.issue("tenant-a")
    b_reads_a = gate.issue("tenant-b", reads=["tenant-a", "tenant-b"])
    assert b_reads_a.reads == ("tenant-a",)  # its own namespace is implied, not listed
    assert gate.resolve(a, write=True) == "tenant-a"
    assert gate.resolve(b_reads_a.on("tenant-a"), write=False) == "tenant-a"
    with pytest.raises(TenantError, match="may read namespace 'tenant-a' but not write it"):
        gate.resolve(b_reads_a.on("tenant-a"), write=True)
    with pytest.raises(TenantError, match="requires a tenant credential"):
        gate.resolve("tenant-a", write=False)
    with pytest.raises(TenantError, match="not granted namespace 'tenant-c'"):
        a.on("tenant-c")
    # Forgeries: another tenant's MAC, widened grants, a redirected namespace, another secret.
    forged = [
        Credential("tenant-a", (), gate.issue("tenant-b").mac),
        dataclasses.replace(a, reads=("tenant-b",)),
        dataclasses.replace(a, acting_on="tenant-b"),
        TenantGate(b"another-secret-of-16-bytes").issue("tenant-a"),
    ]
    for cred in forged:
        with pytest.raises(TenantError):
            gate.resolve(cred, write=False)
    assert "mac" not in repr(a) and a.mac.hex() not in repr(a)


def test_open_gate_takes_strings_and_still_checks_grants() -> None:
    gate = TenantGate()
    assert not gate.closed and gate.resolve("ns", write=True) == "ns"
    for bad in ("", None, 7, "x" * 300, "a\x00b"):
        with pytest.raises(TenantError):
            gate.resolve(bad, write=False)
    with pytest.raises(TenantError, match="cannot issue"):
        gate.issue("t")
    with pytest.raises(TenantError, match="at least 16 bytes"):
        TenantGate(b"short")


def test_a_tenant_cannot_reach_another_tenants_blocks_even_with_its_keys() -> None:
    gate, pool, directory = closed_tier()
    a, b = gate.issue("tenant-a"), gate.issue("tenant-b")
    ka, data = keys(3, "tenant-a"), payloads(3, 0, pool.block_bytes)
    run(pool.store(a, ka, data))
    before = pool.status()
    # B knows A's token keys: under its own credential they name nothing.
    assert pool.contains(b, ka) == [None] * 3
    assert run(directory.lookup(b, ka)) == [None] * 3
    ticket = run(pool.pin(b, ka))
    assert ticket.blocks == (None, None, None)
    pool.unpin(ticket.id)
    # Naming A's namespace needs A's credential (or a grant).
    for attempt in ("tenant-a", Credential("tenant-a", (), b.mac)):
        with pytest.raises(TenantError):
            pool.contains(attempt, ka)
        with pytest.raises(TenantError):
            run(pool.pin(attempt, ka))
        with pytest.raises(TenantError):
            run(directory.lookup(attempt, ka))
        with pytest.raises(TenantError):
            run(pool.store(attempt, keys(1, "tenant-a", 50), payloads(1, 1, pool.block_bytes)))
    with pytest.raises(TenantError):
        b.on("tenant-a")
    after = pool.status()
    assert (after.blocks_in_memory, after.blocks_free, after.pins, after.reservations) == (
        before.blocks_in_memory,
        before.blocks_free,
        before.pins,
        before.reservations,
    )
    # Explicit sharing: the operator grants B reads of A.
    shared = gate.issue("tenant-b", reads=["tenant-a"]).on("tenant-a")
    assert pool.contains(shared, ka) == [Tier.MEMORY] * 3
    assert all(r is not None for r in run(directory.lookup(shared, ka)))
    ticket = run(pool.pin(shared, ka))
    assert np.array_equal(pool.read_pinned(ticket.id), data)
    pool.unpin(ticket.id)
    with pytest.raises(TenantError, match="not write it"):
        run(pool.store(shared, keys(1, "tenant-a", 60), payloads(1, 2, pool.block_bytes)))


def test_lease_ids_are_not_guessable() -> None:
    gate, pool, _ = closed_tier()
    a = gate.issue("tenant-a")
    run(pool.store(a, keys(2, "tenant-a"), payloads(2, 3, pool.block_bytes)))
    ticket = run(pool.pin(a, keys(2, "tenant-a")))
    res = run(pool.reserve(1))
    for guess in (ticket.id + 1, ticket.id - 1, res.id + 1, 1, 2):
        if guess in (ticket.id, res.id):
            continue
        with pytest.raises(LeaseError):
            pool.read_pinned(guess)
        assert not pool.unpin(guess)
        with pytest.raises(LeaseError):
            run(pool.commit(guess, a, keys(1, "tenant-a", 9), payloads(1, 0, pool.block_bytes)))
    assert abs(ticket.id - res.id) > 1 << 20


def test_oversized_batches_are_refused_whole() -> None:
    gate, pool, directory = closed_tier()
    a = gate.issue("tenant-a")
    huge = keys(1, "tenant-a") * (MAX_BATCH_KEYS + 1)
    before = pool.status()
    with pytest.raises(BadRequestError, match="split the request"):
        pool.contains(a, huge)
    with pytest.raises(BadRequestError, match="split the request"):
        run(directory.lookup(a, huge))
    with pytest.raises(BadRequestError, match="split the request"):
        run(pool.pin(a, huge))
    after = pool.status()
    assert (after.pins, after.blocks_free) == (before.pins, before.blocks_free)
    assert all(s.stats().lookups == 0 for s in directory.shards)


def test_write_through_puts_every_stored_block_on_disk(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="needs a disk tier"):
        PoolServiceConfig(num_blocks=4, write_through=True)
    directory = LocalDirectory(1)
    cfg = PoolServiceConfig(num_blocks=4, disk_root=tmp_path, write_through=True)
    pool = PoolService("p0", LAYOUT, cfg, directory=directory)
    ks, data = keys(3), payloads(3, 4, pool.block_bytes)
    run(pool.store("tenant-a", ks, data))
    assert pool.status().blocks_on_disk == 3
    tiers = [{rep.tier for rep in r.replicas} for r in run(directory.lookup("tenant-a", ks)) if r]
    assert tiers == [{Tier.MEMORY, Tier.DISK}] * 3
    # A new process on the same disk (the pool restarted) serves every acknowledged block.
    run(pool.close())
    again = PoolService("p0", LAYOUT, cfg, directory=LocalDirectory(1))
    assert run(again.reopen_disk()) == 3
    ticket = run(again.pin("tenant-a", ks))
    assert np.array_equal(again.read_pinned(ticket.id), data)
    run(again.close())
