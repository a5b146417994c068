"""Real vLLM engines (vLLM's CPU build) generating through the tier, each in its own process.

The check that matters: an engine that takes a prefix from the tier generates exactly what vLLM
generates from its own prefix cache, token for token and logprob for logprob. The reference is
an engine of the same configuration (the connector configured, as ``kv_producer``: it saves to
the tier but never loads from it), whose second run of a prompt is vLLM's own prefix-cache hit.
The configuration must match: vLLM's CPU build reserves a core for any KV connector, so an
engine without one runs its worker on fewer threads and rounds its decode differently
(docs/engine-parity.md).

Prompts are ``64 k + 5`` tokens with ``k`` even, so that vLLM's own hit (whole engine blocks of
16 or 128 tokens, never the last token) covers exactly the tier's hit (whole 64-token tier
blocks): both then compute the same last tokens over the same cached prefix.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera_ray.models.hf_tiny import tier_geometry, write_tiny_mla
from tests.engine._harness import check_eviction_run, eviction_jobs, full_tokens, same
from tests.engine.conftest import EngineRun, engine_block_sizes, run, run_engine

TIER = 64  # the tier block of MLA (FlashMLA's page) and of full attention
MAIN, SMALL, ODD = "tessera-engine-main", "tessera-engine-small", "tessera-engine-odd"

_rng = random.Random(20261203)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(1, 1000) for _ in range(n)]


PROMPTS = {
    "short": _prompt(4 * TIER + 5),
    "mid": _prompt(16 * TIER + 5),
    "long": _prompt(64 * TIER + 5),
}
# Shares its first 10 tier blocks with "long", then differs; too short for an 11th full block.
PARTIAL = PROMPTS["long"][: 10 * TIER] + _prompt(40)
# Working set of the small tier's test: 3 prompts of 10 tier blocks in a 24-block tier.
EVICT = {f"q{i}": _prompt(10 * TIER + 5) for i in range(1, 5)}
# Two tenants' prompts (cache salts: two namespaces), asked together of the second engine so
# that their tier hits load in the same steps.
TENANTS = {f"tenant-{t}": _prompt(8 * TIER + 5) for t in "ab"}


def _full(prompt: list[int]) -> int:
    return full_tokens(prompt, TIER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def models(work: Path) -> dict[str, Path]:
    return {
        "tiny4": write_tiny_mla(work / "tiny-mla-4", 4),
        "tiny2": write_tiny_mla(work / "tiny-mla-2", 2),
    }


def _start_tier(
    work: Path, namespace: str, blocks: int, hf_config: Path | None = None, **geometry: Any
) -> None:
    """A tier for the tiny model: from the model's own config.json (``hf_config``, as a user
    names a model), or from our geometry fields."""
    path = work / f"{namespace}.json"
    import json

    path.write_text(json.dumps(tier_geometry(namespace, 4, **geometry)))
    model = ["--hf-config", str(hf_config)] if hf_config else ["--config", str(path)]
    out = run(
        "tessera-ray", "start", *model, "--num-blocks", str(blocks), "--ray-namespace", namespace
    )
    assert "joined the Ray cluster" in out.stdout


@pytest.fixture(scope="module")
def tiers(ray_cluster: None, work: Path, models: dict[str, Path]) -> Iterator[None]:
    _start_tier(work, MAIN, 1024, hf_config=models["tiny4"])
    _start_tier(work, SMALL, 24)
    _start_tier(work, ODD, 8, block_tokens=24)
    yield
    for namespace in (MAIN, SMALL, ODD):
        run("tessera-ray", "stop", "--ray-namespace", namespace, check=False)


def _status(namespace: str) -> str:
    return run("tessera-ray", "status", "--ray-namespace", namespace).stdout


def _blocks_held(namespace: str) -> list[int]:
    """The ``blocks`` column of ``tessera-ray status`` (memory + disk), per pool."""
    return [
        int(m.group(1)) + int(m.group(2))
        for m in re.finditer(r" (\d+)\+(\d+) ", _status(namespace))
    ]


def _tenants_batch(suffix: str) -> dict[str, Any]:
    """Both tenants' prompts in one ``generate`` (results named ``<salt><suffix>``)."""
    return {
        "name": "tenants",
        "batch": [{"name": f"{s}{suffix}", "prompt": p, "salt": s} for s, p in TENANTS.items()],
    }


def _reference(models: dict[str, Path], work: Path, block: int | None, name: str) -> EngineRun:
    """vLLM's own prefix-cache hits, in the engine configuration under test; its cold runs
    store the prompts' blocks in the main tier (it is the first engine of the two)."""
    jobs: list[dict[str, Any]] = []
    for prompt_name, prompt in [*PROMPTS.items(), *(EVICT.items() if block is None else ())]:
        jobs += [
            {"name": f"{prompt_name}/cold", "prompt": prompt},
            {"name": f"{prompt_name}/hit", "prompt": prompt},
        ]
    jobs.append({"name": "partial", "prompt": PARTIAL})  # a hit on the first 10 blocks of "long"
    spec = {
        "model": str(models["tiny4"]),
        "block_size": block,
        "connector": {"backend": "ray", "ray_namespace": MAIN},
        "kv_role": "kv_producer",
        "force_prefix_caching": True,
        "jobs": jobs,
    }
    return run_engine(spec, work, name)


def _second(models: dict[str, Path], work: Path, block: int | None, name: str) -> EngineRun:
    """A second engine process, default configuration: its prefixes come from the tier."""
    jobs: list[dict[str, Any]] = [{"name": n, "prompt": p} for n, p in PROMPTS.items()]
    jobs += [
        # vLLM's own cache holds "long" where the engine keeps prefix caching on (MLA on CPUs
        # with AMX): emptied, so that the hit on its first 10 blocks is the tier's.
        {"name": "partial", "prompt": PARTIAL, "fresh_cache": True},
        # A tenant of its own per engine: every engine stores what it computes, so a salt an
        # earlier engine used is that tenant's own hit, rightly served.
        {"name": "mid/salted", "prompt": PROMPTS["mid"], "salt": f"another-tenant-{name}"},
    ]
    spec = {
        "model": str(models["tiny4"]),
        "block_size": block,
        "connector": {"backend": "ray", "ray_namespace": MAIN},
        "connector_stats": True,
        "jobs": jobs,
    }
    return run_engine(spec, work, name)


@pytest.fixture(scope="module")
def reference(tiers: None, models: dict[str, Path], work: Path) -> EngineRun:
    return _reference(models, work, None, "reference")


@pytest.fixture(scope="module")
def second(reference: EngineRun, models: dict[str, Path], work: Path) -> EngineRun:
    return _second(models, work, None, "second")


@pytest.fixture(scope="module")
def tenants(tiers: None, models: dict[str, Path], work: Path) -> tuple[EngineRun, EngineRun]:
    """vLLM's own hits of both tenants' prompts asked together (its cold runs store them),
    then another engine asked the same, its prefixes from the tier. A batch decodes unlike
    one sequence alone, so both engines must put both requests in the same steps: their engine
    core runs in the process that adds the requests (no race between the two arriving), and
    the second's scheduler waits for each lookup's answer (an answer still on its way would
    put that request into a later step)."""
    base = {"model": str(models["tiny4"]), "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    connector = {"backend": "ray", "ray_namespace": MAIN}
    cold = [{"name": f"{s}/cold", "prompt": p, "salt": s} for s, p in TENANTS.items()]
    reference = {
        **base,
        "connector": connector,
        "kv_role": "kv_producer",
        "force_prefix_caching": True,
        "jobs": [*cold, _tenants_batch("/hit")],
    }
    loading = {
        **base,
        "connector": {**connector, "lookup_wait_s": 10.0},
        "connector_stats": True,
        "jobs": [_tenants_batch("")],
    }
    return run_engine(reference, work, "tenants-reference"), run_engine(loading, work, "tenants")


_COVERED: dict[int, str] = {}


ASKED = (16, 64, 128)


@pytest.fixture(scope="module", params=[None, *ASKED], ids=lambda b: f"block-{b or 'default'}")
def pair(
    request: pytest.FixtureRequest,
    reference: EngineRun,
    second: EngineRun,
    models: dict[str, Path],
    work: Path,
) -> tuple[EngineRun, EngineRun]:
    """(reference, second engine) at the engine's default block size and at 16, 64 and 128
    asked explicitly. vLLM's CPU build may run another size than asked (16 on its reference
    MLA backend): a size already covered is not run twice. It may also refuse a size (its AMX
    MLA backend takes multiples of 32): that size is not run, the others are."""
    asked: int | None = request.param
    if asked is None:
        _COVERED.setdefault(second.report["block_size"], "the default")
        return reference, second
    got = engine_block_sizes(models["tiny4"], ASKED)[asked]
    if got is None:
        pytest.skip(f"block_size={asked}: vLLM's attention backend on this CPU takes no such size")
    if got in _COVERED:
        pytest.skip(f"block_size={asked} runs as {got} here: covered by {_COVERED[got]}")
    _COVERED[got] = f"block_size={asked}"
    ref = _reference(models, work, asked, f"reference-{asked}")
    return ref, _second(models, work, asked, f"second-{asked}")


def test_readme_cluster_steps_as_written(ray_cluster: None) -> None:
    """README: `ray start --head --node-ip-address 127.0.0.1`, then `tessera-ray start --model
    deepseek-v3 --num-blocks 64`, then `tessera-ray status`: start joins the running cluster
    (its actors outlive the command) and status finds them."""
    out = run("tessera-ray", "start", "--model", "deepseek-v3", "--num-blocks", "64")
    assert "joined the Ray cluster" in out.stdout and "1 pools" in out.stdout
    status = _status("tessera")
    assert "pools: 1 up, 0 down" in status
    run("tessera-ray", "stop")
    assert "no tessera-ray pools" in run("tessera-ray", "status", check=False).stderr


def test_second_engine_gets_every_full_tier_block(pair: tuple[EngineRun, EngineRun]) -> None:
    _, second = pair
    for name, prompt in PROMPTS.items():
        assert second.results[name]["cached"] == _full(prompt), name
    assert second.results["partial"]["cached"] == 10 * TIER
    # The connector's own counts, as vLLM's stat logger received them, agree.
    for name, blocks in [*((n, _full(p) // TIER) for n, p in PROMPTS.items()), ("partial", 10)]:
        counts = second.results[name]["connector"]
        assert (counts["loaded_blocks"], counts["failed_blocks"]) == (blocks, 0), name
        assert counts["in_place_blocks"] == blocks, name  # a local hit is copied once
        assert counts["worker_steps"] >= 1 and counts["forward_s"] > 0


def test_tier_hit_generates_what_vllms_own_prefix_hit_generates(
    pair: tuple[EngineRun, EngineRun],
) -> None:
    """Every generated token and logprob of the tier hit equals vLLM's own prefix-cache hit on
    the same prompt, at every length, and for a prompt sharing only its first blocks."""
    reference, second = pair
    assert reference.report["prefix_caching"]
    assert reference.report["block_size"] == second.report["block_size"]
    for name, prompt in PROMPTS.items():
        want = reference.results[f"{name}/hit"]
        assert want["cached"] == _full(prompt), f"{name}: vLLM's own hit is not like for like"
        assert same(second.results[name], want), f"{name}: {second.results[name]} != {want}"
    assert reference.results["partial"]["cached"] == 10 * TIER
    assert same(second.results["partial"], reference.results["partial"])


def test_two_tenants_hits_loaded_together_each_generate_what_vllm_generates(
    tenants: tuple[EngineRun, EngineRun],
) -> None:
    """Two tenants' prompts asked together: both prefixes come from the tier, each tenant's
    own (two namespaces, two reads in a step), and each generates what vLLM's own hits of the
    same two prompts asked together generate."""
    reference, tenants_run = tenants
    for salt, prompt in TENANTS.items():
        want, got = reference.results[f"{salt}/hit"], tenants_run.results[salt]
        assert want["cached"] == got["cached"] == _full(prompt), salt
        assert same(got, want), f"{salt}: {got} != {want}"
    blocks = sum(_full(p) // TIER for p in TENANTS.values())
    counts = tenants_run.results["tenants"]["connector"]
    # Both reads were served in the pool's pinned pages (one copy, into the cache): the two
    # namespaces' views stay valid together, where a staging buffer is one read's at a time.
    assert counts["loaded_blocks"] == counts["in_place_blocks"] == blocks


def test_another_cache_salt_gets_nothing_from_the_tier(
    pair: tuple[EngineRun, EngineRun],
) -> None:
    reference, second = pair
    salted = second.results["mid/salted"]
    assert salted["cached"] == 0 and salted["connector"]["loaded_blocks"] == 0
    assert same(salted, reference.results["mid/cold"])


def test_tier_smaller_than_the_working_set_and_a_killed_pool(
    reference: EngineRun, models: dict[str, Path], work: Path
) -> None:
    """A 24-block tier under a 30-block working set evicts; every answer is then either a full
    tier hit or a full recompute, each equal to vLLM's own run of the same kind. Then the tier's
    only pool is killed while the engine serves: it keeps serving, recomputing, no wrong token."""
    spec = {
        "model": str(models["tiny4"]),
        "connector": {"backend": "ray", "ray_namespace": SMALL, "timeout_s": 10.0},
        "connector_stats": True,
        "jobs": eviction_jobs(EVICT, SMALL),
    }
    small = run_engine(spec, work, "small-tier")
    check_eviction_run(small, reference, {n: _full(p) for n, p in EVICT.items()})


def test_bad_configuration_fails_at_engine_start_with_one_line(
    tiers: None, second: EngineRun, models: dict[str, Path], work: Path
) -> None:
    """Each bad configuration stops the engine at start, the reason in one line of its output;
    nothing reaches any tier."""
    held = {ns: _blocks_held(ns) for ns in (MAIN, ODD)}
    ray_main = {"backend": "ray", "ray_namespace": MAIN}
    tries = [
        (ray_main, "tiny2", r"the engine has 2 layers"),
        ({**ray_main, "blocks": 3}, "tiny4", r"unknown key\(s\) blocks"),
        (
            {"backend": "ray", "ray_namespace": "tessera-nowhere"},
            "tiny4",
            r"no tessera-ray pools in Ray namespace 'tessera-nowhere'",
        ),
        (
            {"backend": "ray", "ray_namespace": ODD},
            "tiny4",
            r"block_size \d+ and the tier's block of 24 tokens do not divide",
        ),
        ({"backend": "local"}, "tiny4", r"backend 'local' keeps the tier inside one process"),
    ]
    for model in ("tiny2", "tiny4"):
        mine = [(c, p) for c, m, p in tries if m == model]
        spec = {"model": str(models[model]), "tries": [c for c, _ in mine], "jobs": []}
        out = run_engine(spec, work, f"bad-{model}")
        sections = re.split(r"=== try \d+ ===", out.log)[1:]
        for (config, pattern), outcome, section in zip(
            mine, out.report["tries"], sections, strict=True
        ):
            assert not outcome["started"], f"{config} started"
            assert re.search(pattern, section), f"{config}: no line matching {pattern!r}"
    assert {ns: _blocks_held(ns) for ns in (MAIN, ODD)} == held
    assert held[ODD] == [0]
