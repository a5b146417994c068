"""The cross-pool fetch protocol without Ray: two PoolServices in this process, the owner
reached through an in-process link, bytes moved by the same-process transport or as a
payload. Every failure a fetch can meet is one test, each checking that the reader leaks no
slot and installs nothing unverified."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.fetcher import Fetcher, LocalOwnerLink
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.messages import BlockCheck, FetchFailure, PinTicket
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey
from tessera_ray.transport import LocalTransport, TransportConfig
from tests.actors._pools import LAYOUT, NS, Clock, keys, run
from tests.actors._pools import payloads as _payloads


def payloads(n: int, seed: int) -> np.ndarray:
    return _payloads(n, seed, LAYOUT.block_bytes)


class Pair:
    """An owner holding ``stored`` blocks and an empty reader, on one directory."""

    def __init__(self, *, one_sided: bool, clock: Clock, tag: str) -> None:
        self.directory = LocalDirectory(1)
        cfg = PoolServiceConfig(num_blocks=8, lease_s=10.0)
        self.owner = PoolService(f"owner-{tag}", LAYOUT, cfg, directory=self.directory)
        self.reader = PoolService(
            f"reader-{tag}", LAYOUT, cfg, directory=self.directory, clock=clock
        )
        self.transports: list[LocalTransport] = []
        peer = None
        if one_sided:
            for svc in (self.owner, self.reader):
                transport = LocalTransport(TransportConfig(kind="local"), name=svc.name)
                self.transports.append(transport)
                info = svc.attach_transport(transport)
                peer = info if svc is self.owner else peer
        self.link = LocalOwnerLink(self.owner, peer)
        self.fetcher = Fetcher(self.reader, lambda name: self.link)
        self.keys = keys(3)
        self.data = payloads(3, 1)
        run(self.owner.store(NS, self.keys, self.data))

    def pull(self, ks: list[TokenKey] | None = None, timeout_s: float = 5.0) -> list[Any]:
        async def go() -> list[Any]:
            out = await self.fetcher.pull(self.owner.name, NS, ks or self.keys, timeout_s)
            await self.fetcher.drain_reports()
            return out

        return run(go())

    def reader_clean(self) -> bool:
        """Nothing reserved or pinned is left behind, and the page books balance."""
        status = self.reader.status()
        for pool in self.reader.pools:
            pool.check_consistency()
        return status.reservations == 0 and status.pins == 0

    def owner_unpinned(self) -> bool:
        return self.owner.status().pins == 0

    def close(self) -> None:
        for t in self.transports:
            t.close()


_TAGS = iter(range(1 << 30))


@pytest.fixture(params=[True, False], ids=["one-sided", "payload"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(one_sided=request.param, clock=Clock(), tag=str(next(_TAGS)))
    yield p
    p.close()


def test_a_fetch_installs_every_block_with_the_owners_bytes(pair: Pair) -> None:
    assert pair.pull() == [None, None, None]
    assert pair.reader.contains(NS, pair.keys) == [Tier.MEMORY] * 3
    read = run(pair.reader.read_blocks(NS, pair.keys))
    assert all(
        r is not None and np.array_equal(r.payload, d) for r, d in zip(read, pair.data, strict=True)
    )
    assert pair.reader_clean() and pair.owner_unpinned()
    found = run(pair.directory.lookup(NS, pair.keys))
    assert all(r is not None and {x.pool for x in r.replicas} >= {pair.reader.name} for r in found)


def test_owner_dead_before_the_pin(pair: Pair) -> None:
    pair.link.alive = False
    reasons = pair.pull()
    assert [r.reason for r in reasons] == [FetchFailure.OWNER_UNAVAILABLE] * 3
    assert pair.reader.contains(NS, pair.keys) == [None] * 3
    assert pair.reader_clean() and pair.link.forgotten == 1


class _DiesAfterPin(LocalOwnerLink):
    """The owner's process ends once it has answered the pin: its memory is no longer
    readable and it answers nothing, but the directory still has its transport data."""

    def __init__(self, owner: PoolService, peer: Any, transports: list[LocalTransport]) -> None:
        super().__init__(owner, peer)
        self.transports = transports

    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        ticket = await super()._pin(access, keys)
        self.alive = False
        for t in self.transports:
            t.close()
        return ticket

    async def peer_info(self) -> Any:
        return self.peer


@pytest.mark.parametrize("met_before", [False, True], ids=["first-meeting", "known-peer"])
def test_owner_dead_after_the_pin(pair: Pair, met_before: bool) -> None:
    """Known peer: the one-sided read itself fails; first meeting: adding its agent does."""
    if met_before:
        assert pair.pull(pair.keys[:1]) == [None]
    pair.link = _DiesAfterPin(pair.owner, pair.link.peer, pair.transports[:1])
    rest = pair.keys[1:] if met_before else pair.keys
    reasons = pair.pull(rest)
    assert [r.reason for r in reasons] == [FetchFailure.TRANSFER_FAILED] * len(rest)
    assert pair.reader.contains(NS, rest) == [None] * len(rest)
    assert pair.reader_clean()


def test_a_block_that_rotted_at_the_owner_is_refused_and_the_owner_drops_it(pair: Pair) -> None:
    handles = pair.owner.pools[0].lookup(NS, pair.keys[1])
    assert handles is not None
    slot = handles[1].offset // handles[1].length
    pair.owner.pools[0].data[slot, 17] ^= 0x08  # bad RAM, after the page was sealed
    pair.owner.pools[0].release_many(list(handles))
    reasons = pair.pull()
    assert reasons[0] is None and reasons[2] is None
    assert reasons[1] is not None and reasons[1].reason is FetchFailure.HASH_MISMATCH
    assert pair.reader.contains(NS, pair.keys) == [Tier.MEMORY, None, Tier.MEMORY]
    # The owner was told, once unpinned, and dropped its rotten copy; the others are intact.
    assert pair.owner.contains(NS, pair.keys) == [Tier.MEMORY, None, Tier.MEMORY]
    assert run(pair.owner.check_blocks(NS, pair.keys[::2])) == [BlockCheck.INTACT] * 2
    assert pair.reader_clean() and pair.owner_unpinned()


def test_a_block_the_owner_evicted_is_not_held(pair: Pair) -> None:
    absent = keys(1, start=40)
    reasons = pair.pull([pair.keys[0], *absent])
    assert reasons[0] is None
    assert reasons[1] is not None and reasons[1].reason is FetchFailure.NOT_HELD
    assert pair.reader_clean() and pair.owner_unpinned()


class _SlowPin(LocalOwnerLink):
    """The reader's reservation lease runs out while the owner pins; the reader reaps it."""

    def __init__(self, owner: PoolService, peer: Any, reader: PoolService, clock: Clock) -> None:
        super().__init__(owner, peer)
        self.reader, self.clock = reader, clock

    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        self.clock.now += 60.0
        self.reader.reap()
        return await super()._pin(access, keys)


def test_a_reservation_that_expired_during_the_pin_is_taken_again() -> None:
    clock = Clock()
    pair = Pair(one_sided=True, clock=clock, tag="expire")
    try:
        pair.link = _SlowPin(pair.owner, pair.link.peer, pair.reader, clock)
        assert pair.pull() == [None, None, None]
        assert pair.reader.contains(NS, pair.keys) == [Tier.MEMORY] * 3
        assert pair.reader_clean() and pair.owner_unpinned()
    finally:
        pair.close()


class _NeverAnswers(LocalOwnerLink):
    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")


def test_an_owner_that_does_not_answer_the_pin_in_time_is_unavailable(pair: Pair) -> None:
    pair.link = _NeverAnswers(pair.owner, pair.link.peer)
    reasons = pair.pull(timeout_s=0.05)
    assert [r.reason for r in reasons] == [FetchFailure.OWNER_UNAVAILABLE] * 3
    assert pair.reader_clean() and pair.link.forgotten == 1


def test_a_restarted_owner_is_met_afresh() -> None:
    pair = Pair(one_sided=True, clock=Clock(), tag="restart")
    try:
        assert pair.pull(pair.keys[:1]) == [None]
        assert pair.link.restarts == 1  # the first meeting
        assert pair.pull(pair.keys[1:2]) == [None]
        assert pair.link.restarts == 1  # same process
        pair.owner.incarnation += 1  # a new process under the same name
        assert pair.pull(pair.keys[2:]) == [None]
        assert pair.link.restarts == 2
        assert pair.reader_clean()
    finally:
        pair.close()


def test_a_fetch_is_counted_in_the_transfer_metrics(pair: Pair) -> None:
    from tessera_ray.metrics import Metrics, PrometheusBackend

    backend = PrometheusBackend()
    tags = {"ray_namespace": "t", "pool": pair.reader.name, "node": "n"}
    fetcher = Fetcher(pair.reader, lambda name: pair.link, Metrics(backend), tags)
    absent = keys(1, start=40)
    reasons = run(fetcher.fetch(pair.owner.name, NS, [*pair.keys[:2], *absent], 5.0))
    assert [r is None for r in reasons] == [True, True, False]

    def sample(name: str) -> float | None:
        return backend.registry.get_sample_value(name, tags)

    assert sample("tessera_transfer_bytes_total") == 2 * pair.reader.block_bytes
    assert sample("tessera_transfer_errors_total") == 1
    assert sample("tessera_transfer_latency_seconds_count") == 1
