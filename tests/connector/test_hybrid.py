"""The connector's hybrid path without vLLM (tessera_ray/vllm/hybrid*.py): a model of two
layers, each with a cache that keeps every position (one entry per token, or one per 4) and a
sliding window, in vLLM's way of holding them (one group for the full caches, a group per
window with its own block size, null blocks where a window dropped positions; the 4-token
cache paged as V4's indexer cache is, every key of a block before every scale). One engine
saves; another loads into other block ids; every loaded byte equals the saved one and no other
byte is written; a load missing any part writes nothing."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

import pytest
import torch

from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LayoutError
from tessera_ray.layout import CacheSpec, EntryFormat, ModelLayout, Region, Scheme
from tessera_ray.layout.dtypes import DType
from tessera_ray.vllm.backend import TierHit
from tessera_ray.vllm.hybrid import EngineGroup, HybridPlanner
from tessera_ray.vllm.hybrid_worker import HybridMover, resume_chunks
from tessera_ray.vllm.records import NewScheduled, StepPlan
from tessera_ray.vllm.tiers import LocalTier
from tests.connector.test_connector_config import _Request


def _entry(name: str, nbytes: int) -> EntryFormat:
    return EntryFormat(name=name, regions=(Region(name="v", num_values=nbytes, dtype=DType.INT8),))


FULL = CacheSpec(scheme=Scheme.MLA, entry=_entry("full8", 8))
# Named as V4's indexer entry: the connector reads it as vLLM pages it (keys, then scales).
CSA = CacheSpec(
    scheme=Scheme.INDEXER,
    entry=EntryFormat(
        name="v4-indexer",
        regions=(
            Region(name="index_key", num_values=128, dtype=DType.FP8_E4M3),
            Region(name="index_scale", num_values=1, dtype=DType.FP32),
        ),
    ),
    stride_tokens=4,
)
WINDOW = CacheSpec(scheme=Scheme.SWA, entry=_entry("swa100", 100), window_tokens=5)
LAYOUT = ModelLayout(
    model="tiny-hybrid",
    format_name="test",
    layers=((FULL, WINDOW), (CSA, WINDOW)),
    block_tokens=8,
    mha_bytes_per_token=64,
)
# vLLM's groups: the full caches share 16-token blocks, each window has its own 4-token ones.
GROUPS = (EngineGroup(16), EngineGroup(4, 5), EngineGroup(4, 5))
GROUP_OF = {"layer.0.full": 0, "layer.1.csa": 0, "layer.0.swa": 1, "layer.1.swa": 2}
NUM_BLOCKS = 24


def test_record_and_block_sizes_follow_from_the_layout() -> None:
    # A tier block: 8 full entries of 8 B and 2 indexer entries of 132 B; a record: 4 kept
    # positions of 100 B in each of two windows.
    assert LAYOUT.block_bytes == 8 * 8 + 2 * 132
    assert LAYOUT.resume_bytes == 2 * 4 * 100
    assert resume_chunks(LAYOUT) == 3  # 800 B in blocks of 328


def _caches(fill: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Caches shaped as vLLM's CPU build keeps them; layer 0's window is a view into a wider
    shared tensor (strided between blocks), as vLLM's hybrid pool is."""
    shared = torch.zeros((NUM_BLOCKS, 600), dtype=torch.uint8)
    caches = {
        "layer.0.full": torch.zeros((NUM_BLOCKS, 1, 16, 8), dtype=torch.uint8),
        "layer.1.csa": torch.zeros((NUM_BLOCKS, 1, 4, 132), dtype=torch.uint8),
        "layer.0.swa": shared[:, :400].view(NUM_BLOCKS, 4, 100),
        "layer.1.swa": torch.zeros((NUM_BLOCKS, 1, 4, 100), dtype=torch.uint8),
    }
    gen = torch.Generator().manual_seed(seed)
    for kv in caches.values():
        if fill is None:
            kv.copy_(torch.randint(0, 256, kv.shape, generator=gen, dtype=torch.uint8))
        else:
            kv.fill_(fill)
    return caches


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def _planner(tier: object) -> HybridPlanner:
    return HybridPlanner(
        tier,  # type: ignore[arg-type]
        LAYOUT,
        groups=GROUPS,
        resume_chunks=resume_chunks(LAYOUT),
        namespace="app",
        model_name="tiny-hybrid",
        can_load=True,
        can_save=True,
        lookup_wait_s=10.0,
    )


def _mover(tier: LocalTier, caches: dict[str, torch.Tensor]) -> HybridMover:
    mover = HybridMover(tier, LAYOUT, groups=GROUPS, can_save=True, timeout_s=10.0)
    mover.register(caches, _layer, GROUP_OF)
    return mover


def _entry(kv: torch.Tensor, block: int, e: int, split: int | None) -> torch.Tensor:
    """Entry ``e`` of engine block ``block``: its bytes, or with ``split`` its first ``split``
    bytes from the block's key part and the rest from its scale part."""
    flat = kv[block].reshape(-1)
    per_block = kv.reshape(kv.shape[0], -1, kv.shape[-1]).shape[1]
    if split is None:
        width = flat.numel() // per_block
        return flat[e * width : (e + 1) * width].clone()
    rest = flat.numel() // per_block - split
    key = flat[e * split : (e + 1) * split]
    scale = flat[per_block * split + e * rest : per_block * split + (e + 1) * rest]
    return torch.cat([key, scale])


def _positions(
    kv: torch.Tensor, ids: Sequence[int], per_block: int, stride: int, split: int | None = None
) -> dict[int, torch.Tensor]:
    """Entry bytes of ``kv`` by the position they end (``stride`` tokens per entry)."""
    return {
        (i * per_block + e + 1) * stride - 1: _entry(kv, b, e, split)
        for i, b in enumerate(ids)
        for e in range(per_block)
        if b != 0
    }


TOKENS = list(range(1, 23))  # 22 tokens: two whole tier blocks, a record at 16
A_IDS = {0: [5, 9], 1: [2, 3, 4, 6, 7, 8], 2: [10, 11, 12, 13, 14, 15]}
B_IDS = {0: [20, 17], 1: [0, 0, 0, 21], 2: [0, 0, 0, 22]}


def _save(tier: LocalTier, tokens: list[int] = TOKENS) -> dict[str, torch.Tensor]:
    """Engine A computes ``tokens`` in one step in its blocks A_IDS; returns its caches."""
    caches = _caches(seed=1)
    ids = {g: A_IDS[g][: -(-len(tokens) // GROUPS[g].block_tokens)] for g in A_IDS}
    planner = _planner(tier)
    request = _Request("a", tokens)
    assert planner.matched_tokens(request, 0) == 0
    plan = planner.build([NewScheduled("a", ids[0], 0, len(tokens), (ids[0], ids[1], ids[2]))], [])
    (save,) = plan.saves
    stop = len(tokens) // 8 * 8
    assert len(save.token_keys) == stop // 8 and len(save.resume_keys) == 3
    kept = (stop - 4, stop)  # a window of 5 keeps 4 positions
    assert [(r.start, r.stop) for r in save.groups] == [(0, stop), kept, kept]
    mover = _mover(tier, caches)
    mover.finish(plan)
    assert mover.flush(10.0)
    assert mover.take_done_saves() == [plan.save_seq]
    return caches


def _load_into(
    tier: LocalTier, tokens: list[int], hit: int
) -> tuple[HybridMover, StepPlan, dict[str, torch.Tensor], dict[int, list[int]]]:
    """Engine B asks for ``tokens``: vLLM gives it other block ids (B_IDS), nulls where the
    windows dropped positions."""
    planner = _planner(tier)
    request = _Request("b", tokens)
    matched = planner.matched_tokens(request, 0)
    assert matched == hit
    count = {g: -(-hit // GROUPS[g].block_tokens) for g in B_IDS}
    ids = {0: B_IDS[0][: count[0]]} | {g: [0] * (count[g] - 1) + B_IDS[g][-1:] for g in (1, 2)}
    planner.after_alloc_groups(request, (ids[0], ids[1], ids[2]), matched)
    plan = planner.build([], [])
    caches = _caches(fill=7)
    return _mover(tier, caches), plan, caches, ids


# name: (group, entries per engine block, tokens per entry, split of a V4-paged entry)
CACHES = {
    "layer.0.full": (0, 16, 1, None),
    "layer.1.csa": (0, 4, 4, 128),
    "layer.0.swa": (1, 4, 1, None),
    "layer.1.swa": (2, 4, 1, None),
}


def _wait(mover: HybridMover, plan: StepPlan) -> tuple[set[str], set[str]]:
    """Start the step's loads and ask every step (as vLLM does) until they are reported."""
    mover.start(plan)
    for _ in range(500):
        done, failed = mover.take_finished()
        if done:
            return done, failed
        time.sleep(0.01)
    raise AssertionError("the load never ended")


@pytest.mark.parametrize("tokens", [22, 10], ids=["two-blocks", "one-block"])
def test_a_hybrid_prefix_saved_by_one_engine_loads_into_another_byte_for_byte(
    tokens: int,
) -> None:
    """Every entry B holds at a loaded position (the prefix blocks' positions in the full
    caches, the kept ones in the windows) equals A's entry there; every other entry of B is
    still what vLLM left (7s), partly written engine blocks included."""
    tier = LocalTier(LAYOUT, num_blocks=32, device="cpu", timeout_s=10.0)
    prompt = TOKENS[:tokens]
    a = _save(tier, prompt)
    hit = (tokens - 1) // 8 * 8
    mover, plan, b, b_ids = _load_into(tier, [*prompt[: hit + 4], 99, 98], hit)
    (load,) = plan.loads
    assert [(r.start, r.stop) for r in load.groups] == [(0, hit), (hit - 4, hit), (hit - 4, hit)]
    assert _wait(mover, plan) == ({"b"}, set())
    for name, (group, per_block, stride, split) in CACHES.items():
        want = _positions(a[name], A_IDS[group], per_block, stride, split)
        got = _positions(b[name], b_ids[group], per_block, stride, split)
        loaded = range(hit) if group == 0 else range(hit - 4, hit)
        for position, entry in got.items():
            if position in loaded:
                assert torch.equal(entry, want[position]), f"{name} at {position}"
            else:
                assert bool((entry == 7).all()), f"{name} at {position} written"
        assert {p for p in got if p in loaded} == {p for p in loaded if (p + 1) % stride == 0}
        rows = b[name].reshape(NUM_BLOCKS, -1)
        others = [i for i in range(NUM_BLOCKS) if i not in b_ids[group]]
        assert bool((rows[others] == 7).all()), name
    counts = mover.counters.take()
    assert counts is not None and counts["loaded_blocks"] == hit // 8


def test_a_load_missing_a_record_chunk_fails_whole_and_writes_nothing() -> None:
    tier = LocalTier(LAYOUT, num_blocks=32, device="cpu", timeout_s=10.0)
    _save(tier)
    mover, plan, b, _ = _load_into(tier, TOKENS, 16)
    (load,) = plan.loads
    # The last chunk is gone by the time the worker reads (evicted after the lookup).
    gone = StepPlan(
        loads=(
            type(load)(
                load.req_id,
                load.namespace,
                load.token_keys,
                load.hits,
                load.tier_position,
                load.rows,
                load.groups,
                (*load.resume_keys[:-1], TokenKey(b"\x01" * 32)),
                load.resume_hits,
            ),
        )
    )
    assert _wait(mover, gone) == ({"b"}, {"b"})
    assert all(bool((kv == 7).all()) for kv in b.values())


class _Tier:
    """A directory stand-in holding a chosen set of keys."""

    def __init__(self, held: set[TokenKey]) -> None:
        self.held = held

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        future: concurrent.futures.Future[list[TierHit | None]] = concurrent.futures.Future()
        future.set_result([TierHit(b"h" * 16) if k in self.held else None for k in keys])
        return future


def test_a_hit_ends_where_a_whole_record_is_held() -> None:
    """Three prefix blocks held, records at 8 (whole) and 24 (one chunk missing): the hit is
    8 tokens, never the prefix alone."""
    probe = _planner(_Tier(set()))
    request = _Request("c", list(range(1, 30)))
    keys = probe._keys(probe._track(request), 3)
    tracked = probe._track(request)
    held = set(keys) | set(probe._resume(tracked, keys[0]))
    held |= set(probe._resume(tracked, keys[2])[:-1])
    planner = _planner(_Tier(held))
    assert planner.matched_tokens(_Request("c", list(range(1, 30))), 0) == 8
    # No record anywhere: the prefix blocks alone are no hit.
    assert _planner(_Tier(set(keys))).matched_tokens(_Request("d", list(range(1, 30))), 0) == 0


def test_a_hybrid_hit_is_taken_whole_or_refused() -> None:
    tier = LocalTier(LAYOUT, num_blocks=32, device="cpu", timeout_s=10.0)
    _save(tier)
    planner = _planner(tier)
    request = _Request("e", TOKENS)
    assert planner.matched_tokens(request, 0) == 16
    with pytest.raises(LayoutError, match="loaded whole or not at all"):
        planner.after_alloc_groups(request, ([1], [0, 0, 1], [0, 0, 1]), 8)


def test_a_registered_cache_the_layout_does_not_hold_is_refused_by_name() -> None:
    tier = LocalTier(LAYOUT, num_blocks=8, device="cpu", timeout_s=10.0)
    caches = _caches(fill=0)
    caches["layer.1.csa"] = torch.zeros((NUM_BLOCKS, 1, 4, 131), dtype=torch.uint8)
    mover = HybridMover(tier, LAYOUT, groups=GROUPS, can_save=False, timeout_s=1.0)
    with pytest.raises(LayoutError, match=r"vLLM cache layer.1.csa .* 4 entries of 131 B"):
        mover.register(caches, _layer, GROUP_OF)
    mover.close()


def test_a_record_still_landing_is_waited_for_not_taken_as_a_miss() -> None:
    """This engine's store holds the prefix blocks and their record; a lookup that finds the
    blocks but not yet the record asks again, and takes the hit once the record is there."""
    tier = _Tier(set())
    planner = _planner(tier)
    ids = {g: A_IDS[g][: -(-len(TOKENS) // GROUPS[g].block_tokens)] for g in A_IDS}
    assert planner.matched_tokens(_Request("a", TOKENS), 0) == 0
    plan = planner.build([NewScheduled("a", ids[0], 0, len(TOKENS), (ids[0], ids[1], ids[2]))], [])
    (save,) = plan.saves
    tier.held |= set(save.token_keys)  # the blocks are in, the record not yet
    request = _Request("b", TOKENS)
    assert planner.matched_tokens(request, 0) is None
    tier.held |= set(save.resume_keys)
    time.sleep(0.05)  # past the planner's delay between lookups
    assert planner.matched_tokens(request, 0) == 16
