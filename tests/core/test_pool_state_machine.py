"""Hypothesis drives random operations against the pool and a plain-dict model of it.

A 4-bit content hash and a tiny byte alphabet make dedup hits, hash collisions, token-key
clashes, copy-on-write and pool exhaustion all common within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera_ray.core import PageHandle, token_key, xxh3_128
from tessera_ray.errors import PoolExhaustedError
from tests.core.conftest import FINGERPRINT, make_pool

NUM_PAGES = 8
PAGE_BYTES = 32
TENANTS = ("alice", "bob")


@dataclass
class ModelPage:
    data: bytearray
    sealed: bool = False
    namespace: str | None = None
    refcount: int = 1


@dataclass
class Model:
    pages: dict[int, ModelPage] = field(default_factory=dict)  # slot -> page (not free)
    lru: list[int] = field(default_factory=list)  # evictable sealed slots, oldest first
    keys: dict[bytes, tuple[str, int, bytes]] = field(default_factory=dict)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(
            NUM_PAGES, page_bytes=PAGE_BYTES, content_hash=lambda d, s: xxh3_128(d, s) & 0xF
        )
        self.model = Model()
        self.held: list[tuple[PageHandle, int]] = []  # one entry per reference we hold

    # -- helpers --------------------------------------------------------------------------

    def _pick(self, i: int) -> tuple[PageHandle, int]:
        return self.held[i % len(self.held)]

    def _take(self, slot: int) -> None:
        page = self.model.pages[slot]
        if page.refcount == 0:
            self.model.lru.remove(slot)
        page.refcount += 1

    def _drop(self, slot: int) -> None:
        page = self.model.pages[slot]
        page.refcount -= 1
        if page.refcount == 0:
            if page.sealed:
                self.model.lru.append(slot)
            else:
                del self.model.pages[slot]

    def _new_page(self, handle: PageHandle, data: bytes) -> int:
        slot = self.pool.slot(handle)
        assert slot not in self.model.pages, "pool handed out a live page"
        self.model.pages[slot] = ModelPage(bytearray(data))
        return slot

    # -- rules ----------------------------------------------------------------------------

    @rule()
    def allocate(self) -> None:
        if len(self.model.pages) == NUM_PAGES:
            try:
                self.pool.allocate()
            except PoolExhaustedError:
                return
            raise AssertionError("allocate succeeded on a full pool")
        h = self.pool.allocate()
        self.held.append((h, self._new_page(h, bytes(PAGE_BYTES))))

    @precondition(lambda self: self.held)
    @rule(
        i=st.integers(0, 99),
        patch=st.sampled_from([b"\x01", b"\x02\x02", b"\x07"]),
        offset=st.sampled_from([0, 5, PAGE_BYTES - 2]),
    )
    def write(self, i: int, patch: bytes, offset: int) -> None:
        h, slot = self._pick(i)
        page = self.model.pages[slot]
        data = torch.tensor(list(patch), dtype=torch.uint8)
        if page.sealed and len(self.model.pages) == NUM_PAGES:
            try:
                self.pool.write(h, data, offset=offset)
            except PoolExhaustedError:
                return
            raise AssertionError("copy-on-write succeeded on a full pool")
        new = self.pool.write(h, data, offset=offset)
        self.held.remove((h, slot))
        if page.sealed:  # copy-on-write: our reference moves to a fresh copy
            assert new != h
            new_slot = self._new_page(new, bytes(page.data))
            self._drop(slot)
            slot, page = new_slot, self.model.pages[new_slot]
        else:
            assert new == h
        page.data[offset : offset + len(patch)] = patch
        self.held.append((new, slot))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99), tenant=st.sampled_from(TENANTS), k=st.integers(0, 4))
    def seal(self, i: int, tenant: str, k: int) -> None:
        h, slot = self._pick(i)
        page = self.model.pages[slot]
        if page.sealed:
            return
        key = token_key(tenant, FINGERPRINT, None, [k])
        res = self.pool.seal_block([h], tenant, key)
        self.held.remove((h, slot))
        twin = next(
            (
                s
                for s, p in self.model.pages.items()
                if p.sealed and p.namespace == tenant and p.data == page.data
            ),
            None,
        )
        (got,) = res.handles
        if twin is not None:
            assert res.pages[0].deduplicated and self.pool.slot(got) == twin
            self._take(twin)
            self._drop(slot)
            slot = twin
        else:
            assert not res.pages[0].deduplicated and got == h
            page.sealed, page.namespace = True, tenant
        self.held.append((got, slot))
        if key in self.model.keys:
            assert res.token_key_registered == (self.model.keys[key][1] == slot)
        else:
            assert res.token_key_registered
            self.model.keys[key] = (tenant, slot, bytes(self.model.pages[slot].data))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def share(self, i: int) -> None:
        h, slot = self._pick(i)
        if not self.model.pages[slot].sealed:
            return
        self.held.append((self.pool.share(h), slot))
        self._take(slot)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        h, slot = self._pick(i)
        if len(self.model.pages) == NUM_PAGES:
            return
        f = self.pool.fork(h)
        self.held.append((f, self._new_page(f, bytes(self.model.pages[slot].data))))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        h, slot = self.held.pop(i % len(self.held))
        self.pool.release(h)
        self._drop(slot)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        out = self.pool.evict(n)
        expected, self.model.lru = self.model.lru[:n], self.model.lru[n:]
        assert [e.page for e in out] == expected
        for e, slot in zip(out, expected, strict=True):
            page = self.model.pages.pop(slot)
            assert e.data == bytes(page.data) and e.namespace == page.namespace
            self.model.keys = {k: v for k, v in self.model.keys.items() if v[1] != slot}

    @rule(tenant=st.sampled_from(TENANTS), k=st.integers(0, 4))
    def lookup(self, tenant: str, k: int) -> None:
        key = token_key(tenant, FINGERPRINT, None, [k])
        got = self.pool.lookup(tenant, key)
        want = self.model.keys.get(key)
        if want is None:
            assert got is None
            return
        assert got is not None
        _, slot, data = want
        assert self.pool.slot(got[0]) == slot and self.pool.read_bytes(got[0]) == data
        self._take(slot)
        self.held.append((got[0], slot))

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        s = self.pool.stats()
        assert s.pages_free + s.pages_used == s.pages_total == NUM_PAGES
        assert s.pages_used == len(self.model.pages)
        assert s.pages_evictable == len(self.model.lru)
        assert s.token_keys == len(self.model.keys)
        records = list(self.pool._pages)  # the page table's records, in slot order
        for slot, page in self.model.pages.items():
            rec = records[slot]
            assert rec.refcount == page.refcount
            # A sealed page's bytes never change; a writable page holds what was written.
            assert self.pool.data[slot].numpy().tobytes() == bytes(page.data)
        for h, slot in self.held:
            assert self.pool.refcount(h) == self.model.pages[slot].refcount
        self.pool.check_consistency()


PoolMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolStateMachine = PoolMachine.TestCase
