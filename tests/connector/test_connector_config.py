"""The vLLM connector's parts that need no vLLM: the module imports without it, its config
parser refuses bad input by name, and the scheduler-side planner and the load verification
agree with the tier (vLLM itself is exercised in tests/vllm, ``make test-vllm``)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tessera_ray.actors.directory import Holder, Tier
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinnedBlock, PinTicket
from tessera_ray.core.hashing import xxh3_128
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LayoutError, TierConfigError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.vllm import connector
from tessera_ray.vllm.backend import PinnedHits, TierBackend, TierHit
from tessera_ray.vllm.connector import TesseraConnectorConfig, tenant_namespace
from tessera_ray.vllm.keys import payload_block_hash
from tessera_ray.vllm.landing import StepLanding
from tessera_ray.vllm.loads import LoadOutcome, LoadRun
from tessera_ray.vllm.records import BlockLoad, CachedScheduled, NewScheduled, StepPlan, TokenRows
from tessera_ray.vllm.scheduler import TIER_SOURCES_PARAM, TIER_TOKENS_PARAM, SchedulerPlanner
from tessera_ray.vllm.tiers import LocalTier
from tessera_ray.vllm.worker import WorkerMover

LAYOUT = build_layout(MLAConfig(name="tiny-mla-connector", num_layers=2, num_heads=4))


def test_module_imports_without_vllm_and_names_it_when_the_class_is_asked_for() -> None:
    assert "TesseraConnector" in connector.__all__
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs vLLM"):
            _ = connector.TesseraConnector
    with pytest.raises(AttributeError):
        _ = connector.NoSuchThing  # type: ignore[attr-defined]


def test_config_defaults_and_a_valid_mapping() -> None:
    assert TesseraConnectorConfig.from_extra_config(None) == TesseraConnectorConfig()
    cfg = TesseraConnectorConfig.from_extra_config(
        {"backend": "local", "local_num_blocks": 8, "timeout_s": 5, "pool": None}
    )
    assert (cfg.backend, cfg.local_num_blocks, cfg.timeout_s, cfg.pool) == ("local", 8, 5, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"namespce": "x"}, r"unknown key\(s\) namespce.*valid keys: backend"),
        ({"backend": "redis"}, "backend must be one of 'ray', 'local'"),
        ({"local_num_blocks": True}, "local_num_blocks must be an int"),
        ({"local_num_blocks": 0}, "local_num_blocks must be a positive integer"),
        ({"timeout_s": "10"}, "timeout_s must be a float"),
        ({"namespace": ""}, "namespace must be a non-empty string"),
        ({"pool": 3}, "pool must be a str or null"),
        (["backend"], "must be a mapping"),
    ],
)
def test_config_refuses_bad_input_by_name(extra: Any, message: str) -> None:
    with pytest.raises(TierConfigError, match=message):
        TesseraConnectorConfig.from_extra_config(extra)


def test_cache_salt_picks_a_tenant_namespace_without_revealing_the_salt() -> None:
    assert tenant_namespace("app", None) == tenant_namespace("app", "") == "app"
    a, b = tenant_namespace("app", "secret-a"), tenant_namespace("app", "secret-b")
    assert a != b and a.startswith("app/") and "secret" not in a


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class _Tier:
    """A directory stand-in; ``hold`` keeps lookups in flight until released."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, TokenKey], BlockHash] = {}
        self.holders: dict[TokenKey, tuple[Holder, ...]] = {}
        self.calls = 0
        self.hold = False
        self.pending: list[tuple[concurrent.futures.Future[Any], list[TierHit | None]]] = []

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        self.calls += 1
        future: concurrent.futures.Future[list[TierHit | None]] = concurrent.futures.Future()
        found = [self.held.get((namespace, k)) for k in keys]
        answer = [
            TierHit(h, self.holders.get(k, ())) if h is not None else None
            for k, h in zip(keys, found, strict=True)
        ]
        if self.hold:
            self.pending.append((future, answer))
        else:
            future.set_result(answer)
        return future

    def release(self) -> None:
        for future, answer in self.pending:
            future.set_result(answer)
        self.pending.clear()


def _planner(
    tier: _Tier, engine_tokens: int = 64, local_pool: str | None = None
) -> SchedulerPlanner:
    return SchedulerPlanner(
        tier,
        LAYOUT,
        namespace="app",
        model_name="m",
        block_tokens=engine_tokens,
        can_load=True,
        can_save=True,
        local_pool=local_pool,
    )


def _store_saves(tier: _Tier, plan: StepPlan) -> None:
    for save in plan.saves:
        for i, key in enumerate(save.token_keys):
            tier.held[(save.namespace, key)] = BlockHash(len(tier.held) + i + 1)


def test_planner_saves_full_blocks_and_matches_them_in_one_lookup() -> None:
    tier, tokens = _Tier(), list(range(1, 201))
    writer = _planner(tier)
    writer.matched_tokens(_Request("a", tokens), 0)
    plan = writer.build([NewScheduled("a", list(range(10, 14)), 0, 200)], [])
    (save,) = plan.saves
    assert len(set(save.token_keys)) == 3
    assert save.rows == TokenRows((10, 11, 12), 0, 0, 192)
    _store_saves(tier, plan)

    reader = _planner(tier)
    tier.calls = 0
    assert reader.matched_tokens(_Request("b", [*tokens[:192], 7]), 0) == 192
    assert tier.calls == 1
    assert reader.matched_tokens(_Request("c", tokens[:192]), 0) == 128  # last token computed
    assert reader.matched_tokens(_Request("d", [*tokens[:192], 7], "other"), 0) == 0


@pytest.mark.parametrize("engine_tokens", [16, 32, 64, 128, 256])
def test_planner_maps_engine_blocks_onto_tier_blocks(engine_tokens: int) -> None:
    """Tier blocks stay 64 tokens whatever block size vLLM runs: saves read the rows of each
    64 positions wherever vLLM's blocks put them, and a load writes exactly the positions vLLM
    counts as external (a hit that ends inside an engine block leaves the rest of that block
    to vLLM's own computation)."""
    tier, tokens = _Tier(), list(range(1, 331))  # 5 full tier blocks and 10 tokens
    writer = _planner(tier, engine_tokens)
    n_engine = -(-len(tokens) // engine_tokens)
    ids = [100 + 3 * i for i in range(n_engine)]  # scattered, as vLLM's free list hands out
    writer.matched_tokens(_Request("a", tokens), 0)
    plan = writer.build([NewScheduled("a", ids, 0, len(tokens))], [])
    (save,) = plan.saves
    assert len(save.token_keys) == 5 and (save.rows.start, save.rows.stop) == (0, 320)
    rows = save.rows.cache_rows(engine_tokens)
    assert rows == [ids[p // engine_tokens] * engine_tokens + p % engine_tokens for p in range(320)]
    _store_saves(tier, plan)

    # Another engine, same prompt: 5 tier blocks are there; vLLM gets 320 tokens.
    reader = _planner(tier, engine_tokens)
    request = _Request("b", tokens)
    assert reader.matched_tokens(request, 0) == 320
    other_ids = [7 + 5 * i for i in range(n_engine)]
    reader.after_alloc(request, other_ids, 320)
    plan = reader.build([NewScheduled("b", other_ids, 320, 10)], [])
    (load,) = plan.loads
    assert load.token_keys == save.token_keys and load.tier_position == 0
    assert (load.rows.start, load.rows.stop) == (0, 320)
    assert load.rows.cache_rows(engine_tokens) == [
        other_ids[p // engine_tokens] * engine_tokens + p % engine_tokens for p in range(320)
    ]
    assert plan.saves == ()  # what was loaded is not stored again

    # vLLM takes fewer tokens than matched (200 of 320): only positions 0..199 are loaded,
    # from the 4 tier blocks that cover them; the step computes from 200 on.
    short = _planner(tier, engine_tokens)
    request = _Request("c", tokens)
    assert short.matched_tokens(request, 0) == 320
    short.after_alloc(request, other_ids, 200)
    (load,) = short.build([NewScheduled("c", other_ids, 200, 130)], []).loads
    assert len(load.token_keys) == 4 and (load.rows.start, load.rows.stop) == (0, 200)


def test_planner_loads_after_a_local_hit_that_ends_inside_a_tier_block() -> None:
    """vLLM with 16-token blocks may already hold 80 tokens (5 of its blocks): the load starts
    at position 80, inside tier block 1, and never writes a row vLLM holds itself."""
    tier, tokens = _Tier(), list(range(1, 331))
    writer = _planner(tier, 16)
    ids = list(range(21))
    writer.matched_tokens(_Request("a", tokens), 0)
    _store_saves(tier, writer.build([NewScheduled("a", ids, 0, 330)], []))
    reader = _planner(tier, 16)
    request = _Request("b", tokens)
    assert reader.matched_tokens(request, 80) == 320 - 80
    reader.after_alloc(request, ids, 240)
    (load,) = reader.build([NewScheduled("b", ids, 320, 10)], []).loads
    assert load.tier_position == 64 and len(load.token_keys) == 4
    assert (load.rows.start, load.rows.stop) == (80, 320)
    assert min(load.rows.cache_rows(16)) == 80


def test_planner_reports_the_prompt_tokens_the_tier_supplied() -> None:
    """What a finished request tells its client (its ``kv_transfer_params``): the tokens its
    load took from the tier, split by where the tier held each block (this node's pool, another
    pool's memory, a disk tier); fewer when part of the load failed (vLLM recomputes from the
    first failed block); none for a request that computed its prompt or is unknown."""
    tier, tokens, ids = _Tier(), list(range(1, 331)), list(range(21))
    writer = _planner(tier, 16)
    writer.matched_tokens(_Request("a", tokens), 0)
    plan = writer.build([NewScheduled("a", ids, 0, 330)], [])
    _store_saves(tier, plan)
    assert writer.finished("a") == (0, {"local": 0, "remote": 0, "disk": 0}, False)
    here, there = Holder("pool-here", Tier.MEMORY), Holder("pool-there", Tier.MEMORY)
    on_disk = Holder("pool-here", Tier.DISK)
    keys = plan.saves[0].token_keys
    for key, holders in zip(
        keys,
        [(here, there), (here,), (there,), (on_disk,), (on_disk, Holder("p", Tier.DISK))],
        strict=True,
    ):
        tier.holders[key] = holders
    reader = _planner(tier, 16, local_pool="pool-here")
    for name in ("b", "c"):
        request = _Request(name, tokens)
        assert reader.matched_tokens(request, 0) == 320
        reader.after_alloc(request, ids, 320)
        reader.build([NewScheduled(name, ids, 320, 10)], [])
    supplied = reader.finished("b")
    assert supplied == (320, {"local": 128, "remote": 64, "disk": 128}, False)
    assert supplied.params() == {
        TIER_TOKENS_PARAM: 320,
        TIER_SOURCES_PARAM: {"local": 128, "remote": 64, "disk": 128},
    }
    reader.load_failed({ids[10]})  # engine block 10: positions 160 to 175
    assert reader.finished("c") == (160, {"local": 128, "remote": 32, "disk": 0}, False)
    assert reader.finished("never-seen").tokens == 0


@pytest.mark.parametrize("can_load", [True, False])
def test_planner_does_not_store_again_what_vllm_already_holds(can_load: bool) -> None:
    """A prompt whose first 150 tokens vLLM holds in its own prefix cache (stored in the tier
    when this engine computed them, or loaded from it): only the tier block completed after
    them is saved, not the whole prefix again on every local hit."""
    tier, tokens = _Tier(), list(range(1, 201))
    planner = SchedulerPlanner(
        tier, LAYOUT, namespace="app", model_name="m", block_tokens=16, can_load=can_load,
        can_save=True,
    )  # fmt: skip
    request = _Request("a", tokens)
    assert planner.matched_tokens(request, 144) == 0  # the tier holds nothing after them
    planner.after_alloc(request, list(range(13)), 0)
    (save,) = planner.build([NewScheduled("a", list(range(13)), 144, 56)], []).saves
    assert len(save.token_keys) == 1 and (save.rows.start, save.rows.stop) == (128, 192)


def test_planner_answers_ask_again_while_the_lookup_is_out() -> None:
    """The scheduler thread never waits on a slow tier: a lookup still in flight answers None
    (vLLM skips the request this step) and the next call takes its answer, one lookup in all."""
    tier, tokens = _Tier(), list(range(1, 201))
    writer = _planner(tier)
    writer.matched_tokens(_Request("a", tokens), 0)
    _store_saves(tier, writer.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], []))
    reader = _planner(tier)
    tier.hold, tier.calls = True, 0
    request = _Request("b", tokens)
    assert reader.matched_tokens(request, 0) is None
    assert reader.matched_tokens(request, 0) is None
    tier.release()
    assert reader.matched_tokens(request, 0) == 192
    assert tier.calls == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _waiting_planner(tier: _Tier, clock: _Clock) -> SchedulerPlanner:
    return SchedulerPlanner(
        tier, LAYOUT, namespace="app", model_name="m", block_tokens=64, can_load=True,
        can_save=True, store_wait_s=2.0, clock=clock,
    )  # fmt: skip


def test_planner_waits_for_blocks_this_engine_is_still_storing() -> None:
    """A prompt this engine has just computed, asked again before its tier stores landed: the
    planner asks the tier again (answering None meanwhile) and takes the blocks once they land,
    rather than recomputing them."""
    tier, clock, tokens = _Tier(), _Clock(), list(range(1, 201))
    planner = _waiting_planner(tier, clock)
    planner.matched_tokens(_Request("a", tokens), 0)
    plan = planner.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], [])
    planner.finished("a")
    again = _Request("b", tokens)
    assert planner.matched_tokens(again, 0) is None  # the stores are still on their way
    calls = tier.calls
    assert planner.matched_tokens(again, 0) is None  # no new lookup within the re-ask delay
    assert tier.calls == calls
    _store_saves(tier, plan)
    clock.now += 0.05
    assert planner.matched_tokens(again, 0) == 192
    # Once seen in the tier the keys are no longer waited on: a later miss is a plain miss.
    tier.held.clear()
    clock.now += 0.05
    assert planner.matched_tokens(_Request("c", tokens), 0) == 0


def test_planner_asks_again_when_its_store_ended_while_the_lookup_was_out() -> None:
    """A lookup asked before this engine's store landed and answered after the workers
    reported the store ended: its miss is stale, so the planner asks again and takes the hit,
    once; a key whose store ended before the lookup was asked is a plain miss."""
    tier, clock, tokens = _Tier(), _Clock(), list(range(1, 201))
    planner = _waiting_planner(tier, clock)
    planner.matched_tokens(_Request("a", tokens), 0)
    plan = planner.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], [])
    planner.finished("a")
    again = _Request("b", tokens)
    tier.hold = True
    assert planner.matched_tokens(again, 0) is None  # asked while the store is on its way
    _store_saves(tier, plan)
    planner.stores_done([plan.save_seq])
    tier.hold = False
    tier.release()  # the answer predates the store: a miss
    clock.now += 0.05
    calls = tier.calls
    assert planner.matched_tokens(again, 0) is None  # a stale miss: asked again shortly
    clock.now += 0.05
    assert planner.matched_tokens(again, 0) == 192
    assert tier.calls == calls + 1
    # The store ended before this lookup was asked: its miss is the tier's answer.
    tier.held.clear()
    clock.now += 0.05
    assert planner.matched_tokens(_Request("c", tokens), 0) == 0


def test_planner_stops_waiting_for_a_store_that_never_lands() -> None:
    """A store that was dropped (or evicted at once) is waited on for ``store_wait_s`` at most;
    then the request recomputes. A block another engine stored is never waited on."""
    tier, clock, tokens = _Tier(), _Clock(), list(range(1, 201))
    planner = _waiting_planner(tier, clock)
    planner.matched_tokens(_Request("a", tokens), 0)
    planner.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], [])
    other = _waiting_planner(tier, clock)  # another engine: these stores are not its own
    assert other.matched_tokens(_Request("d", tokens), 0) == 0
    again = _Request("b", tokens)
    assert planner.matched_tokens(again, 0) is None
    clock.now += 1.0
    assert planner.matched_tokens(again, 0) is None
    clock.now += 1.5
    assert planner.matched_tokens(again, 0) == 0


def test_planner_stops_waiting_once_the_workers_report_the_store_ended() -> None:
    """A store the workers report ended without its blocks in the tier (it failed): a miss at
    once. A later step's store of the same keys is waited on again."""
    tier, clock, tokens = _Tier(), _Clock(), list(range(1, 201))
    planner = _waiting_planner(tier, clock)
    planner.matched_tokens(_Request("a", tokens), 0)
    first = planner.build([NewScheduled("a", [1, 2, 3, 4], 0, 200)], [])
    planner.finished("a")
    planner.matched_tokens(_Request("b", tokens), 0)
    second = planner.build([NewScheduled("b", [5, 6, 7, 8], 0, 200)], [])
    assert 0 < first.save_seq < second.save_seq
    planner.stores_done([first.save_seq])
    assert planner.matched_tokens(_Request("c", tokens), 0) is None  # b's store still runs
    planner.stores_done([second.save_seq])
    clock.now += 0.05
    assert planner.matched_tokens(_Request("c", tokens), 0) == 0


def test_planner_saves_a_tier_block_once_its_last_engine_block_is_computed() -> None:
    """With 16-token engine blocks a tier block fills over several steps: it is saved in the
    step that computes its 64th position, from the four engine blocks that hold it."""
    tier, tokens = _Tier(), list(range(1, 101))
    planner = _planner(tier, 16)
    planner.matched_tokens(_Request("a", tokens), 0)
    plan = planner.build([NewScheduled("a", [9, 8, 7], 0, 40)], [])
    assert plan.saves == ()
    plan = planner.build([], [CachedScheduled("a", [6, 5], False, 40, 30)])
    (save,) = plan.saves
    assert save.rows.cache_rows(16) == [b * 16 + r for b in (9, 8, 7, 6) for r in range(16)]


def test_planner_refuses_block_sizes_that_do_not_divide() -> None:
    with pytest.raises(LayoutError, match=r"block_size 48 .* 64 tokens"):
        _planner(_Tier(), 48)


def test_load_verification_hash_is_the_pools_block_hash() -> None:
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rows = np.random.default_rng(0).integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(bytes([i]) * 32) for i in range(2)]
    tier.store("ns", keys, rows)
    hits = tier.lookup("ns", keys)
    hashes = [h.block_hash if h is not None else None for h in hits]
    assert hashes == [payload_block_hash(LAYOUT, "ns", row) for row in rows]
    read = tier.read("ns", keys, [h for h in hits if h is not None])
    assert all(
        r is not None and np.array_equal(r.payload, w) and r.block_hash == h
        for r, w, h in zip(read, rows, hashes, strict=True)
    )
    flipped = rows[1].copy()
    flipped[5] ^= 1
    assert payload_block_hash(LAYOUT, "ns", flipped) != hashes[1]
    assert payload_block_hash(LAYOUT, "other", rows[1]) != hashes[1]


ROW_VALUES = LAYOUT.groups[0].page.page_bytes // 2 // LAYOUT.block_tokens


def _mover(
    tier: LocalTier, num_blocks: int, engine_tokens: int = 64, can_save: bool = False
) -> tuple[WorkerMover, dict[str, torch.Tensor]]:
    """A worker mover over ``num_blocks``-block bf16 caches of LAYOUT, one per layer."""
    caches = {
        f"layer.{i}": torch.zeros((num_blocks, engine_tokens, ROW_VALUES), dtype=torch.bfloat16)
        for i in range(LAYOUT.num_layers)
    }
    mover = WorkerMover(
        tier, LAYOUT, engine_tokens=engine_tokens, can_save=can_save, timeout_s=10.0
    )
    mover.register(caches, lambda name: int(name.split(".")[1]))
    return mover, caches


def _run_step(mover: WorkerMover, caches: dict[str, torch.Tensor], plan: StepPlan) -> set[int]:
    """One step as vLLM drives it: start, then per layer wait for its load and save it."""
    mover.start(plan)
    for name, kv in caches.items():
        mover.wait_layer(plan, name)
        mover.save_layer(plan, name, kv)
    mover.finish(plan)
    assert mover.flush(10.0)
    return mover.take_load_errors()


def _load(keys: Sequence[TokenKey], hashes: Sequence[BlockHash], ids: Sequence[int]) -> BlockLoad:
    rows = TokenRows(tuple(ids), 0, 0, 64 * len(keys))
    return BlockLoad("r", "ns", tuple(keys), tuple(TierHit(h) for h in hashes), 0, rows)


@pytest.mark.parametrize("engine_tokens", [16, 64, 128])
def test_rows_saved_from_one_engine_load_into_another_byte_for_byte(engine_tokens: int) -> None:
    """Engine A (its own block size, its own block ids) saves 3 tier blocks; engine B loads the
    first 150 positions into other block ids: every loaded row equals A's row at the same
    position, byte for byte, and no other row of B's cache is written (the step's own rows
    from 150 on stay as vLLM wrote them)."""
    tier = LocalTier(LAYOUT, num_blocks=8, device="cpu", timeout_s=10.0)
    n = -(-200 // engine_tokens)
    writer, a = _mover(tier, 40, engine_tokens, can_save=True)
    gen = torch.Generator().manual_seed(engine_tokens)
    for kv in a.values():
        kv.copy_(torch.randn(kv.shape, generator=gen).to(torch.bfloat16))
    a_ids = [30 - 2 * i for i in range(n)]
    planner = _planner(_Tier(), engine_tokens)
    request = _Request("a", list(range(1, 201)))
    planner.matched_tokens(request, 0)
    plan = planner.build([NewScheduled("a", a_ids, 0, 200)], [])
    assert _run_step(writer, a, plan) == set()
    (save,) = plan.saves
    hits = tier.lookup("app", list(save.token_keys))
    assert all(h is not None for h in hits)

    reader, b = _mover(tier, 40, engine_tokens)
    for kv in b.values():
        kv.fill_(7.0)  # what vLLM wrote; untouched outside the loaded positions
    b_ids = [3 + 4 * i for i in range(n)]
    rows = TokenRows(tuple(b_ids[: -(-150 // engine_tokens)]), 0, 0, 150)
    load = BlockLoad("b", "app", save.token_keys, tuple(h for h in hits if h), 0, rows)
    assert _run_step(reader, b, StepPlan(loads=(load,))) == set()
    saved, loaded = writer.counters.take(), reader.counters.take()
    assert saved is not None and loaded is not None
    assert (saved["saved_blocks"], saved["loaded_blocks"]) == (3, 0)
    assert saved["store_s"] > 0
    assert (loaded["loaded_blocks"], loaded["saved_blocks"], loaded["failed_blocks"]) == (3, 0, 0)
    assert writer.counters.take() is None  # taken once

    for name in a:
        flat_a, flat_b = a[name].view(-1, ROW_VALUES), b[name].view(-1, ROW_VALUES)
        src = [a_ids[p // engine_tokens] * engine_tokens + p % engine_tokens for p in range(150)]
        dst = rows.cache_rows(engine_tokens)
        assert torch.equal(flat_b[dst].view(torch.uint8), flat_a[src].view(torch.uint8))
        untouched = torch.ones(len(flat_b), dtype=torch.bool)
        untouched[dst] = False
        assert bool((flat_b[untouched] == 7.0).all())


def test_a_load_whose_attention_did_not_wait_is_reported_failed() -> None:
    """Should vLLM run a layer's attention without asking for its load, this step's tokens may
    have been computed without that context (the read thread lands layers ahead, but nothing
    says it was ahead of that attention): the blocks are reported as failed, so vLLM recomputes
    them, and whatever landed is the verified bytes, never anything else."""
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rows = np.random.default_rng(3).integers(0, 256, (1, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(b"\x05" * 32)]
    tier.store("ns", keys, rows)
    hashes = [h for h in tier.lookup("ns", keys) if h is not None]
    mover, caches = _mover(tier, 3)
    plan = StepPlan(loads=(_load(keys, hashes, [1]),))
    mover.start(plan)
    mover.finish(plan)
    assert mover.take_load_errors() == {1}
    page = LAYOUT.groups[0].page.page_bytes
    for name, kv in caches.items():
        i = int(name.split(".")[1])
        got = kv[1].reshape(-1).view(torch.uint8).numpy()
        assert not got.any() or np.array_equal(got, rows[0][i * page : (i + 1) * page])


def test_load_takes_other_valid_bytes_under_a_key_and_refuses_rotten_ones() -> None:
    """Under one token key the pool may hold other valid bytes than the lookup saw (an engine
    whose KV is not bitwise reproducible stored it): loaded, not recomputed on every request.
    Bytes that no longer match the pool's own seal are refused, nothing of them lands, and
    the pool, told so, drops its rotten copy so that the next save replaces it."""
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(bytes([7 + i]) * 32) for i in range(2)]
    tier.store("ns", keys, rows)
    other = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
    seen_by_lookup = payload_block_hash(LAYOUT, "ns", other)  # what another pool sealed
    hashes = tier.lookup("ns", keys)
    assert hashes[1] is not None
    load = _load(keys, (seen_by_lookup, hashes[1].block_hash), (2, 0))
    mover, caches = _mover(tier, 3)
    assert _run_step(mover, caches, StepPlan(loads=(load,))) == set()
    for name, kv in caches.items():
        i, page = int(name.split(".")[1]), LAYOUT.groups[0].page.page_bytes
        for block_id, row in ((2, rows[0]), (0, rows[1])):
            got = kv[block_id].reshape(-1).view(torch.uint8).numpy()
            assert np.array_equal(got, row[i * page : (i + 1) * page])

    # The pool's copy of the first block rots: its load fails, and so does the one after it
    # (vLLM recomputes from the first failed block); neither block of vLLM's cache is touched.
    pool = tier.service.pools[0]
    handles = pool.lookup("ns", keys[0])
    assert handles is not None
    slot = handles[0].offset // handles[0].length
    pool.data[slot, 100] ^= 0x10
    pool.release_many(list(handles))
    mover, caches = _mover(tier, 3)
    assert _run_step(mover, caches, StepPlan(loads=(load,))) == {2, 0}
    assert all(not kv.any() for kv in caches.values())
    counts = mover.counters.take()
    assert counts is not None and (counts["loaded_blocks"], counts["failed_blocks"]) == (0, 2)
    # The connector reported the block; the pool proved it rotten and dropped it, so the save
    # that follows vLLM's recompute stores it afresh and the next request loads it.
    assert tier.service.status().rotten_blocks == 1
    assert tier.lookup("ns", keys) == [None, hashes[1]]
    tier.store("ns", keys[:1], rows[:1])
    mover, caches = _mover(tier, 3)
    assert _run_step(mover, caches, StepPlan(loads=(load,))) == set()


class _InPlaceTier(LocalTier):
    """Reads as a pool's mapped pages do: not hashed, each layer's pages checked by the
    worker as it lands them; ``rot`` (row, layer) flips a byte of that page first."""

    def __init__(self, rot: tuple[int, int]) -> None:
        super().__init__(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
        self.rot = rot
        self.checked: list[tuple[int, list[int]]] = []
        self.reported: list[TokenKey] = []

    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        sealed = super().read(namespace, keys, hits, ticket)
        page = LAYOUT.groups[0].page.page_bytes
        pages = sealed.payloads.copy()
        seals = [[xxh3_128(r[i * page : (i + 1) * page].data, 0) for i in (0, 1)] for r in pages]
        row, layer = self.rot
        pages[row, layer * page + 5] ^= 0x01

        def check(layer: int, which: Sequence[int]) -> list[int]:
            self.checked.append((layer, list(which)))
            at = layer * page
            return [
                j for j in which if xxh3_128(pages[j, at : at + page].data, 0) != seals[j][layer]
            ]

        return BlockReads.of(sealed.block_hashes, pages, pinned=True, check_layer=check)

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        self.reported += keys
        return []


def test_pages_read_in_place_are_checked_layer_by_layer_and_a_rotten_one_stops_its_load() -> None:
    """A read in place is hashed one layer at a time, just before that layer lands: layer 0's
    pages match and land; block 0's layer-1 page has rotted, so nothing of layer 1 lands, the
    request's blocks are reported failed (vLLM recomputes them) and the pool is told which
    block rotted. Never a byte that did not match its seal in vLLM's cache."""
    tier = _InPlaceTier(rot=(0, 1))
    rows = np.random.default_rng(5).integers(0, 256, (2, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(bytes([40 + i]) * 32) for i in range(2)]
    tier.store("ns", keys, rows)
    hashes = [h.block_hash for h in tier.lookup("ns", keys) if h is not None]
    mover, caches = _mover(tier, 3)
    assert _run_step(mover, caches, StepPlan(loads=(_load(keys, hashes, (2, 0)),))) == {2, 0}
    assert tier.checked == [(0, [0, 1]), (1, [0, 1])]
    page = LAYOUT.groups[0].page.page_bytes
    for block_id, row in ((2, rows[0]), (0, rows[1])):
        got = caches["layer.0"][block_id].reshape(-1).view(torch.uint8).numpy()
        assert np.array_equal(got, row[:page])
    assert not caches["layer.1"].any()
    assert tier.reported == [keys[0]]
    counts = mover.counters.take()
    assert counts is not None and counts["failed_blocks"] == 2

    tier = _InPlaceTier(rot=(0, 0))  # rotten in layer 0: nothing lands at all
    tier.store("ns", keys, rows)
    mover, caches = _mover(tier, 3)
    assert _run_step(mover, caches, StepPlan(loads=(_load(keys, hashes, (2, 0)),))) == {2, 0}
    assert tier.checked == [(0, [0, 1])]  # not hashed again once the part failed
    assert all(not kv.any() for kv in caches.values())


def test_the_old_module_path_still_loads_the_connector_with_a_warning() -> None:
    import sys

    sys.modules.pop("tessera_ray.serve.connector", None)
    with pytest.warns(DeprecationWarning, match="tessera_ray.vllm.connector"):
        old = importlib.import_module("tessera_ray.serve.connector")
    assert old.TesseraConnectorConfig is TesseraConnectorConfig
    assert set(old.__all__) == set(connector.__all__)


class _PinningTier(TierBackend):
    """A tier whose lookups pin what they find (one ticket per lookup), recording unpins."""

    layout = LAYOUT
    timeout_s = 5.0

    def __init__(self, held: dict[TokenKey, BlockHash]) -> None:
        self.held = held
        self.issued: list[int] = []
        self.unpinned: list[int] = []

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        raise AssertionError("a pinning tier is asked through lookup_pinned_async")

    def lookup_pinned_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[PinnedHits]:
        hits: list[TierHit | None] = []
        for k in keys:
            if k not in self.held:
                break
            hits.append(TierHit(self.held[k], (Holder("p0", Tier.MEMORY),)))
        blocks = tuple(
            PinnedBlock(k, h.block_hash, ((0,),), ((0,),))
            for k, h in zip(keys[: len(hits)], hits, strict=True)
            if h is not None
        )
        ticket = None
        if blocks:
            self.issued.append(len(self.issued) + 1)
            ticket = PinTicket(self.issued[-1], "p0", namespace, blocks, 1e12)
        future: concurrent.futures.Future[PinnedHits] = concurrent.futures.Future()
        future.set_result(([*hits, *[None] * (len(keys) - len(hits))], ticket))
        return future

    def unpin(self, ticket: PinTicket) -> None:
        self.unpinned.append(ticket.id)

    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        raise AssertionError("the planner reads nothing")

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[Any]:
        return []

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        raise AssertionError("the planner stores nothing")


def test_the_lookups_pin_travels_in_the_plan_and_every_unused_pin_is_ended() -> None:
    """The scheduler's lookup pins the blocks its node's pool holds and the load in the step's
    plan carries that ticket to the worker (the read starts without asking the pool); a match
    vLLM does not take (asked again, allocated fewer blocks, or the request ends first) has its
    pin ended, never left to the lease."""
    tokens = list(range(1, 200))  # three whole tier blocks, the last one left to vLLM
    probe = _planner(_Tier())
    keys = probe._keys(probe._track(_Request("x", tokens)), 3)
    tier = _PinningTier({k: BlockHash(bytes([i]) * 16) for i, k in enumerate(keys[:2], 1)})
    planner = SchedulerPlanner(
        tier, LAYOUT, namespace="app", model_name="m", block_tokens=64, can_load=True,
        can_save=False, pin_on_lookup=True,
    )  # fmt: skip
    request = _Request("a", tokens)
    assert planner.matched_tokens(request, 0) == 128
    planner.after_alloc(request, [5, 6, 7], 128)
    (load,) = planner.build([NewScheduled("a", [5, 6, 7], 0, 199)], []).loads
    assert load.ticket is not None and load.ticket.id == 1 and len(load.ticket.blocks) == 2
    assert tier.unpinned == []  # the worker ends it
    # Asked again before vLLM allocates: the first match's pin ends with it.
    other = _Request("b", tokens)
    assert planner.matched_tokens(other, 0) == 128
    assert planner.matched_tokens(other, 0) == 128
    assert tier.unpinned == [2]
    # Allocated fewer tokens than matched: the pin of two blocks ends, the load carries none.
    planner.after_alloc(other, [8], 64)
    (load,) = planner.build([NewScheduled("b", [8, 9, 10], 0, 199)], []).loads
    assert load.ticket is None and tier.unpinned == [2, 3]
    # The request ends before vLLM takes its match.
    assert planner.matched_tokens(_Request("c", tokens), 0) == 128
    planner.finished("c")
    assert tier.unpinned == [2, 3, 4]


def test_the_read_thread_lands_every_layer_before_its_attention_asks() -> None:
    """The step's verified blocks land in every layer's cache on the read thread, without any
    layer asking (the forward computes meanwhile); a layer that asks then finds its rows there,
    and the step reports no load error."""
    tier = LocalTier(LAYOUT, num_blocks=4, device="cpu", timeout_s=10.0)
    rows = np.random.default_rng(4).integers(0, 256, (1, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [TokenKey(b"\x06" * 32)]
    tier.store("ns", keys, rows)
    hashes = [h.block_hash for h in tier.lookup("ns", keys) if h is not None]
    mover, caches = _mover(tier, 3)
    plan = StepPlan(loads=(_load(keys, hashes, [2]),))
    mover.start(plan)
    page = LAYOUT.groups[0].page.page_bytes

    def landed(i: int) -> bool:
        got = caches[f"layer.{i}"][2].reshape(-1).view(torch.uint8).numpy()
        return bool(np.array_equal(got, rows[0][i * page : (i + 1) * page]))

    deadline = time.monotonic() + 10
    while not all(landed(i) for i in range(LAYOUT.num_layers)):
        assert time.monotonic() < deadline, "the read thread landed no layer on its own"
        time.sleep(0.005)
    for name, kv in caches.items():
        mover.wait_layer(plan, name)
        mover.save_layer(plan, name, kv)
    mover.finish(plan)
    assert mover.take_load_errors() == set()


def test_a_landing_that_misses_its_deadline_stops_and_writes_nothing_after() -> None:
    """A layer that has not landed when its attention has waited the deadline stops the
    landing: the copy in progress finishes, none starts after, and the step counts as failed."""
    release, started = threading.Event(), threading.Event()
    landed: list[int] = []

    def land(index: int, outcome: LoadOutcome) -> None:
        started.set()
        release.wait(10)
        landed.append(index)

    run = LoadRun(0, 0, 1, 0, TokenRows((0,), 0, 0, 64))
    landing = StepLanding(3)
    thread = threading.Thread(
        target=landing.run,
        args=(lambda: LoadOutcome(runs=[run]), land, range(3), torch.device("cpu")),
    )
    thread.start()
    assert landing.outcome(10).runs == [run]
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()  # the copy in progress ends meanwhile
    assert not landing.wait_layer(0, 0.05)  # layer 0 is still copying: too late
    thread.join(10)
    assert landed == [0]  # the copy in progress finished; layers 1 and 2 never started
    assert landing.failed and not landing.finish(0.1)


def test_a_step_whose_read_was_late_ends_without_waiting_its_deadline_again() -> None:
    """A read that missed its deadline stopped the landing already: the step's end reports it
    failed at once instead of waiting the deadline a second time for layers that never land."""
    release = threading.Event()

    def read() -> LoadOutcome:
        release.wait(10)
        return LoadOutcome(runs=[LoadRun(0, 0, 1, 0, TokenRows((0,), 0, 0, 64))])

    landed: list[int] = []
    landing = StepLanding(2)
    thread = threading.Thread(
        target=landing.run,
        args=(read, lambda i, _: landed.append(i), range(2), torch.device("cpu")),
    )
    thread.start()
    with pytest.raises(TimeoutError):
        landing.outcome(0.05)
    landing.stop()  # what the worker does when the read is late
    started = time.monotonic()
    assert not landing.finish(5.0)
    assert time.monotonic() - started < 1.0
    release.set()
    thread.join(10)
    assert landed == []  # the late outcome landed nothing
