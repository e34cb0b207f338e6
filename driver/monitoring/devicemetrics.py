"""Per-device series (driver/monitoring/utilization/) in the Prometheus text format, written here
rather than by prometheus_client.

A node of 2,048 VFs has ~6,100 such series, six labels each. prometheus_client checks
and escapes every label of every sample on every scrape: ~50 ms of CPU a scrape, more
than the idle driver spends in a minute at a 15 s scrape interval. The label sets do
not change between scrapes (a device and the claim that holds it), so each is formatted
once and kept while the series exists; a scrape formats only the values.

Labels: our own (`device`, `kind`, `claim_*`, `share`), and the ones dcgm-exporter puts
on its series, so that a query can join ours with its (`on(UUID, GPU_I_ID) group_right`:
one GPU, several claims): `UUID` is the GPU's, for a MIG device its parent GPU's, with the
GPU instance in `GPU_I_ID`, as dcgm-exporter labels MIG series. The `dra_*` labels are
those dcgm-exporter takes from the kubelet's pod-resources API, but only for devices of the
driver gpu.nvidia.com, so they never join this driver's GPUs (docs/utilization.md). A label
with no value (a NIC's UUID) is left out of a series, as Prometheus treats it.

`rows(views)` says what the series are; `DeviceSeries.render()` writes them the way
prometheus_client's `generate_latest` does (label names sorted, label values escaped,
numbers formatted by the library's own `floatToGoString`), which tests/test_utilization.py
checks byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from prometheus_client.utils import floatToGoString

PREFIX = "dra_driver_device"
LABELS = ("device", "kind", "claim_namespace", "claim_name", "claim_uid", "share",
          "UUID", "GPU_I_ID", "dra_driver_name", "dra_pool_name", "dra_device_name",
          "dra_claim_namespace", "dra_claim_name")


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a dict key per row
class Family:
    name: str  # without the prefix; a counter's samples add `_total`
    help: str
    counter: bool = False


ALLOCATED = Family("allocated", "1 for each claim that holds the device (admin-access claims "
                                "included), 0 while none does")
# NVML's "GPU utilization" is the share of time during which one or more kernels ran on
# the GPU, not how much of the SMs they used: one thread busy all the time reads 100 %.
KERNEL = Family("kernel_active_ratio", "share of the time one or more kernels ran on the GPU "
                                       "since the previous sample, 0..1 (NVML's GPU utilization; "
                                       "not SM activity or occupancy)")
KERNEL_PEAK = Family("kernel_active_peak_ratio", "highest single NVML sample of that share "
                                                 "since the previous sample, 0..1")
# The old names, kept for one release so that dashboards and alerts keep working while
# they move (docs/utilization.md marks them deprecated): they said "SM utilization".
UTILIZATION = Family("utilization_ratio", "DEPRECATED: use dra_driver_device_kernel_active_ratio "
                                          "(the same value; it never was SM utilization)")
PEAK = Family("utilization_peak_ratio", "DEPRECATED: use dra_driver_device_kernel_active_peak_ratio")
MEMORY_USED = Family("memory_used_bytes", "device memory in use")
MEMORY_TOTAL = Family("memory_total_bytes", "device memory")
POWER = Family("power_watts", "board power draw")
PROCESSES = Family("compute_processes", "compute processes on the device")
IDLE = Family("idle_seconds", "how long the claim has left the device idle, continuously "
                              "(0 while busy; admin-access claims: always 0)")
RECEIVED = Family("network_receive_bytes", "bytes received by the NIC", counter=True)
SENT = Family("network_transmit_bytes", "bytes sent by the NIC", counter=True)
FAMILIES = (ALLOCATED, KERNEL, KERNEL_PEAK, MEMORY_USED, MEMORY_TOTAL, POWER, PROCESSES, IDLE,
            RECEIVED, SENT, UTILIZATION, PEAK)

Row = tuple[Family, tuple[str, ...], float]  # (family, label values in LABELS order, value)


def rows(views: Iterable, driver: str = "") -> Iterator[Row]:
    """One series per (device, claim that holds it), or one with empty claim labels while
    nobody holds the device. A device has at most its current claims, and a claim's
    series go with the claim."""
    for view in views:
        sample = view.sample
        ids = (getattr(view, "uuid", ""), getattr(view, "gpu_instance", ""), driver,
               getattr(view, "pool", ""), sample.device)
        for holder in view.holders or (None,):
            namespace, name = (holder.namespace, holder.name) if holder else ("", "")
            labels = (sample.device, sample.kind.value, namespace, name,
                      holder.uid if holder else "", (holder.share or "") if holder else "",
                      *ids, namespace, name)
            yield ALLOCATED, labels, 1 if holder else 0
            for family, value in ((KERNEL, sample.utilization), (KERNEL_PEAK, sample.peak),
                                  (MEMORY_USED, sample.memory_used), (MEMORY_TOTAL, sample.memory_total),
                                  (POWER, sample.power_watts), (PROCESSES, sample.processes),
                                  (RECEIVED, sample.rx_bytes), (SENT, sample.tx_bytes),
                                  (UTILIZATION, sample.utilization), (PEAK, sample.peak)):
                if value is not None:
                    yield family, labels, value
            if holder is not None and sample.kind.value in ("gpu", "mig"):
                yield IDLE, labels, round(view.idle_seconds.get(holder.uid, 0.0), 3)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


_ORDER = sorted(range(len(LABELS)), key=lambda i: LABELS[i])  # the exposition sorts label names


def _label_text(labels: tuple[str, ...]) -> str:
    return "{" + ",".join(f'{LABELS[i]}="{_escape(labels[i])}"' for i in _ORDER) + "}"


class DeviceSeries:
    """Renders the series of `views()` at each scrape, keeping each label set's text for
    as long as a scrape still has that series."""

    def __init__(self, views, driver: str = "") -> None:
        self.views = views
        self.driver = driver  # dra_driver_name
        self._labels: dict[tuple[str, ...], str] = {}

    def render(self) -> bytes:
        lines: dict[Family, list[str]] = {family: [] for family in FAMILIES}
        known, kept = self._labels, {}
        for family, labels, value in rows(self.views(), self.driver):
            text = kept.get(labels)
            if text is None:
                text = known.get(labels) or _label_text(labels)
                kept[labels] = text
            lines[family].append(f"{text} {floatToGoString(value)}\n")
        self._labels = kept  # label sets of series gone are forgotten
        out = []
        for family in FAMILIES:
            name = f"{PREFIX}_{family.name}" + ("_total" if family.counter else "")
            text = family.help.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {name} {text}\n# TYPE {name} {'counter' if family.counter else 'gauge'}\n")
            out.extend(name + line for line in lines[family])
        return "".join(out).encode()
