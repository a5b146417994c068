"""metrics.py outside Ray: prometheus_client served on loopback, checked names and tags,
cumulative totals turned into counter steps, no Ray import."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera_ray.errors import MetricsError
from tessera_ray.metrics import Metrics, PrometheusBackend, exported_names


def test_prometheus_backend_serves_declared_metrics_on_loopback() -> None:
    backend = PrometheusBackend()
    m = Metrics(backend)
    tags = {"ray_namespace": "t", "pool": "p0", "node": "n0"}
    m.set_total("tessera_dedup_collisions", 3, tags)
    m.set_total("tessera_dedup_collisions", 5, tags)  # +2
    m.set_total("tessera_dedup_collisions", 5, tags)  # +0
    m.observe("tessera_transfer_latency_seconds", 0.002, tags)
    port = backend.serve(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["tessera_dedup_collisions_total"] == 5
    assert samples["tessera_transfer_latency_seconds_count"] == 1
    # prometheus_client adds a *_created timestamp per series; dashboards never use it.
    names = {n for n in samples if n.startswith("tessera_") and not n.endswith("_created")}
    assert names <= exported_names()


def test_undeclared_metric_or_wrong_tags_raise() -> None:
    m = Metrics(PrometheusBackend())
    with pytest.raises(MetricsError, match="not declared"):
        m.inc("tessera_made_up", 1, {})
    with pytest.raises(MetricsError, match="takes tags"):
        m.set("tessera_pages_used", 1, {"pool": "p"})
    with pytest.raises(MetricsError, match="is a counter"):
        m.set("tessera_dedup_hits", 1, {"ray_namespace": "t", "pool": "p", "node": "n"})


def test_importing_metrics_does_not_import_ray() -> None:
    code = "import sys, tessera_ray.metrics; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
