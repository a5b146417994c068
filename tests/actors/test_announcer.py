"""A pool's directory updates: an engine's store answers before its registrations are sent,
changes queued meanwhile go out merged, in the order the pool made them, and a caller that
must see the directory updated still waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tessera_ray.actors._announcer import WRITE_BEHIND, Announcer
from tessera_ray.actors.directory import LookupResult, Registration, Tier
from tessera_ray.actors.messages import StoredBlock
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey


class _Directory:
    """Records each change as applied; each waits for ``gate`` (a slow shard)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.applied: list[tuple[str, list[object]]] = []

    async def register(self, entries: Sequence[Registration]) -> None:
        await self.gate.wait()
        self.applied.append(("register", [e.token_key for e in entries]))

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        await self.gate.wait()
        self.applied.append(("drop", [h for _, h in blocks]))

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        raise AssertionError("not asked")


def _block(i: int) -> StoredBlock:
    key = TokenKey(bytes([i]) * 32)
    return StoredBlock(key, BlockHash(1000 + i), i, 1, deduplicated=False, registered=True)


def test_an_engines_store_answers_before_the_directory_is_told_and_changes_go_out_merged() -> None:
    async def run() -> None:
        directory = _Directory()
        announce = Announcer("pool-a", directory)
        WRITE_BEHIND.set(True)
        # Each returns at once although the shard has not answered.
        await asyncio.wait_for(announce.stored("ns", [_block(1)], Tier.MEMORY), 1.0)
        await asyncio.wait_for(announce.stored("ns", [_block(2)], Tier.MEMORY), 1.0)
        await asyncio.wait_for(announce.stored("ns", [_block(3)], Tier.MEMORY), 1.0)
        await asyncio.wait_for(announce.gone_from_memory([("ns", _block(1).block_hash)]), 1.0)
        assert directory.applied == []
        directory.gate.set()
        await announce.settled()
        # The first went out alone (already in flight); the two behind it together; the drop
        # after them, never before the registration of the block it drops.
        assert directory.applied == [
            ("register", [_block(1).token_key]),
            ("register", [_block(2).token_key, _block(3).token_key]),
            ("drop", [_block(1).block_hash]),
        ]
        assert announce.batches == 3

    asyncio.run(run())


def test_a_caller_that_must_see_the_directory_updated_waits_for_its_change() -> None:
    async def run() -> None:
        directory = _Directory()
        announce = Announcer("pool-a", directory)
        store = asyncio.ensure_future(announce.stored("ns", [_block(4)], Tier.MEMORY))
        await asyncio.sleep(0.05)
        assert not store.done(), "answered before the directory knew"
        directory.gate.set()
        await asyncio.wait_for(store, 1.0)
        assert directory.applied == [("register", [_block(4).token_key])]

    asyncio.run(run())


def test_a_refused_update_reaches_a_caller_that_waits_and_later_ones_still_go_out() -> None:
    class _Refusing(_Directory):
        async def register(self, entries: Sequence[Registration]) -> None:
            if entries[0].token_key == _block(5).token_key:
                raise RuntimeError("refused")
            await super().register(entries)

    async def run() -> None:
        directory = _Refusing()
        directory.gate.set()
        announce = Announcer("pool-a", directory)
        with pytest.raises(RuntimeError, match="refused"):
            await announce.stored("ns", [_block(5)], Tier.MEMORY)
        WRITE_BEHIND.set(True)  # an engine's store: answered already, the refusal is logged
        await announce.stored("ns", [_block(5)], Tier.MEMORY)
        await announce.settled()
        await announce.stored("ns", [_block(6)], Tier.MEMORY)
        await announce.settled()
        assert directory.applied == [("register", [_block(6).token_key])]

    asyncio.run(run())
