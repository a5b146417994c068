"""Every tessera-ray metric, declared once.

One table (:data:`METRICS`) names each metric, its kind, description, fixed tag keys and (for
histograms) bucket boundaries. Two backends record them, chosen at runtime:

- inside a Ray worker or actor: ``ray.util.metrics``, so the values reach every node's
  Prometheus endpoint (``metrics_export_port``) and the Ray dashboard;
- anywhere else: ``prometheus_client`` with its own registry, served on 127.0.0.1 only when
  :func:`serve_prometheus` is called.

Exported names (both backends agree): counters gain ``_total`` (``tessera_dedup_collisions`` ->
``tessera_dedup_collisions_total``), histograms export ``_bucket`` / ``_sum`` / ``_count``,
gauges keep their name. Ray's metrics agent also puts its namespace in front
(:data:`RAY_PREFIX`, measured on ray 2.60: ``ray_tessera_dedup_collisions_total``) and adds its
own tags (``SessionName``, ``NodeAddress``, ...) beside ours. :func:`exported_names` lists the
names either way; the deploy/ dashboards and alert rules use the Ray form (a test pins them).

Ray is imported lazily inside the Ray backend so that ``core`` and ``layout`` stay Ray-free.
"""

from __future__ import annotations

import enum
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera_ray.errors import MetricsError

__all__ = [
    "MetricKind",
    "MetricSpec",
    "METRICS",
    "SPECS",
    "MetricsBackend",
    "PrometheusBackend",
    "RayBackend",
    "Metrics",
    "get_metrics",
    "serve_prometheus",
    "declared_names",
    "exported_names",
    "RAY_PREFIX",
]

RAY_PREFIX = "ray_"
"""What Ray's metrics agent prepends to every metric it serves (its Prometheus namespace)."""

_NAME_RE = re.compile(r"tessera_[a-z0-9_]+")
_TAG_RE = re.compile(r"[a-z][a-z0-9_]*")


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric: a Prometheus-valid name without the ``_total`` suffix counters gain."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name) or self.name.endswith("_total"):
            raise MetricsError(f"metric name {self.name!r}: tessera_[a-z0-9_]+, no _total suffix")
        if any(not _TAG_RE.fullmatch(t) for t in self.tag_keys):
            raise MetricsError(f"metric {self.name!r}: tag keys must be [a-z][a-z0-9_]*")
        if (self.kind is MetricKind.HISTOGRAM) != bool(self.buckets):
            raise MetricsError(f"metric {self.name!r}: buckets are for histograms only")

    @property
    def exported(self) -> tuple[str, ...]:
        """The sample names Prometheus sees."""
        if self.kind is MetricKind.COUNTER:
            return (f"{self.name}_total",)
        if self.kind is MetricKind.HISTOGRAM:
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)


# ray_namespace: several tiers may share one Ray cluster, and their pool and shard names repeat.
_POOL = ("ray_namespace", "pool", "node")
_TIER = (*_POOL, "tier")
_SHARD = ("ray_namespace", "shard")
# Routers: per Serve deployment, and (requests) the reason of the choice (routing.RouteReason).
_ROUTE = ("ray_namespace", "deployment", "reason")
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM
# Transfers on one machine take ~0.1 ms (in-process) to seconds (cross-node, large batches).
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="tessera_pages_used", kind=_G, tag_keys=_TIER,
               description="Pages in use per tier (memory: not on the free list; disk: stored)"),
    MetricSpec(name="tessera_pages_free", kind=_G, tag_keys=_TIER,
               description="Pages free per tier (disk: room left under the capacity)"),
    MetricSpec(name="tessera_blocks", kind=_G, tag_keys=_TIER,
               description="Token blocks the pool can serve, per tier"),
    MetricSpec(name="tessera_bytes_stored", kind=_G, tag_keys=_TIER,
               description="Bytes of blocks held, per tier"),
    MetricSpec(name="tessera_pool_heartbeat_timestamp_seconds", kind=_G, tag_keys=_POOL,
               description="Wall clock of the pool's last metrics export (stale: pool down)"),
    MetricSpec(name="tessera_dedup_hits", kind=_C, tag_keys=_POOL,
               description="Pages sealed onto an existing page with equal bytes"),
    MetricSpec(name="tessera_dedup_bytes_saved", kind=_C, tag_keys=_POOL,
               description="Bytes a copy per sealed page would have taken"),
    MetricSpec(name="tessera_dedup_collisions", kind=_C, tag_keys=_POOL,
               description="Pages whose content hash matched stored pages with other bytes "
               "(security signal)"),
    MetricSpec(name="tessera_evictions", kind=_C, tag_keys=_POOL,
               description="Pages evicted from memory"),
    MetricSpec(name="tessera_blocks_spilled", kind=_C, tag_keys=_POOL,
               description="Blocks moved to the disk tier (their last copy)"),
    MetricSpec(name="tessera_blocks_lost", kind=_C, tag_keys=_POOL,
               description="Last copies evicted with no disk tier to take them"),
    MetricSpec(name="tessera_disk_quarantines", kind=_C, tag_keys=_POOL,
               description="Disk records that failed verification and were quarantined "
               "(data-integrity signal)"),
    MetricSpec(name="tessera_memory_rotten_blocks", kind=_C, tag_keys=_POOL,
               description="Blocks dropped from a pool's memory because their bytes no longer "
               "matched their seal when a consumer had them checked (data-integrity signal)"),
    MetricSpec(name="tessera_channel_pins", kind=_C, tag_keys=_POOL,
               description="Pins a pool served to readers on its direct pin channel (the rest "
               "came as Ray actor calls)"),
    MetricSpec(name="tessera_channel_refused", kind=_C, tag_keys=_POOL,
               description="Connections to a pool's pin channel dropped for a wrong secret or "
               "a malformed frame (security signal)"),
    MetricSpec(name="tessera_transfer_bytes", kind=_C, tag_keys=_POOL,
               description="Bytes of blocks pulled from other pools and installed"),
    MetricSpec(name="tessera_transfer_mapped_bytes", kind=_C, tag_keys=_POOL,
               description="Bytes of pages read out of a same-node pool's mapped memory "
               "(the rest of the transfers went over the transport's backend)"),
    MetricSpec(name="tessera_transfer_latency_seconds", kind=_H, tag_keys=_POOL,
               buckets=_LATENCY_BUCKETS,
               description="Duration of one fetch from another pool (pin to install)"),
    MetricSpec(name="tessera_transfer_errors", kind=_C, tag_keys=_POOL,
               description="Blocks a fetch from another pool did not install"),
    MetricSpec(name="tessera_transport_fallbacks", kind=_C,
               tag_keys=(*_POOL, "from_kind", "to_kind", "reason"),
               description="Times the wanted transport was unavailable and another was used"),
    MetricSpec(name="tessera_directory_lookups", kind=_C, tag_keys=_SHARD,
               description="Token keys looked up in a directory shard"),
    MetricSpec(name="tessera_directory_hits", kind=_C, tag_keys=_SHARD,
               description="Directory lookups that found a block"),
    MetricSpec(name="tessera_directory_misses", kind=_C, tag_keys=_SHARD,
               description="Directory lookups that found nothing"),
    MetricSpec(name="tessera_directory_purged_pools", kind=_C, tag_keys=_SHARD,
               description="Pools a directory shard found dead and purged"),
    MetricSpec(name="tessera_directory_token_keys", kind=_G, tag_keys=_SHARD,
               description="Token keys a directory shard maps"),
    MetricSpec(name="tessera_directory_replicas", kind=_G, tag_keys=_SHARD,
               description="Replicas a directory shard lists"),
    MetricSpec(name="tessera_route_requests", kind=_C, tag_keys=_ROUTE,
               description="Requests a tier-aware router routed, by why it chose the replica"),
    MetricSpec(name="tessera_route_held_blocks", kind=_C, tag_keys=_ROUTE,
               description="Leading tier blocks of each request held by the chosen replica's "
               "pool, summed by why the router chose it (divide by tessera_route_requests)"),
    MetricSpec(name="tessera_route_local_blocks", kind=_H, tag_keys=_ROUTE[:2],
               buckets=_BLOCK_BUCKETS,
               description="Leading tier blocks of a request held by the chosen replica's pool"),
)  # fmt: skip
"""The one table of metrics: each name, kind, help text and label set is defined here once."""

SPECS: dict[str, MetricSpec] = {s.name: s for s in METRICS}


def declared_names() -> frozenset[str]:
    return frozenset(SPECS)


def exported_names(*, ray: bool = False) -> frozenset[str]:
    """Every sample name a scrape can show (counters with ``_total``, histogram series);
    ``ray=True``: as a Ray node's endpoint serves them (with :data:`RAY_PREFIX`)."""
    prefix = RAY_PREFIX if ray else ""
    return frozenset(prefix + n for s in METRICS for n in s.exported)


class MetricsBackend(ABC):
    """Records values of declared metrics; tags are already checked against the spec."""

    @abstractmethod
    def inc(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None: ...

    @abstractmethod
    def set(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None: ...

    @abstractmethod
    def observe(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None: ...


class RayBackend(MetricsBackend):
    """``ray.util.metrics`` objects, made on first use (only in a connected Ray process)."""

    def __init__(self) -> None:
        from ray.util import metrics as ray_metrics

        self._mod = ray_metrics
        self._objs: dict[str, Any] = {}

    def _obj(self, spec: MetricSpec) -> Any:
        obj = self._objs.get(spec.name)
        if obj is None:
            keys = spec.tag_keys
            if spec.kind is MetricKind.COUNTER:
                obj = self._mod.Counter(spec.name, spec.description, keys)
            elif spec.kind is MetricKind.GAUGE:
                obj = self._mod.Gauge(spec.name, spec.description, keys)
            else:
                obj = self._mod.Histogram(spec.name, spec.description, list(spec.buckets), keys)
            self._objs[spec.name] = obj
        return obj

    def inc(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._obj(spec).inc(value, dict(tags))

    def set(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._obj(spec).set(value, dict(tags))

    def observe(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._obj(spec).observe(value, dict(tags))


class PrometheusBackend(MetricsBackend):
    """``prometheus_client`` metrics in a registry of their own (never the global one, so
    several backends can live in one process, e.g. in tests)."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry()
        self._objs: dict[str, Any] = {}
        for spec in METRICS:
            keys = list(spec.tag_keys)
            if spec.kind is MetricKind.COUNTER:
                obj: Any = pc.Counter(spec.name, spec.description, keys, registry=self.registry)
            elif spec.kind is MetricKind.GAUGE:
                obj = pc.Gauge(spec.name, spec.description, keys, registry=self.registry)
            else:
                obj = pc.Histogram(
                    spec.name, spec.description, keys, registry=self.registry,
                    buckets=spec.buckets,
                )  # fmt: skip
            self._objs[spec.name] = obj

    def inc(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._objs[spec.name].labels(**tags).inc(value)

    def set(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._objs[spec.name].labels(**tags).set(value)

    def observe(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._objs[spec.name].labels(**tags).observe(value)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: a free port); returns the port."""
        import prometheus_client as pc

        server, _ = pc.start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)


class Metrics:
    """Checked recording of declared metrics over one backend.

    Snapshots carry cumulative counts (a pool's ``collisions`` since it started), while Ray
    counters only go up by positive steps: :meth:`set_total` turns a cumulative value into the
    increment since the last one seen for the same tags.
    """

    def __init__(self, backend: MetricsBackend) -> None:
        self.backend = backend
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _spec(name: str, kind: MetricKind, tags: Mapping[str, str]) -> MetricSpec:
        spec = SPECS.get(name)
        if spec is None:
            raise MetricsError(f"metric {name!r} is not declared in tessera_ray.metrics.METRICS")
        if spec.kind is not kind:
            raise MetricsError(f"metric {name!r} is a {spec.kind.value}, not a {kind.value}")
        if set(tags) != set(spec.tag_keys):
            raise MetricsError(f"metric {name!r} takes tags {spec.tag_keys}, got {sorted(tags)}")
        return spec

    def inc(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        spec = self._spec(name, MetricKind.COUNTER, tags)
        if value > 0:  # Ray rejects non-positive steps; a zero step changes nothing anyway
            self.backend.inc(spec, value, tags)

    def set(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.backend.set(self._spec(name, MetricKind.GAUGE, tags), value, tags)

    def observe(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.backend.observe(self._spec(name, MetricKind.HISTOGRAM, tags), value, tags)

    def set_total(self, name: str, total: float, tags: Mapping[str, str]) -> None:
        """Advance counter ``name`` to the cumulative ``total`` (a smaller total, from a
        restarted source, becomes the new baseline)."""
        spec = self._spec(name, MetricKind.COUNTER, tags)
        key = (name, tuple(sorted(tags.items())))
        with self._lock:
            last = self._totals.get(key, 0.0)
            self._totals[key] = total
        step = total - last if total >= last else total
        if step > 0:
            self.backend.inc(spec, step, tags)


_lock = threading.Lock()
_metrics: Metrics | None = None


def _in_ray() -> bool:
    # Only a process already connected to Ray uses the Ray backend; importing Ray here just
    # to ask would make every plain process pay for it.
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def get_metrics() -> Metrics:
    """This process's metrics (backend chosen on the first call: Ray when connected)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = Metrics(RayBackend() if _in_ray() else PrometheusBackend())
        return _metrics


def serve_prometheus(port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serve this process's metrics on ``addr:port`` outside Ray; returns the port. Inside Ray
    the node's metrics agent serves them instead (``metrics_export_port``)."""
    backend = get_metrics().backend
    if not isinstance(backend, PrometheusBackend):
        raise MetricsError(
            "this process records metrics through Ray; scrape the node's metrics_export_port"
        )
    return backend.serve(port, addr)
