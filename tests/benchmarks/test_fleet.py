"""bench_fleet.py (agent fleet over the tier) and the chunked prefill it recomputes with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tessera_ray.demo.engine import Engine
from tessera_ray.models import TinyMLA
from tests.benchmarks.contract import ROOT, run_quick

sys.path.insert(0, str(ROOT / "benchmarks"))
from _prefill import ChunkedPrefill

sys.path.pop(0)


def test_chunked_prefill_matches_dense_prefill_and_engine_payloads() -> None:
    engine = Engine(3)
    tokens = torch.randint(0, 256, (3 * 64,), generator=torch.Generator().manual_seed(3))
    ChunkedPrefill.check(engine.model, tokens, chunk=64)  # raises on a mismatch
    chunked = ChunkedPrefill(engine.model, tokens.numel())
    chunked.extend(tokens[:100])
    chunked.extend(tokens[100:])
    # Same payload layout as the demo engine (bf16 page per layer, layer order); bf16 rounding
    # of float-close latents may differ in the last bit, so compare as values.
    got = chunked.payloads(64).view(torch.bfloat16).float()
    want = torch.from_numpy(engine.payloads(engine.prefill(tokens), [0, 1, 2]))
    torch.testing.assert_close(got, want.view(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


def test_truncate_then_extend_recomputes_the_same_block() -> None:
    chunked = ChunkedPrefill(TinyMLA(), 128)
    tokens = torch.arange(128) % 256
    chunked.extend(tokens)
    first = chunked.payloads(64).clone()
    chunked.truncate(64)
    assert chunked.length == 64
    chunked.extend(tokens[64:])
    assert torch.equal(chunked.payloads(64), first)


@pytest.mark.slow
@pytest.mark.ray
def test_fleet_quick_writes_contract_json(tmp_path: Path) -> None:
    doc = run_quick("fleet", tmp_path, timeout_s=300)
    rows = {r["name"]: r for r in doc["rows"]}
    block_bytes = Engine(1).block_bytes
    prefix_blocks, agents = 2_048 // 64, 16
    # Every agent's prompt: the shared prefix plus its own block; the tier keeps each once.
    assert rows["fleet_bytes_without_dedup"]["value"] == agents * (prefix_blocks + 1) * block_bytes
    assert rows["fleet_bytes_with_dedup"]["value"] == (prefix_blocks + agents) * block_bytes
    held = rows["fleet_bytes_in_pool_memory"]["value"]
    assert rows["fleet_bytes_with_dedup"]["value"] <= held
    assert held < rows["fleet_bytes_without_dedup"]["value"]
    for name in ("reuse_block_vs_recompute", "reuse_prefix_vs_recompute"):
        assert rows[name]["ratio"] is not None and rows[name]["ratio"] > 0
