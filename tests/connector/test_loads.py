"""A run of staged tier blocks lands in a layer's cache exactly where ``TokenRows`` says, for
every ratio of engine block to tier block and every alignment of the run's ends, written here
position by position from the definition and compared with ``land_run``'s block copies."""

from __future__ import annotations

import random

import pytest
import torch

from tessera_ray.vllm.loads import LoadRun, land_run
from tessera_ray.vllm.planes import mla_planes
from tessera_ray.vllm.records import TokenRows

ROW, LAYERS, CACHE_BLOCKS = 8, 3, 160


@pytest.mark.parametrize(("tier", "engine"), [(16, 16), (16, 64), (64, 16), (32, 128), (64, 32)])
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("ids", ["scattered", "runs"])
def test_a_run_lands_where_its_rows_say_and_nowhere_else(
    tier: int, engine: int, seed: int, ids: str
) -> None:
    """``ids``: the cache blocks vLLM gave the request, anywhere in the cache, or in runs of
    consecutive ids (as vLLM mostly hands them out), which land whole runs at a time."""
    rng = random.Random(seed)
    first_position = engine * rng.randrange(3)
    tier_position = first_position + tier * rng.randrange(engine // tier + 1)
    start = tier_position + rng.randrange(tier)  # the load starts inside its first tier block
    count = rng.randrange(1, 12)
    stop = min(tier_position + count * tier, start + rng.randrange(1, count * tier + 1))
    engine_blocks = -(-(stop - first_position) // engine)
    if ids == "scattered":
        block_ids = rng.sample(range(CACHE_BLOCKS), engine_blocks)
    else:  # consecutive runs of random lengths, one run's start apart from the last's end
        block_ids, at = [], rng.randrange(4)
        while len(block_ids) < engine_blocks:
            length = min(rng.randrange(1, 9), engine_blocks - len(block_ids))
            block_ids += range(at, at + length)
            at += length + rng.randrange(1, 3)
    rows = TokenRows(tuple(block_ids), first_position, start, stop)
    # Staged payloads: 2 blocks before the run, its blocks, 1 after; each block every layer's
    # page, so one layer's pages are a strided view, as in a worker.
    before, staged_blocks = 2, 2 + count + 1
    payload = torch.randn(staged_blocks, LAYERS, tier, ROW).to(torch.bfloat16)
    layer = 1
    pages = payload.view(torch.uint8).view(staged_blocks, -1)
    pages = pages[:, layer * tier * ROW * 2 : (layer + 1) * tier * ROW * 2]
    pages = pages.view(torch.bfloat16).reshape(staged_blocks, tier, ROW)
    assert not pages.is_contiguous()
    cache = torch.randn(CACHE_BLOCKS, engine, ROW).to(torch.bfloat16)
    want = cache.clone()
    run = LoadRun(part=0, first=before, count=count, skip=start - tier_position, rows=rows)

    land_run(mla_planes(cache, engine), pages, run, engine)

    for p in range(start, stop):
        block = rows.block_ids[(p - first_position) // engine]
        at = p - tier_position
        want[block, p % engine] = payload[before + at // tier, layer, at % tier]
    assert torch.equal(cache, want)
