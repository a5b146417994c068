"""Real vLLM engines on a tiny grouped-query full-attention model (Qwen2, 8 query heads over 2 KV
heads) through the tier: the same checks as the MLA model's (``test_engine.py``).

vLLM's CPU attention keeps each head's K and V of a block apart, packed for its instruction set
(docs/full-attention-caches.md); the tier stores per token K then V of every head, in 64-token
blocks. The CPU engine runs full attention in blocks of 128 tokens by default (32 asked here
too); prefix caching stays on. The tier is started from the model's own ``config.json``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.models.hf_tiny import write_tiny_gqa
from tests.engine._harness import check_eviction_run, eviction_jobs, same
from tests.engine.conftest import EngineRun, hf_tiers, run_engine
from tests.engine.test_engine import EVICT, PARTIAL, PROMPTS, TIER, _full

MAIN, SMALL = "tessera-gqa-main", "tessera-gqa-small"
# Shares its first 640 tokens with "long" (whole engine blocks of 32 and 128), then 15 of its
# own: no full tier block past 640, so vLLM's own hit and the tier's cover the same.
PARTIAL_GQA = PARTIAL[:655]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gqa-engines")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return write_tiny_gqa(work / "tiny-gqa-4", 4)


@pytest.fixture(scope="module")
def tiers(ray_cluster: None, model: Path) -> Iterator[None]:
    # 24 blocks: the eviction test's three prompts of 10 blocks do not fit.
    with hf_tiers(model, {MAIN: 256, SMALL: 24}):
        yield


def _engines(model: Path, work: Path, block: int | None) -> tuple[EngineRun, EngineRun]:
    """vLLM's own prefix hits (an engine that stores into the tier, never loads), then a second
    engine process whose prefixes come from the tier."""
    jobs: list[dict[str, Any]] = []
    for name, prompt in [*PROMPTS.items(), *(EVICT.items() if block is None else ())]:
        jobs += [
            {"name": f"{name}/cold", "prompt": prompt},
            {"name": f"{name}/hit", "prompt": prompt},
        ]
    jobs.append({"name": "partial", "prompt": PARTIAL_GQA})
    connector = {"backend": "ray", "ray_namespace": MAIN}
    base = {"model": str(model), "block_size": block, "connector": connector}
    tag = block or "default"
    reference = run_engine(
        {**base, "kv_role": "kv_producer", "force_prefix_caching": True, "jobs": jobs},
        work,
        f"gqa-reference-{tag}",
    )
    second_jobs = [{"name": n, "prompt": p} for n, p in PROMPTS.items()]
    second_jobs += [
        # vLLM's own cache holds "long" by now: emptied, so that the prefix comes from the tier.
        {"name": "partial", "prompt": PARTIAL_GQA, "fresh_cache": True},
        {"name": "mid/salted", "prompt": PROMPTS["mid"], "salt": f"another-tenant-{tag}"},
    ]
    second = run_engine(
        {**base, "connector_stats": True, "jobs": second_jobs}, work, f"gqa-second-{tag}"
    )
    return reference, second


@pytest.fixture(scope="module", params=[None, 32], ids=lambda b: f"block-{b or 'default'}")
def pair(
    request: pytest.FixtureRequest, tiers: None, model: Path, work: Path
) -> tuple[EngineRun, EngineRun]:
    return _engines(model, work, request.param)


def test_second_engine_gets_every_full_tier_block_and_vllms_own_tokens(
    pair: tuple[EngineRun, EngineRun],
) -> None:
    reference, second = pair
    assert reference.report["prefix_caching"]
    assert reference.report["block_size"] == second.report["block_size"]
    for name, prompt in [*PROMPTS.items(), ("partial", PARTIAL_GQA)]:
        got = second.results[name]
        want = reference.results[f"{name}/hit" if name != "partial" else "partial"]
        full = _full(prompt)
        assert got["cached"] == full, name
        assert got["connector"]["loaded_blocks"] == full // TIER, name
        assert want["cached"] == full, f"{name}: vLLM's own hit is not like for like"
        assert same(got, want), f"{name}: {got} != {want}"


def test_another_cache_salt_gets_nothing_from_the_tier(pair: tuple[EngineRun, EngineRun]) -> None:
    reference, second = pair
    salted = second.results["mid/salted"]
    assert salted["cached"] == 0 and salted["connector"]["loaded_blocks"] == 0
    assert same(salted, reference.results["mid/cold"])


def test_eviction_and_a_killed_pool(
    pair: tuple[EngineRun, EngineRun], model: Path, work: Path
) -> None:
    """As the MLA model's: every answer under eviction is a full tier hit or a full recompute,
    each equal to vLLM's own run of that kind; a killed pool leaves the engine recomputing.
    vLLM's own prefix cache is emptied before each run (it holds all of them otherwise)."""
    reference, _ = pair
    if reference.report["block_size"] != 128:
        pytest.skip("run once, at the engine's default block size")
    connector = {"backend": "ray", "ray_namespace": SMALL, "timeout_s": 10.0}
    spec = {
        "model": str(model),
        "connector": connector,
        "connector_stats": True,
        "jobs": eviction_jobs(EVICT, SMALL),
    }
    small = run_engine(spec, work, "gqa-small")
    check_eviction_run(small, reference, {n: _full(p) for n, p in EVICT.items()})
