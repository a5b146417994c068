"""A short demo run on the shared test cluster: the report's invariants hold, and the CLI
writes its JSON report and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera_ray.demo import DemoConfig, plot_report, render_summary, run_demo
from tessera_ray.demo.report import FAMILIES_LINE
from tessera_ray.demo.workload import Fleet
from tests.conftest import SimCluster

CONFIG = DemoConfig(
    num_agents=4,
    num_rounds=2,
    num_blocks_per_pool=12,
    parity_every=1,
    ray_namespace="tessera-test-demo",
)


def test_fleet_prompts_share_exactly_the_intended_prefixes() -> None:
    fleet = Fleet(CONFIG, vocab_size=256, block_tokens=64, num_pools=3)
    reqs = fleet.requests()
    assert len(reqs) == 8
    a0, a3 = reqs[0].tokens, reqs[3].tokens  # agents 0 and 3 read document 0
    shared = (CONFIG.system_blocks + CONFIG.document_blocks) * 64
    assert a0[:shared].equal(a3[:shared]) and not a0[shared : shared + 64].equal(
        a3[shared : shared + 64]
    )
    assert reqs[4].tokens.numel() == a0.numel() + 64  # round 1 adds a question block
    assert {r.pool_index for r in reqs} == {0, 1, 2}


@pytest.mark.ray
def test_short_demo_report_invariants(tessera_cluster: SimCluster, tmp_path: Path) -> None:
    report = run_demo(CONFIG, progress=False, pools_on=tessera_cluster.node_ids[:1])
    t = report.totals()
    assert t["requests"] == 8
    assert t["blocks_stored"] <= t["blocks_without_dedup"]
    assert t["blocks_stored"] < t["blocks_without_dedup"]  # the shared prefix is reused
    assert t["collisions"] == 0
    assert t["parity_checks"] > 0 and t["parity_passed"] == t["parity_checks"]
    assert t["tokens_served"] + t["tokens_computed"] == t["tokens_requested"]
    assert t["tokens_served"] > 0 and t["tokens_served_remote"] > 0
    assert t["bytes_saved"] == (t["blocks_without_dedup"] - t["blocks_stored"]) * 147_456
    for r in report.requests:
        assert r.tokens_served + r.tokens_computed == r.tokens_requested
    summary = render_summary(report)
    assert "tokens served from the tier" in summary and "decode parity" in summary
    # It says which model families the tier serves through vLLM, as the README does.
    assert summary.endswith(FAMILIES_LINE) and "Qwen2" in FAMILIES_LINE
    out = tmp_path / "r.json"
    report.write_json(out)
    doc = json.loads(out.read_text())
    assert doc["totals"] == t and len(doc["requests"]) == 8
    plot_report(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(report.pools) == 3


def test_demo_cli_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from tessera_ray.cli import main

    assert main(["demo", "--agents", "0"]) == 2
    assert "num_agents must be a positive integer" in capsys.readouterr().err
