"""bench_peers.py: the tier's fetch and every peer on the same bytes, one run, quick mode.

The tier's own rows must always be measured. A peer is either measured or says why not; when
this machine can run a peer (installed, and for Mooncake a loopback-only namespace), its rows
must carry values: a harness that silently drops an installed peer fails here.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.benchmarks.contract import ROOT, run_quick

sys.path.insert(0, str(ROOT / "benchmarks"))
import _peers
from common import Row
from render import render

sys.path.pop(0)

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CASES = {"mla256": "72KiB", "16mib": "1MiB"}
PEERS = {"redis": ["redis_get", "redis_set"], "ray": ["ray_get", "ray_put"]}
PEERS["mooncake"] = ["mooncake_batch_get_into", "mooncake_get", "mooncake_put"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("peers")
    out = run_quick("peers", tmp, timeout_s=300)
    out["_dir"] = tmp
    return out


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["rows"]}


def test_tier_rows_are_measured_for_both_cases(doc: dict[str, Any]) -> None:
    rows = _rows(doc)
    for case, size in CASES.items():
        for series in ("tessera_fetch", "raw_nixl_read", "memcpy"):
            assert rows[f"{series}_{size}"]["value"] > 0
        targets = {
            f"fetch_vs_{peer}_{case}": target
            for peer, target in [
                ("mooncake_batch_get_into", 2.0),
                ("redis_get", 2.0),
                ("ray_get", 2.0),
                ("raw_nixl_read", 0.6),
            ]
        }
        for name, target in targets.items():
            row = rows[name]
            assert row["target_ratio"] == target
            assert row["value"] == rows[f"tessera_fetch_{size}"]["value"]


def test_each_peer_is_measured_or_says_why(doc: dict[str, Any]) -> None:
    rows, versions = _rows(doc), doc["versions"]
    can_run = {
        "ray": None,
        "redis": _peers.redis_problem(),
        "mooncake": _peers.mooncake_problem(need_namespace=False) or _peers.namespace_possible(),
    }
    for system, series in PEERS.items():
        missing = versions[system].startswith("not available: ")
        if can_run[system] is None:
            assert not missing, f"{system} can run here but was not measured: {versions[system]}"
        for key in series:
            for size in CASES.values():
                row = rows[f"{key}_{size}"]
                if missing:
                    assert row["value"] is None and row["note"] == versions[system]
                else:
                    assert row["value"] > 0, row
        for case, size in CASES.items():
            read = series[0]
            compared = rows[f"fetch_vs_{read}_{case}"]
            assert (compared["ratio"] is None) == missing
            if not missing:
                assert compared["baseline_value"] == rows[f"{read}_{size}"]["value"]


def test_plots_are_written_and_rendered(doc: dict[str, Any]) -> None:
    assert doc["plots"] == ["peers_read.png", "peers_write.png", "peers_by_system.png"]
    for name in doc["plots"]:
        assert (doc["_dir"] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = render([doc])
    assert "![peers: peers_read.png](benchmarks/results/peers_read.png)" in page
    assert "Systems: " in page and "`python benchmarks/bench_peers.py --quick`" in page


def test_missing_peer_renders_reason_without_value() -> None:
    row = Row.unavailable("redis_get_1MiB", "GB/s", "redis-server not installed").to_json()
    assert row["value"] is None and row["ratio"] is None
    doc = {"benchmark": "b", "machine": {}, "command": "c", "rows": [row]}
    line = next(ln for ln in render([doc]).splitlines() if ln.startswith("| redis_get"))
    assert "| not available: redis-server not installed |" in line
