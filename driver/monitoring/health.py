"""Device health: what is wrong with which device, from NVML events and sysfs probes.

Every condition names a reason (`gpu-xid`, `gpu-lost`, `link-down`, `device-removed`).
A device with any condition is UNHEALTHY; it gets a NoSchedule taint `<driver>/<reason>`
in its ResourceSlice and UNHEALTHY on the kubelet's health stream, and both clear when
the condition does. Sources run in threads; consumers are told through callbacks.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import structlog

from driver.devices import sysread
from driver.devices.model import Device, DeviceKind, Inventory
from driver.devices.net import AwayNetdev

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # application errors, not the GPU
NO_INSTANCE = 0xFFFFFFFF
MESSAGE_MAX = 1024
LOSS_REASONS = frozenset({"gpu-lost", "device-removed"})


@dataclass(frozen=True)
class Condition:
    reason: str
    value: str  # taint value: the XID number, the interface...
    message: str
    since: float  # unix seconds


class HealthState:
    def __init__(self, driver: str, inventory: Callable[[], Inventory]) -> None:
        self.driver = driver
        self.inventory = inventory
        self._conditions: dict[str, dict[str, Condition]] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        # Called when a device is lost or gone, so rediscovery runs now instead of at the
        # next periodic pass.
        self.on_loss: Callable[[], None] | None = None
        self.log = structlog.get_logger(component="health")
        # Set once the first full probe pass is done: until then the conditions are not
        # known, and slices published then would offer unhealthy devices untainted (the
        # publisher waits for it).
        self.probed = threading.Event()

    def mark_probed(self) -> None:
        """The first probe pass is done; listeners hear of it once (a pass that found
        nothing wrong changes no condition, and the publisher waits for this)."""
        if not self.probed.is_set():
            self.probed.set()
            self.log.info("health_first_pass_done", unhealthy=len(self._conditions))
            self._changed()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(listener)
        return lambda: self._unsubscribe(listener)

    def _unsubscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def set(self, device: str, reason: str, value: str, message: str) -> bool:
        with self._lock:
            current = self._conditions.setdefault(device, {})
            old = current.get(reason)
            if old is not None and old.value == value:
                return False
            current[reason] = Condition(reason, value, message[:MESSAGE_MAX], time.time())
        self.log.warning("device_unhealthy", device=device, reason=reason, value=value, detail=message)
        self._changed()
        if reason in LOSS_REASONS and self.on_loss is not None:
            self.on_loss()
        return True

    def clear(self, device: str, reason: str) -> bool:
        if device not in self._conditions:
            # The common case, every device at every probe: nothing to clear, no lock. (A
            # lookup is atomic; a condition set at this moment is set after the lookup.)
            return False
        with self._lock:
            current = self._conditions.get(device, {})
            if current.pop(reason, None) is None:
                return False
            if not current:
                self._conditions.pop(device, None)
        self.log.info("device_recovered", device=device, reason=reason)
        self._changed()
        return True

    def having(self, reason: str) -> set[str]:
        """The devices with a `reason` condition now."""
        with self._lock:
            return {d for d, found in self._conditions.items() if reason in found}

    def conditions(self, device: str) -> dict[str, Condition]:
        with self._lock:
            return dict(self._conditions.get(device, {}))

    def snapshot(self) -> dict[str, list[dict]]:
        """Every condition, for the state directory (`dra-driver status`)."""
        with self._lock:
            return {device: [{"reason": c.reason, "value": c.value, "message": c.message,
                              "since": c.since} for c in sorted(found.values(), key=lambda c: c.reason)]
                    for device, found in sorted(self._conditions.items())}

    def healthy(self, device: str) -> bool:
        return not self.conditions(device)

    def taints(self) -> dict[str, list[dict]]:
        """Slice taints per device; timeAdded is when the condition began, so a republish
        of an unchanged condition writes nothing."""
        with self._lock:
            items = {d: dict(c) for d, c in self._conditions.items()}
        out = {}
        for device, conditions in items.items():
            out[device] = [
                {"key": f"{self.driver}/{c.reason}", "value": _label_value(c.value),
                 "effect": "NoSchedule",
                 "timeAdded": datetime.fromtimestamp(int(c.since), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
                for c in sorted(conditions.values(), key=lambda c: c.reason)
            ][:4]  # the API allows 4 taints per device before 1.35
        return out

    def summary(self) -> dict[tuple[str, str], int]:
        """(kind, HEALTHY|UNHEALTHY) -> count, for metrics."""
        counts: dict[tuple[str, str], int] = {}
        for device in self.inventory().devices:
            key = (device.kind.value, "HEALTHY" if self.healthy(device.name) else "UNHEALTHY")
            counts[key] = counts.get(key, 0) + 1
        return counts

    def forget_missing(self) -> None:
        """Drop conditions of devices no longer in the inventory (unplugged, rediscovered)."""
        names = {d.name for d in self.inventory().devices}
        with self._lock:
            gone = [d for d in self._conditions if d not in names]
            for device in gone:
                del self._conditions[device]
        if gone:
            self._changed()


def _label_value(value: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in value)[:63].strip("-_.")
    return cleaned


class XidWatcher:
    """NVML XID critical-error events -> gpu-xid conditions (MIG-attributed where NVML says)."""

    def __init__(self, nvml: Any, state: HealthState, ignored: frozenset[int],
                 partitions: Callable[[str, int], list[str]] = lambda bus_id, gi: []) -> None:
        self.nvml = nvml
        self.state = state
        self.ignored = ignored
        # Dynamic MIG: the published partition that holds GPU instance `gi` on a GPU (the
        # partition devices carry no instance ids; the MIG records know them).
        self.partitions = partitions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = structlog.get_logger(component="health")
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as err:  # never a silent end of health reporting
            self.log.error("xid_watcher_crashed", error=repr(err))
        finally:
            self.ready.set()

    def _watch(self) -> None:
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            self.log.info("xid_events_unavailable", reason=str(err))
            self.ready.set()
            return
        try:
            event_set = nv.nvmlEventSetCreate()
            # Handle address -> PCI bus id. An event names its device by the same handle
            # address, in a fresh pointer object (identity never matches); and a GPU that
            # fell off the bus right after its XID can no longer be asked for its PCI info.
            bus_ids: dict[int, str] = {}
            for index in range(nv.nvmlDeviceGetCount()):
                try:
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
                    bus_ids[_address(handle)] = _bus_id(nv.nvmlDeviceGetPciInfo(handle).busId)
                except nv.NVMLError as err:
                    self.log.warning("xid_register_failed", gpu_index=index, error=str(err))
            self.ready.set()
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, 500)
                except nv.NVMLError_Timeout:
                    continue
                except nv.NVMLError as err:
                    self.log.warning("xid_wait_failed", error=str(err))
                    self._stop.wait(1)
                    continue
                bus_id = bus_ids.get(_address(data.device))
                if bus_id is None:  # not one we registered: ask NVML
                    try:
                        bus_id = _bus_id(nv.nvmlDeviceGetPciInfo(data.device).busId)
                    except nv.NVMLError as err:
                        self.log.warning("xid_event_unattributed", xid=int(data.eventData), error=str(err))
                        continue
                self.handle(bus_id, data)
            nv.nvmlEventSetFree(event_set)
        finally:
            self.ready.set()
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def handle(self, bus_id: str | None, data: Any) -> None:
        xid = int(data.eventData)
        if bus_id is None:
            return
        if xid in self.ignored:
            self.log.info("xid_ignored", xid=xid, pci_bus_id=bus_id)
            return
        targets = [d for d in self.state.inventory().devices if d.pci and d.pci.bus_id == bus_id
                   and d.kind in (DeviceKind.GPU, DeviceKind.MIG)]
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        if gi != NO_INSTANCE:
            attributed = [d for d in targets if d.kind is DeviceKind.MIG
                          and d.attributes.get("gpuInstanceID") == gi
                          and (ci == NO_INSTANCE or d.attributes.get("computeInstanceID") == ci)]
            if not attributed:
                holders = set(self.partitions(bus_id, gi))
                attributed = [d for d in targets if d.name in holders]
            targets = attributed or targets
        for device in targets:
            self.state.set(device.name, "gpu-xid", str(xid), f"NVML reported critical XID {xid}")


def _address(handle: Any) -> int:
    """The address an NVML device handle points to (ctypes pointers compare by identity)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _bus_id(raw: Any) -> str:
    """NVML's "00000000:17:00.0" (str or bytes) -> sysfs's "0000:17:00.0"."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.lower()[-12:]


# An interface in one of these states (or whose operstate cannot be read) is down.
_DOWN = frozenset({b"down", b"lowerlayerdown", b"missing"})


@dataclass
class _Probing:
    """One inventory's checks, made once when rediscovery replaces it and grouped so that a
    probe works on sets and lists rather than device by device (2,048 VFs on sriov-large):

    - `entries`: what must be in each directory, {directory: {entry: devices needing it}},
      the PCI functions' directory first. A probe lists each directory once.
    - `links`: (device, interface) of each NIC, and `operstate`, the path of its operstate
      file, in the same order; the files are kept open (sysread.HeldFiles).
    """

    entries: dict[str, dict[str, tuple[str, ...]]]
    what: dict[str, str]  # directory -> what a missing entry of it is ("PCI function")
    links: list[tuple[str, str]]
    operstate: list[str]
    gpus: tuple[Device, ...]
    files: sysread.HeldFiles = field(default_factory=sysread.HeldFiles)


@dataclass
class Prober:
    """Periodic checks: GPU lost, NIC link, device gone from sysfs/dev; XID recovery."""

    state: HealthState
    sysfs: Path
    dev: Path
    nvml: Any | None
    xid_recovery_seconds: float = 0.0  # 0: an XID taint stays until the driver restarts
    # NICs whose netdev is in a pod (the move records): the host's sysfs has no operstate
    # of theirs to read, and their link is the pod's business, not a fault of the device.
    away: Callable[[], tuple[AwayNetdev, ...]] = tuple
    _probing: sysread.PerInventory[_Probing] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._probing = sysread.PerInventory(self._probing_of, retire=lambda p: p.files.close())

    def close(self) -> None:
        """Close the files the probe keeps open."""
        self._probing.clear()

    def probe(self) -> None:
        self.state.forget_missing()
        nvml_up = False
        if self.nvml is not None:
            try:
                self.nvml.nvmlInit()
                nvml_up = True
            except self.nvml.NVMLError:
                pass
        try:
            probing = self._probing.of(self.state.inventory())
            gone = self._gone(probing)
            down = self._down(probing, {a.ifname for a in self.away()})
            for name, what in gone.items():
                self.state.set(name, "device-removed", "gone", f"{what} disappeared")
            for name in self.state.having("device-removed") - gone.keys():
                self.state.clear(name, "device-removed")
            # A device that is gone keeps its link condition as it was.
            for name, (ifname, state) in down.items():
                if name not in gone:
                    self.state.set(name, "link-down", ifname, f"interface {ifname} is {state}")
            for name in self.state.having("link-down") - down.keys() - gone.keys():
                self.state.clear(name, "link-down")
            if nvml_up:
                for device in probing.gpus:
                    if device.name not in gone:
                        self._probe_gpu(device)
        finally:
            if nvml_up:
                self.nvml.nvmlShutdown()
            # Even after a failed pass: a probe that fails will not do better for waiting,
            # and publishing must not wait on it forever (health_probe_failed says why).
            self.state.mark_probed()

    def _probing_of(self, inventory: Inventory) -> _Probing:
        sysfs, dev = str(self.sysfs), str(self.dev)
        pci_dir = f"{sysfs}/bus/pci/devices"
        entries: dict[str, dict[str, list[str]]] = {pci_dir: {}}
        what = {pci_dir: "PCI function"}
        links, operstate = [], []
        for d in inventory.devices:
            if d.pci is not None:
                entries[pci_dir].setdefault(d.pci.bus_id, []).append(d.name)
            for node in d.device_nodes:
                directory, entry = sysread.split(f"{dev}/{node.removeprefix('/dev/')}")
                entries.setdefault(directory, {}).setdefault(entry, []).append(d.name)
                what.setdefault(directory, "device node")
            if d.kind is DeviceKind.NIC and d.net_interface:
                links.append((d.name, d.net_interface))
                operstate.append(f"{sysfs}/class/net/{d.net_interface}/operstate")
        return _Probing({directory: {entry: tuple(names) for entry, names in wanted.items()}
                         for directory, wanted in entries.items()}, what, links, operstate,
                        tuple(d for d in inventory.devices if d.kind in (DeviceKind.GPU, DeviceKind.MIG)))

    @staticmethod
    def _gone(probing: _Probing) -> dict[str, str]:
        """Devices whose PCI function or a device node is not there: device -> which."""
        gone: dict[str, str] = {}
        for directory, wanted in probing.entries.items():
            try:
                present = os.listdir(directory)
            except OSError:  # the directory is gone: so is everything in it
                present = []
            for entry in wanted.keys() - set(present):
                for name in wanted[entry]:
                    gone.setdefault(name, probing.what[directory])
        return gone

    @staticmethod
    def _down(probing: _Probing, away: set[str]) -> dict[str, tuple[str, str]]:
        """NICs whose link is down: device -> (interface, its operstate); those `away` (in
        pods) are not judged."""
        down: dict[str, tuple[str, str]] = {}
        for (name, ifname), raw in zip(probing.links, probing.files.read_many(probing.operstate)):
            if ifname in away:
                continue
            state = raw.strip() if raw is not None else b"missing"
            if state in _DOWN:
                down[name] = (ifname, state.decode())
        return down

    def _probe_gpu(self, device: Device) -> None:
        name = device.name
        uuid = str(device.attributes.get("uuid", ""))
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
            self.nvml.nvmlDeviceGetMemoryInfo(handle)
            self.state.clear(name, "gpu-lost")
        except self.nvml.NVMLError_GpuIsLost:
            self.state.set(name, "gpu-lost", "lost", "NVML: GPU has fallen off the bus")
        except self.nvml.NVMLError:
            pass  # other NVML errors say nothing about this device's health
        xid = self.state.conditions(name).get("gpu-xid")
        if xid and self.xid_recovery_seconds and time.time() - xid.since >= self.xid_recovery_seconds:
            self.state.clear(name, "gpu-xid")
