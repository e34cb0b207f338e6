"""What each device is doing now: GPUs and MIG devices from NVML (every tick of the
monitor), NICs' counters from sysfs (when metrics are scraped), or all at once (`status`).

GPUs: NVML's GPU utilization (the share of time one or more kernels ran, not how much of
the SMs they used) from its sample buffer (`nvmlDeviceGetSamples`, every sample the
driver took since the last read: a 2 s burst between two 10 s reads is seen), falling back
to `nvmlDeviceGetUtilizationRates` (the last sample period only); memory used and total;
power; the number of compute processes. A GPU in MIG mode and its MIG devices have no
utilization counter in NVML (NOT_SUPPORTED): a MIG device reports memory and processes,
and idle is judged by its processes (driver/monitoring/utilization/idle.py). NICs: rx/tx bytes from
sysfs statistics. FPGAs have no cheap activity counter in sysfs: allocation only.

NVML stays initialized while the sampler lives (nvidia-ml-py counts nvmlInit calls, so
discovery's own init/shutdown pairs are unaffected) and handles are looked up once per
UUID. A device that errors gets an empty sample and one log line per kind of error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import structlog

from driver.devices import sysread
from driver.devices.model import Device, DeviceKind, Inventory

_GPU_KINDS = (DeviceKind.GPU, DeviceKind.MIG)


@dataclass(frozen=True)
class Sample:
    device: str
    kind: DeviceKind
    at: float  # unix seconds
    # NVML's GPU utilization: the share of time a kernel ran, mean since the last sample, 0..1
    utilization: float | None = None
    peak: float | None = None  # the highest single sample in that time, 0..1
    memory_used: int | None = None  # bytes
    memory_total: int | None = None
    power_watts: float | None = None
    processes: int | None = None  # compute processes
    rx_bytes: int | None = None  # NICs: counters since the interface came up
    tx_bytes: int | None = None


class Sampler:
    def __init__(self, nvml: Any | None, sysfs: Path, inventory: Callable[[], Inventory],
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml
        self.sysfs = sysfs
        self.inventory = inventory
        self.clock = clock
        self._initialized = False
        self._handles: dict[str, Any] = {}
        self._last_seen: dict[str, int] = {}  # uuid -> newest sample timestamp read (µs)
        # NIC name -> its rx_bytes and tx_bytes paths, and those files kept open
        # (see driver/devices/sysread.py)
        self._counters = sysread.PerInventory(lambda i: (self._counter_paths(i), sysread.HeldFiles()),
                                              retire=lambda c: c[1].close())
        self._counters_lock = threading.Lock()
        self._closed = False  # a scrape after close reads without keeping files open
        self._said: set[tuple[str, str]] = set()
        self.log = structlog.get_logger(component="utilization")

    def sample(self) -> dict[str, Sample]:
        """Every device now: GPUs' and MIG devices' activity, NICs' counters, and an
        allocation-only sample of the rest (`dra-driver status`)."""
        now = self.clock()
        return self.completed(self.activity(now), now)

    def completed(self, activity: dict[str, Sample], now: float) -> dict[str, Sample]:
        """`activity` (the GPUs' samples) and every other device of the inventory: a NIC
        with its counters read now, the rest allocation-only."""
        out = dict(activity)
        counters = self.counters()
        for device in self.inventory().devices:
            if device.name in counters:
                rx, tx = counters[device.name]
                out[device.name] = Sample(device.name, device.kind, now, rx_bytes=rx, tx_bytes=tx)
            elif device.name not in out and device.kind is not DeviceKind.NIC:
                out[device.name] = Sample(device.name, device.kind, now)
        return out

    def activity(self, now: float | None = None) -> dict[str, Sample]:
        """The GPUs and MIG devices, what idle detection judges (NVML)."""
        now = self.clock() if now is None else now
        gpus = [d for d in self.inventory().devices
                if d.kind in _GPU_KINDS and d.attributes.get("uuid")]
        if not gpus or not self._init():
            return {}
        return {device.name: self._gpu(device, now) for device in gpus}

    def counters(self) -> dict[str, tuple[int | None, int | None]]:
        """Each NIC's (rx_bytes, tx_bytes) now. Called by metrics scrapes, on their own
        threads, as well as by `sample`: the lock keeps two callers from each opening the
        inventory's files."""
        with self._counters_lock:
            if self._closed:
                paths, files = self._counter_paths(self.inventory()), sysread.HeldFiles(limit=0)
            else:
                paths, files = self._counters.of(self.inventory())
        return {name: (_counter(files, rx), _counter(files, tx)) for name, (rx, tx) in paths.items()}

    def close(self) -> None:
        with self._counters_lock:
            self._closed = True
            self._counters.clear()  # the counter files it keeps open
        if self._initialized:
            self._initialized = False
            self._handles.clear()
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass

    # -- GPUs and MIG devices ----------------------------------------------------------------
    def _init(self) -> bool:
        if self._initialized:
            return True
        if self.nvml is None:
            return False
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as err:
            self._say("nvml", "nvml_unavailable", str(err))
            return False
        self._initialized = True
        return True

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._handles[uuid] = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
        return handle

    def _gpu(self, device: Device, now: float) -> Sample:
        nv = self.nvml
        uuid = str(device.attributes["uuid"])
        try:
            handle = self._handle(uuid)
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            utilization = peak = power = None
            if device.kind is DeviceKind.GPU:
                utilization, peak = self._utilization(handle, uuid)
                watts = self._optional(device, nv.nvmlDeviceGetPowerUsage, handle)
                power = watts / 1000.0 if watts is not None else None
            processes = self._optional(device, nv.nvmlDeviceGetComputeRunningProcesses, handle)
            return Sample(device.name, device.kind, now, utilization, peak, int(memory.used),
                          int(memory.total), power,
                          len(processes) if processes is not None else None)
        except nv.NVMLError as err:
            # A stale handle (the GPU was reset, a MIG device re-created) is looked up again.
            self._handles.pop(uuid, None)
            self._say(device.name, "device_sample_failed", f"{type(err).__name__}: {err}")
            return Sample(device.name, device.kind, now)

    def _optional(self, device: Device, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_FunctionNotFound) as err:
            self._say(device.name, "device_counter_unavailable", f"{fn.__name__}: {type(err).__name__}")
            return None

    def _utilization(self, handle: Any, uuid: str) -> tuple[float | None, float | None]:
        nv = self.nvml
        try:
            _, samples = nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES,
                                                 self._last_seen.get(uuid, 0))
        except nv.NVMLError_NotSupported:
            return None, None  # a GPU in MIG mode
        except (nv.NVMLError_NotFound, nv.NVMLError_FunctionNotFound):
            samples = []  # nothing new since the last read, or an NVML without samples
        if samples:
            values = [s.sampleValue.uiVal for s in samples]
            self._last_seen[uuid] = max(s.timeStamp for s in samples)
            return sum(values) / len(values) / 100.0, max(values) / 100.0
        try:
            rate = nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return None, None
        return rate, rate

    # -- NICs --------------------------------------------------------------------------------
    def _counter_paths(self, inventory: Inventory) -> dict[str, tuple[str, str]]:
        paths = {}
        for device in inventory.devices:
            if device.kind is DeviceKind.NIC and device.attributes.get("ifName"):
                statistics = f"{self.sysfs}/class/net/{device.attributes['ifName']}/statistics"
                paths[device.name] = (f"{statistics}/rx_bytes", f"{statistics}/tx_bytes")
        return paths

    def _say(self, device: str, event: str, error: str) -> None:
        if (device, error) not in self._said:
            self._said.add((device, error))
            self.log.warning(event, device=device, error=error)


def _counter(files: sysread.HeldFiles, path: str) -> int | None:
    raw = files.read(path, 32)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
