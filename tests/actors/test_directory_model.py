"""Hypothesis state machine: the compact directory shard answers exactly as the dict model
(``tests/actors/_directory_model.py``) under random registrations, drops, purges, rebuilds and
lookups: several namespaces, a few pools, both tiers, the same key or block twice in one batch,
re-registration after drops, keys of another shard; and enough entries to make the tables grow,
rebuild their indexes and reclaim empty blocks."""

from __future__ import annotations

import hashlib
import pickle
import random
import re
from collections.abc import Callable
from typing import TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tessera_ray.actors.directory import (
    DirectoryShard,
    Registration,
    Replica,
    Tier,
    shard_of,
)
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryError
from tests.actors._directory_model import DictShard

_T = TypeVar("_T")

SHARD, NUM_SHARDS = 0, 2
_ALL_KEYS = [TokenKey(hashlib.sha256(b"dir-model-%d" % i).digest()) for i in range(600)]
MINE = [k for k in _ALL_KEYS if shard_of(k, NUM_SHARDS) == SHARD][:240]
OTHERS = [k for k in _ALL_KEYS if shard_of(k, NUM_SHARDS) != SHARD][:8]
SPACES = ["a", "b", "tenant-c"]
POOLS = ["p0", "p1", "p2"]
# Small hashes (a test's), full 128-bit ones (xxh3-128's), and the words' edges.
HASHES = [BlockHash(h) for h in (*range(150), 2**64 - 1, 2**64, 2**127 + 5, 2**128 - 1)]

keys = st.sampled_from(MINE)
spaces = st.sampled_from(SPACES)
pools = st.sampled_from(POOLS)
tiers = st.sampled_from(list(Tier))
hashes = st.sampled_from(HASHES)
registrations = st.builds(
    Registration,
    spaces,
    keys,
    hashes,
    st.builds(
        Replica,
        pools,
        tiers,
        st.integers(0, 2**32 - 1),
        st.integers(-(2**63), 2**63 - 1),
    ),
)


def _bulk(seed: int, count: int) -> list[Registration]:
    """``count`` registrations drawn from ``seed``: sizes hypothesis rarely reaches alone."""
    rng = random.Random(seed)
    return [
        Registration(
            rng.choice(SPACES),
            rng.choice(MINE),
            rng.choice(HASHES),
            Replica(rng.choice(POOLS), rng.choice(list(Tier)), rng.randrange(1000), seed),
        )
        for _ in range(count)
    ]


class _DirectoryModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.real = DirectoryShard(SHARD, NUM_SHARDS)
        self.model = DictShard(SHARD, NUM_SHARDS)

    def both(self, call: Callable[[DirectoryShard | DictShard], _T]) -> _T | None:
        """``call`` on the model, then on the shard: the same answer, or the same error."""
        try:
            expected = call(self.model)
        except DirectoryError as exc:
            with pytest.raises(DirectoryError, match=re.escape(str(exc))):
                call(self.real)
            return None
        got = call(self.real)
        assert got == expected
        return got

    @rule(entries=st.lists(registrations, max_size=12))
    def register(self, entries: list[Registration]) -> None:
        self.both(lambda d: d.register(entries))

    @rule(seed=st.integers(0, 10**6), count=st.integers(1, 200))
    def register_many(self, seed: int, count: int) -> None:
        entries = _bulk(seed, count)
        self.both(lambda d: d.register(entries))

    @rule(entries=st.lists(registrations, min_size=1, max_size=6), other=st.sampled_from(OTHERS))
    def register_a_key_of_another_shard(self, entries: list[Registration], other: bytes) -> None:
        e = entries[-1]
        bad = [*entries, Registration(e.namespace, TokenKey(other), e.block_hash, e.replica)]
        self.both(lambda d: d.register(bad))

    @rule(
        pool=st.sampled_from([*POOLS, "never-seen"]),
        blocks=st.lists(st.tuples(st.sampled_from([*SPACES, "nobody"]), hashes), max_size=30),
        tier=st.sampled_from([None, *Tier]),
    )
    def drop_replicas(
        self, pool: str, blocks: list[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        self.both(lambda d: d.drop_replicas(pool, blocks, tier))

    @rule(pool=st.sampled_from([*POOLS, "never-seen"]))
    def purge_pool(self, pool: str) -> None:
        self.both(lambda d: d.purge_pool(pool))

    @rule(
        seed=st.integers(0, 10**6),
        count=st.integers(0, 120),
        others=st.lists(st.sampled_from(OTHERS), max_size=3),
    )
    def rebuild_from(self, seed: int, count: int, others: list[bytes]) -> None:
        inventory = _bulk(seed, count)
        rep = Replica("p1", Tier.DISK, 0, 0)
        inventory += [Registration("a", TokenKey(k), BlockHash(1), rep) for k in others]
        random.Random(seed).shuffle(inventory)
        self.both(lambda d: d.rebuild_from(inventory))

    @rule(namespace=st.sampled_from([*SPACES, "nobody"]), asked=st.lists(keys, max_size=40))
    def lookup(self, namespace: str, asked: list[TokenKey]) -> None:
        expected = self.both(lambda d: list(d.lookup(namespace, asked)))
        assert expected is not None

    @rule(
        namespace=st.sampled_from(SPACES),
        asked=st.lists(keys, max_size=6),
        bad=st.sampled_from([*OTHERS, b"short"]),
    )
    def lookup_a_bad_key(self, namespace: str, asked: list[TokenKey], bad: bytes) -> None:
        self.both(lambda d: d.lookup(namespace, [*asked, TokenKey(bad), *asked]))

    @rule(namespace=st.sampled_from(SPACES))
    def lookup_everything_pickled(self, namespace: str) -> None:
        """Every key at once; the shard's answer through a pickle equals the model's list."""
        expected = self.model.lookup(namespace, MINE)
        answer = self.real.lookup(namespace, MINE)
        assert pickle.loads(pickle.dumps(answer)) == expected

    @invariant()
    def same_stats_and_pools(self) -> None:
        s = self.real.stats()
        got = (s.token_keys, s.blocks, s.replicas, s.pools, s.lookups, s.hits, s.misses)
        assert (*got, s.purged_pools) == self.model.stats()
        assert self.real.pools() == self.model.pools()


TestDirectoryModel = _DirectoryModel.TestCase
TestDirectoryModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
