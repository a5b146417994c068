"""The Grafana dashboard and the Prometheus alert rules name only declared metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tessera_ray.metrics import RAY_PREFIX, exported_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_METRIC = re.compile(r"\b(?:ray_)?tessera_[a-z0-9_]+")


def names_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def check(exprs: list[str]) -> None:
    assert exprs
    for expr in exprs:
        found = names_in(expr)
        assert found, expr
        # Dashboards read Ray nodes' endpoints, where every name carries Ray's prefix.
        assert all(n.startswith(RAY_PREFIX) for n in found), expr
        assert found <= exported_names(ray=True), (expr, found - exported_names(ray=True))


def test_grafana_dashboard_uses_declared_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "tessera.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    check(exprs)
    used = set().union(*map(names_in, exprs))
    assert "ray_tessera_dedup_collisions_total" in used
    assert "ray_tessera_disk_quarantines_total" in used


def test_alert_rules_cover_collisions_quarantines_and_pool_down() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    by_name = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    check(list(by_name.values()))
    assert "ray_tessera_dedup_collisions_total" in by_name["TesseraDedupCollision"]
    assert "> 0" in by_name["TesseraDedupCollision"]
    assert "ray_tessera_disk_quarantines_total" in by_name["TesseraDiskQuarantine"]
    assert "ray_tessera_memory_rotten_blocks_total" in by_name["TesseraMemoryRot"]
    assert "ray_tessera_channel_refused_total" in by_name["TesseraChannelRefused"]
    assert "heartbeat" in by_name["TesseraPoolDown"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert "alerts.yml" in config["rule_files"]
    assert config["scrape_configs"]


def test_names_checker_rejects_an_undeclared_metric() -> None:
    assert "ray_tessera_made_up_total" not in exported_names(ray=True)
    assert names_in("rate(ray_tessera_made_up_total[5m])") == {"ray_tessera_made_up_total"}
