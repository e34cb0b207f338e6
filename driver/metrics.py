"""Prometheus metrics, in a registry of the plugin's own (no process-global state).

Counters and histograms are updated where things happen; gauges that mirror state
(prepared claims, published devices, device health) are read at scrape time.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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


DEVICE_LABELS = ["device", "kind", "claim_namespace", "claim_name", "claim_uid", "share"]


class _UtilizationCollector(Collector):
    """Per-device series labelled with the claims that hold the device (driver/utilization/):
    one series per (device, claim), or one with empty claim labels while nobody holds it.
    A device has at most its current claims, and a claim's series go with the claim."""

    def __init__(self, views: Callable[[], Iterable]) -> None:
        self.views = views

    def collect(self) -> Iterable[GaugeMetricFamily]:
        def family(name: str, doc: str, counter: bool = False):
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            return kind(f"{PREFIX}_device_{name}", doc, labels=DEVICE_LABELS)

        allocated = family("allocated", "1 for each claim that holds the device (admin-access "
                                        "claims included), 0 while none does")
        utilization = family("utilization_ratio", "SM utilization since the previous sample, 0..1")
        peak = family("utilization_peak_ratio", "highest single NVML sample since the previous one")
        used = family("memory_used_bytes", "device memory in use")
        total = family("memory_total_bytes", "device memory")
        power = family("power_watts", "board power draw")
        processes = family("compute_processes", "compute processes on the device")
        idle = family("idle_seconds", "how long the claim has left the device idle, continuously "
                                      "(0 while busy; admin-access claims: always 0)")
        rx = family("network_receive_bytes", "bytes received by the NIC", counter=True)
        tx = family("network_transmit_bytes", "bytes sent by the NIC", counter=True)
        for view in self.views():
            sample = view.sample
            owners = view.holders or (None,)
            for holder in owners:
                labels = [sample.device, sample.kind.value,
                          holder.namespace if holder else "", holder.name if holder else "",
                          holder.uid if holder else "", (holder.share or "") if holder else ""]
                allocated.add_metric(labels, 1 if holder else 0)
                for target, value in ((utilization, sample.utilization), (peak, sample.peak),
                                      (used, sample.memory_used), (total, sample.memory_total),
                                      (power, sample.power_watts), (processes, sample.processes),
                                      (rx, sample.rx_bytes), (tx, sample.tx_bytes)):
                    if value is not None:
                        target.add_metric(labels, value)
                if holder is not None and sample.kind.value in ("gpu", "mig"):
                    idle.add_metric(labels, round(view.idle_seconds.get(holder.uid, 0.0), 3))
        yield from (allocated, utilization, peak, used, total, power, processes, idle, rx, tx)


class Metrics:
    def __init__(self, driver: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        info = Gauge(f"{PREFIX}_build_info", "Build information", ["version", "driver"],
                     registry=self.registry)
        info.labels(__version__, driver).set(1)

    def watch_state(self, prepared, devices, health, nics_withheld=lambda: 0) -> None:
        self.registry.register(_StateCollector(prepared, devices, health, nics_withheld))

    def watch_utilization(self, views: Callable[[], Iterable]) -> None:
        self.registry.register(_UtilizationCollector(views))
