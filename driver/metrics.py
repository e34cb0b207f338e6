"""Prometheus metrics, in a registry of the plugin's own (no process-global state).

Counters and histograms are updated where things happen; gauges that mirror state
(prepared claims, published devices, device health) are read at scrape time. The
per-device series are written by driver/monitoring/devicemetrics.py and added to the registry's
exposition (`Metrics.exposition`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from driver import __version__

PREFIX = "dra_driver"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _StateCollector(Collector):
    def __init__(self, prepared: Callable[[], int], devices: Callable[[], dict[str, int]],
                 health: Callable[[], dict[tuple[str, str], int]],
                 nics_withheld: Callable[[], int] = lambda: 0) -> None:
        self.prepared = prepared
        self.devices = devices
        self.health = health
        self.nics_withheld = nics_withheld

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(f"{PREFIX}_prepared_claims", "Claims prepared on this node",
                                value=self.prepared())
        published = GaugeMetricFamily(f"{PREFIX}_published_devices",
                                      "Devices in this node's ResourceSlices", labels=["kind"])
        for kind, count in sorted(self.devices().items()):
            published.add_metric([kind], count)
        yield published
        health = GaugeMetricFamily(f"{PREFIX}_device_health", "Devices by kind and health",
                                   labels=["kind", "status"])
        for (kind, status), count in sorted(self.health().items()):
            health.add_metric([kind, status], count)
        yield health
        yield GaugeMetricFamily(f"{PREFIX}_nics_withheld_routing_unknown",
                                "NICs not published because the routing table cannot be read",
                                value=self.nics_withheld())


class Series(Protocol):
    """Series rendered at each scrape in the text format (driver/monitoring/devicemetrics.py's
    per-device series): kept out of the registry, which would build them as objects."""

    def render(self) -> bytes: ...


class Metrics:
    def __init__(self, driver: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.driver = driver
        self.devices: Series | None = None
        self.requests = Counter(f"{PREFIX}_requests", "Kubelet DRA requests",
                                ["method", "api"], registry=self.registry)
        self.claim_errors = Counter(f"{PREFIX}_claim_errors", "Claims that failed to (un)prepare",
                                    ["method", "api"], registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds", "Kubelet DRA request latency",
                                 ["method", "api"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.publish_writes = Counter(f"{PREFIX}_publish_writes", "ResourceSlice writes",
                                      registry=self.registry)
        self.publish_failures = Counter(f"{PREFIX}_publish_failures", "Failed reconcile passes",
                                        registry=self.registry)
        self.status_write_failures = Counter(f"{PREFIX}_claim_status_write_failures",
                                             "Failed writes of ResourceClaim status.devices (retried)",
                                             registry=self.registry)
        # The runtime waits for these answers before it starts the pod, and drops the
        # plugin when one takes longer than its request timeout (2 s by default).
        self.nri_events = Histogram(f"{PREFIX}_nri_event_duration_seconds",
                                    "Time to answer the container runtime's NRI pod sandbox events",
                                    ["event"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.nri_event_errors = Counter(f"{PREFIX}_nri_event_errors",
                                        "NRI events answered with an error (the pod's sandbox "
                                        "fails; the kubelet retries it)",
                                        ["event"], registry=self.registry)
        info = Gauge(f"{PREFIX}_build_info", "Build information", ["version", "driver"],
                     registry=self.registry)
        info.labels(__version__, driver).set(1)

    def watch_state(self, prepared, devices, health, nics_withheld=lambda: 0) -> None:
        self.registry.register(_StateCollector(prepared, devices, health, nics_withheld))

    def watch_utilization(self, series: Series) -> None:
        self.devices = series

    def exposition(self) -> bytes:
        """What /metrics serves: the registry in the text format, then the per-device series."""
        text = generate_latest(self.registry)
        return text + self.devices.render() if self.devices is not None else text
