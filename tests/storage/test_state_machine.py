"""Hypothesis state machine: each tier behaves like a plain dict."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tessera_ray.storage import HostMemoryTier, StorageTier

from .conftest import HASH, open_disk, page

PAGE_IDS = st.integers(min_value=0, max_value=15)


class _TierModel(RuleBasedStateMachine):
    """No eviction (capacity exceeds every page), so the tier must equal the dict exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model: dict[bytes, bytes] = {}
        self.tier = self.make()

    def make(self) -> StorageTier:
        raise NotImplementedError

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    @rule(ids=st.lists(PAGE_IDS, max_size=5))
    def put_many(self, ids: list[int]) -> None:
        items = [page(i, size=64 + 8 * i) for i in ids]
        self.run(self.tier.put_many(items))
        self.model.update(items)

    @rule(ids=st.lists(PAGE_IDS, max_size=5))
    def get_many(self, ids: list[int]) -> None:
        keys = [page(i, size=64 + 8 * i)[0] for i in ids]
        assert self.run(self.tier.get_many(keys)) == [self.model.get(k) for k in keys]

    @rule(ids=st.lists(PAGE_IDS, max_size=5, unique=True))
    def delete_many(self, ids: list[int]) -> None:
        keys = [page(i, size=64 + 8 * i)[0] for i in ids]
        got = self.run(self.tier.delete_many(keys))
        assert got == [k in self.model for k in keys]
        for k in keys:
            self.model.pop(k, None)

    @invariant()
    def same_keys(self) -> None:
        async def collect() -> list[bytes]:
            return [k async for k in self.tier.keys()]

        assert sorted(self.run(collect())) == sorted(self.model)
        assert len(self.tier) == len(self.model)

    def teardown(self) -> None:
        self.run(self.tier.close())
        self.loop.close()


class _HostModel(_TierModel):
    def make(self) -> StorageTier:
        return HostMemoryTier(64 * 256, 256, hasher=HASH)


class _DiskModel(_TierModel):
    def make(self) -> StorageTier:
        self.dir = Path(tempfile.mkdtemp())
        return open_disk(self.dir / "t")

    @rule()
    def restart(self) -> None:
        """Reopening rebuilds exactly the same contents from the files (deletes included)."""
        self.run(self.tier.close())
        self.tier = open_disk(self.dir / "t")

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.dir, ignore_errors=True)


TestHostStateMachine = _HostModel.TestCase
TestDiskStateMachine = _DiskModel.TestCase
TestHostStateMachine.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
TestDiskStateMachine.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
