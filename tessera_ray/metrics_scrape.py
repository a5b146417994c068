"""Reading tessera metrics back from Prometheus endpoints, as an operator's scraper would: the
demo's report of the router's choices and the metrics tests use it. No Ray here; the caller
finds the endpoints (each Ray node's ``MetricsExportPort``).
"""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

from tessera_ray.metrics import RAY_PREFIX

__all__ = ["Samples", "scrape", "scrape_until", "total"]

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name -> every (labels, value) of it, over all endpoints scraped."""


def scrape(ports: Iterable[int], host: str = "127.0.0.1") -> Samples:
    """Every sample served at ``http://host:port/metrics`` for each port."""
    out: Samples = defaultdict(list)
    for port in ports:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name].append((dict(s.labels), float(s.value)))
    return out


def total(samples: Samples, name: str, *, ray: bool = True, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; ``None`` when there is
    none. ``ray``: the name as Ray's metrics agent serves it (``ray_`` in front)."""
    found = [
        v
        for lab, v in samples.get(RAY_PREFIX + name if ray else name, [])
        if all(lab.get(k) == w for k, w in labels.items())
    ]
    return sum(found) if found else None


def scrape_until(
    ports: Iterable[int], ready: Callable[[Samples], bool], deadline_s: float
) -> Samples:
    """Scrape until ``ready`` says everything expected has arrived, or ``deadline_s`` passed
    (Ray ships recorded values to its node's agent on its own schedule, seconds later)."""
    ports = list(ports)
    deadline = time.monotonic() + deadline_s
    samples = scrape(ports)
    while not ready(samples) and time.monotonic() < deadline:
        time.sleep(0.5)
        samples = scrape(ports)
    return samples
