"""Real vLLM engines on a tiny DeepSeek-V4 (one sliding-window-only, one CSA and one HCA layer)
through the tier: the same checks as the MLA model's (``test_engine.py``), for V4's six KV cache
groups (docs/v4-connector.md).

vLLM's CPU build has no CPU path for V4's Triton metadata kernels and a ``KeyError: 'c1a'`` in
0.32.0; the test-support plugin in ``tests/engine/v4_plugin`` (a vLLM general plugin, installed
in the engine venv) supplies torch stand-ins in every engine process. The reference engine
forces vLLM's own prefix caching back on (the CPU build turns it off without AMX).

A V4 prefix hit ends where a resume record was stored: at the end of a stored prefix. Prompts
are ``256 k + r`` tokens with ``r < 128``: the tier's hit (whole 128-token tier blocks) and
vLLM's own (whole 256-token blocks of its compressed caches) then cover the same tokens. The
partial prompt shares the first 10 tier blocks of "long", which "base" (those blocks and 5
tokens more) stored with its record.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.models.hf_tiny import write_tiny_v4
from tests.engine._harness import (
    check_eviction_run,
    eviction_jobs,
    full_tokens,
    same,
)
from tests.engine.conftest import EngineRun, hf_tiers, run, run_engine

TIER = 128  # the V4 tier block: the lcm of the compression strides and FlashMLA's page
MAIN, SMALL = "tessera-v4-main", "tessera-v4-small"

_rng = random.Random(20261205)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(1, 1000) for _ in range(n)]


PROMPTS = {
    "short": _prompt(256 + 5),  # ends inside a CSA layer's 4-token entry
    "window": _prompt(4 * 256 + 100),  # ends 100 tokens into a 128-token window
    "mid": _prompt(10 * 256 + 40),
    "long": _prompt(31 * 256 + 5),  # 7,941 tokens
}
BASE = PROMPTS["long"][: 10 * TIER + 5]
# Shares its first 10 tier blocks with "long" (and "base"), then differs.
PARTIAL = PROMPTS["long"][: 10 * TIER] + _prompt(40)
# Working set of the small tier's test: 3 prompts of 6 tier blocks (and a record each) in a
# tier that holds about one.
EVICT = {f"q{i}": _prompt(3 * 256 + 5) for i in range(1, 5)}


def _full(prompt: list[int]) -> int:
    return full_tokens(prompt, TIER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("v4-engines")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return write_tiny_v4(work / "tiny-v4")


# A record of the tiny V4 takes 35 tier blocks; a prompt of 6 blocks then takes 41, reserved
# whole before its identical chunks deduplicate. Under 55, the third store evicts the first
# prompt's oldest blocks however many chunks the records share: one engine build writes records
# whose chunks deduplicate by the dozen, another's barely at all.
SMALL_BLOCKS = 52


@pytest.fixture(scope="module")
def tiers(ray_cluster: None, model: Path) -> Iterator[None]:
    with hf_tiers(model, {MAIN: 1024, SMALL: SMALL_BLOCKS}):
        yield


@pytest.fixture(scope="module")
def reference(tiers: None, model: Path, work: Path) -> EngineRun:
    """vLLM's own prefix-cache hits, in the configuration under test; its cold runs store the
    prompts' blocks and records in the main tier (it saves, never loads)."""
    jobs: list[dict[str, Any]] = []
    for name, prompt in [*PROMPTS.items(), *EVICT.items()]:
        jobs += [
            {"name": f"{name}/cold", "prompt": prompt},
            {"name": f"{name}/hit", "prompt": prompt},
        ]
    jobs += [{"name": "base", "prompt": BASE}, {"name": "partial", "prompt": PARTIAL}]
    spec = {
        "model": str(model),
        "connector": {"backend": "ray", "ray_namespace": MAIN},
        "kv_role": "kv_producer",
        "force_prefix_caching": True,
        "jobs": jobs,
    }
    return run_engine(spec, work, "v4-reference")


@pytest.fixture(scope="module")
def second(reference: EngineRun, model: Path, work: Path) -> EngineRun:
    """A second engine process, default configuration: its prefixes come from the tier."""
    jobs = [{"name": n, "prompt": p} for n, p in PROMPTS.items()]
    jobs += [
        {"name": "partial", "prompt": PARTIAL},
        {"name": "mid/salted", "prompt": PROMPTS["mid"], "salt": "another-tenant"},
    ]
    spec = {
        "model": str(model),
        "connector": {"backend": "ray", "ray_namespace": MAIN},
        "connector_stats": True,
        "jobs": jobs,
    }
    return run_engine(spec, work, "v4-second")


def test_second_engine_gets_every_full_tier_block(second: EngineRun) -> None:
    for name, prompt in PROMPTS.items():
        assert second.results[name]["cached"] == _full(prompt), name
        counts = second.results[name]["connector"]
        assert (counts["loaded_blocks"], counts["failed_blocks"]) == (_full(prompt) // TIER, 0)
    assert second.results["partial"]["cached"] == 10 * TIER


def test_tier_hit_generates_what_vllms_own_prefix_hit_generates(
    reference: EngineRun, second: EngineRun
) -> None:
    """Every generated token and logprob of the tier hit equals vLLM's own prefix-cache hit on
    the same prompt: at a few hundred tokens to 8k, ending inside a compressed entry and inside
    a sliding window, and for a prompt sharing only its first blocks with a stored one."""
    assert reference.report["prefix_caching"]
    for name, prompt in PROMPTS.items():
        want = reference.results[f"{name}/hit"]
        assert want["cached"] == _full(prompt), f"{name}: vLLM's own hit is not like for like"
        assert same(second.results[name], want), f"{name}: {second.results[name]} != {want}"
    assert reference.results["partial"]["cached"] == 10 * TIER
    assert same(second.results["partial"], reference.results["partial"])


def test_another_cache_salt_gets_nothing_from_the_tier(
    reference: EngineRun, second: EngineRun
) -> None:
    salted = second.results["mid/salted"]
    assert salted["cached"] == 0 and salted["connector"]["loaded_blocks"] == 0
    assert same(salted, reference.results["mid/cold"])


def test_tier_smaller_than_the_working_set_and_a_killed_pool(
    reference: EngineRun, model: Path, work: Path
) -> None:
    """A tier that holds about one of three prompts (blocks and records) evicts; every answer
    is a full tier hit or a full recompute, each equal to vLLM's own run of that kind. Then the
    tier's only pool is killed while the engine serves: it keeps serving, recomputing."""
    spec = {
        "model": str(model),
        "connector": {"backend": "ray", "ray_namespace": SMALL, "timeout_s": 10.0},
        "connector_stats": True,
        "jobs": eviction_jobs(EVICT, SMALL),
    }
    small = run_engine(spec, work, "v4-small-tier")
    check_eviction_run(small, reference, {n: _full(p) for n, p in EVICT.items()})


def test_a_tier_of_another_model_is_refused_at_start_in_one_line(
    tiers: None, reference: EngineRun, model: Path, work: Path
) -> None:
    """A V4 engine over a tier started for another geometry stops at start, naming both."""
    run(
        "tessera-ray", "start", "--model", "deepseek-v3", "--num-blocks", "8",
        "--ray-namespace", "tessera-v4-other",
    )  # fmt: skip
    try:
        spec = {
            "model": str(model),
            "tries": [{"backend": "ray", "ray_namespace": "tessera-v4-other"}],
            "jobs": [],
        }
        out = run_engine(spec, work, "v4-bad")
    finally:
        run("tessera-ray", "stop", "--ray-namespace", "tessera-v4-other", check=False)
    assert not out.report["tries"][0]["started"]
    assert re.search(r"the tier stores deepseek-v3/\S+ .* the engine's hybrid cache is", out.log)
