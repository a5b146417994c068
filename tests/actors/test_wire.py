"""The batched messages that cross process boundaries on every fetch pickle as flat columns
(``LookupAnswer``, ``Registrations``, ``PinTicket``) and come back equal, field for field,
through the standard pickler and through Ray's; the columns name no per-record class."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import ray.cloudpickle as cloudpickle

from tessera_ray.actors.directory import (
    DirectoryShard,
    LookupAnswer,
    LookupResult,
    Registration,
    Registrations,
    Replica,
    Tier,
)
from tessera_ray.actors.messages import PinnedBlock, PinTicket
from tessera_ray.core.results import BlockHash, TokenKey

PICKLERS = [pytest.param(pickle.dumps, id="pickle"), pytest.param(cloudpickle.dumps, id="ray")]


def key(i: int) -> TokenKey:
    return TokenKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


def registrations(n: int) -> Registrations:
    """Two namespaces, three pools, both tiers, 128-bit-sized block hashes."""
    return Registrations(
        Registration(
            "a" if i % 3 else "b",
            key(i),
            BlockHash((1 << 127) + i),
            Replica(f"pool-{i % 3}", Tier(i % 2), i, i // 2),
        )
        for i in range(n)
    )


@pytest.mark.parametrize("dumps", PICKLERS)
def test_registrations_round_trip_as_a_plain_list(dumps: object) -> None:
    regs = registrations(50)
    data = dumps(regs)  # type: ignore[operator]
    back = pickle.loads(data)
    assert type(back) is list and back == list(regs)
    assert all(type(r.replica.tier) is Tier for r in back)
    assert b"Registration" not in data and b"Replica" not in data  # columns, not records
    assert pickle.loads(dumps(Registrations())) == []  # type: ignore[operator]


@pytest.mark.parametrize("dumps", PICKLERS)
def test_lookup_answer_round_trips_hits_misses_and_every_replica(dumps: object) -> None:
    d = DirectoryShard()
    regs = registrations(40)
    d.register(regs)
    # A second replica of every fourth block of namespace "a", on a fourth pool.
    d.register(
        [
            Registration(r.namespace, r.token_key, r.block_hash, Replica("pool-x", Tier.DISK, 7, 1))
            for r in regs[::4]
            if r.namespace == "a"
        ]
    )
    answer = d.lookup("a", [key(i) for i in range(45)])
    assert isinstance(answer, LookupAnswer)
    assert any(r is None for r in answer) and any(r and len(r.replicas) == 2 for r in answer)
    data = dumps(answer)  # type: ignore[operator]
    back = pickle.loads(data)
    assert type(back) is list and back == list(answer)
    assert [r is None for r in back] == [r is None for r in answer]
    assert b"LookupResult" not in data and b"Replica" not in data
    misses = d.lookup("nobody", [key(0), key(1)])
    assert pickle.loads(dumps(misses)) == [None, None]  # type: ignore[operator]


def ticket(blocks: tuple[PinnedBlock | None, ...]) -> PinTicket:
    return PinTicket(41, "pool-0", "tenant", blocks, 1234.5, incarnation=99)


@pytest.mark.parametrize("dumps", PICKLERS)
def test_pin_ticket_round_trips_with_gaps_and_several_groups(dumps: object) -> None:
    blocks = tuple(
        None
        if i % 5 == 2
        else PinnedBlock(
            key(i),
            BlockHash(i + 1),
            ((3 * i, 3 * i + 1), (i,)),  # two layer groups of 2 and 1 pages
            (((1 << 127) + i, (1 << 126) + i), (i + 5,)),
        )
        for i in range(30)
    )
    t = ticket(blocks)
    data = dumps(t)  # type: ignore[operator]
    back = pickle.loads(data)
    assert back == t and back.blocks[2] is None
    assert b"PinnedBlock" not in data
    for empty in (ticket(()), ticket((None, None))):
        assert pickle.loads(dumps(empty)) == empty  # type: ignore[operator]


def test_records_are_named_tuples_compared_by_value() -> None:
    rep = Replica("p", Tier.MEMORY, 1, 2)
    hit = LookupResult(key(1), BlockHash(5), (rep,))
    assert hit == LookupResult(key(1), BlockHash(5), (Replica("p", Tier.MEMORY, 1, 2),))
    assert hit.replicas[0].slot == 1 and hash(rep) == hash(Replica("p", Tier.MEMORY, 1, 2))
    with pytest.raises(AttributeError):
        rep.slot = 3  # type: ignore[misc]
