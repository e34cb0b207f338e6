"""Sampling joined with claims: who holds each device and what the device is doing.

Every `--utilization-interval` the monitor samples the devices (sampler.py), looks up
which prepared claims hold each one (the checkpoint: no API call), advances the idle
timers (idle.py) and keeps the result for the metrics and for `dra-driver status`. When a
claim's device has been idle for `--idle-after`, the publishing instance posts one Event
on the claim and sets an `Idle` condition on its entry in status.devices; when the device
is busy again (or the claim leaves) the condition goes, and the next idle period gets a
new Event.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import structlog

from driver.state.checkpoint import ClaimRecord, State
from driver.prepare.claims import ClaimRef
from driver.prepare.idlestatus import IdleConditions
from driver.devices.model import Device, DeviceKind, Inventory
from driver.kube.client import ApiError
from driver.monitoring.utilization.events import ClaimEvent, EventRecorder, micro_time
from driver.monitoring.utilization.idle import Holder, IdleTracker, Period
from driver.monitoring.utilization.sampler import Sample, Sampler

MIB = 1 << 20


@dataclass(frozen=True)
class DeviceView:
    sample: Sample
    holders: tuple[Holder, ...] = ()
    idle_seconds: dict[str, float] = field(default_factory=dict)  # claim uid -> seconds
    # What dcgm-exporter labels the same device with, for joins (driver/monitoring/devicemetrics.py):
    # the GPU's UUID (a MIG device's parent's), a MIG device's GPU instance, the DRA pool.
    uuid: str = ""
    gpu_instance: str = ""
    pool: str = ""


def _ids(device: Device | None) -> tuple[str, str]:
    """(UUID, GPU_I_ID) as dcgm-exporter labels the device: a MIG device by its parent
    GPU's UUID and its GPU instance; a partition not yet created has no instance."""
    if device is None or device.kind not in (DeviceKind.GPU, DeviceKind.MIG):
        return "", ""
    if device.kind is DeviceKind.MIG:
        instance = device.attributes.get("gpuInstanceID")
        return str(device.attributes.get("parentUUID") or ""), "" if instance is None else str(instance)
    return str(device.attributes.get("uuid") or ""), ""


@dataclass(frozen=True)
class _Tick:
    """What the last tick saw, for views()."""

    at: float
    samples: dict[str, Sample]  # GPUs and MIG devices
    held: dict[str, list[Holder]]


def holders_of(records: Iterable[ClaimRecord]) -> dict[str, list[Holder]]:
    held: dict[str, list[Holder]] = {}
    for record in records:
        if record.state is not State.PREPARE_COMPLETED:
            continue
        for device in record.devices:
            held.setdefault(device.device, []).append(
                Holder(record.uid, record.namespace, record.name, device.share_id,
                       device.admin_access, record.pods))
    return held


def duration(seconds: float) -> str:
    """30m, 1h5m, 45s: how kubectl shows ages."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m{secs}s" if secs and minutes < 10 else f"{minutes}m"
    return f"{secs}s"


def idle_message(sample: Sample, idle_seconds: float) -> str:
    what = "MIG device" if sample.kind is DeviceKind.MIG else "GPU"
    if sample.utilization is not None:  # NVML's share of time a kernel ran
        activity = f"kernels active {round(sample.utilization * 100)}% of the time"
    else:
        activity = "no compute processes"
    used = f", {sample.memory_used // MIB} MiB used" if sample.memory_used is not None else ""
    return f"{what} {sample.device} idle for {duration(idle_seconds)}; {activity}{used}"


class UtilizationMonitor:
    def __init__(self, sampler: Sampler, tracker: IdleTracker,
                 records: Callable[[], Iterable[ClaimRecord]], pool: str,
                 events: EventRecorder | None = None, status: IdleConditions | None = None,
                 leader: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.time) -> None:
        self.sampler = sampler
        self.tracker = tracker
        self.records = records
        self.pool = pool
        self.events = events
        self.status = status
        self.leader = leader
        self.clock = clock
        self._last: _Tick | None = None  # replaced whole: views() on another thread needs no lock
        self._ids: tuple[Inventory, dict[str, tuple[str, str]]] | None = None
        self.samples_taken = 0
        self.log = structlog.get_logger(component="utilization")

    def tick(self) -> None:
        now = self.clock()
        samples = self.sampler.activity(now)
        held = holders_of(self.records())
        changes = self.tracker.update(now, samples, held)
        self._last = _Tick(now, samples, held)
        self.samples_taken += 1
        if not self.leader():
            return
        for period in changes.ended:
            self._clear(period)
        for period in changes.due:
            self._report(period, samples.get(period.device), now)

    def views(self) -> tuple[DeviceView, ...]:
        """Every device, by name: its activity and holders as of the last tick, a NIC's
        counters read now. Built when metrics are scraped, not every tick: on a node of
        2,048 VFs, reading every counter and building every view each 10 s was nearly a
        third of the idle driver's CPU, for a scrape that comes every 30 or 60 s, if at
        all (node_exporter, too, reads counters when scraped)."""
        last = self._last
        if last is None:
            return ()
        samples = self.sampler.completed(last.samples, self.clock())
        ids = self._ids_of(self.sampler.inventory())

        def view(name: str, sample: Sample) -> DeviceView:
            holders = tuple(last.held.get(name, ()))
            uuid, instance = ids.get(name, ("", ""))
            return DeviceView(sample, holders, {h.uid: self.tracker.idle_for(name, h.uid, last.at)
                                                for h in holders}, uuid, instance, self.pool)

        return tuple(view(name, sample) for name, sample in sorted(samples.items()))

    def _ids_of(self, inventory: Inventory) -> dict[str, tuple[str, str]]:
        """Each GPU's and MIG device's (UUID, GPU_I_ID), kept while the inventory is the same
        object (rediscovery replaces it only when it changed)."""
        known = self._ids
        if known is not None and known[0] is inventory:
            return known[1]
        ids = {d.name: _ids(d) for d in inventory.devices if d.kind in (DeviceKind.GPU, DeviceKind.MIG)}
        self._ids = (inventory, ids)
        return ids

    def _report(self, period: Period, sample: Sample | None, now: float) -> None:
        if sample is None:
            return
        message = idle_message(sample, now - period.since)
        ref = ClaimRef(period.claim_namespace, period.claim_name, period.claim_uid)
        log = self.log.bind(device=period.device, claim_uid=period.claim_uid,
                            claim_namespace=period.claim_namespace, claim_name=period.claim_name)
        if self.status is not None:
            self.status.set_idle(ref, self.pool, period.device, period.share,
                                 (message, micro_time(period.since)[:19] + "Z"))
        if self.events is not None:
            try:
                self.events.post(ClaimEvent(period.claim_namespace, period.claim_name,
                                            period.claim_uid, "DeviceIdle", "Idle", message), now)
            except ApiError as err:
                if err.status in (0, 429) or err.status >= 500:  # try again next sample
                    log.warning("idle_event_failed", error=str(err), retry=True)
                    return
                log.error("idle_event_rejected", error=str(err))  # RBAC, validation: not again
        self.tracker.reported(period)
        log.info("device_idle", idle_seconds=round(now - period.since), detail=message)

    def _clear(self, period: Period) -> None:
        if self.status is not None:
            ref = ClaimRef(period.claim_namespace, period.claim_name, period.claim_uid)
            self.status.set_idle(ref, self.pool, period.device, period.share, None)
        self.log.info("device_busy_again", device=period.device, claim_uid=period.claim_uid,
                      claim_namespace=period.claim_namespace, claim_name=period.claim_name)

    async def run(self, interval: float) -> None:
        try:
            while True:
                try:
                    await asyncio.to_thread(self.tick)
                except Exception as err:  # a bug must not end sampling
                    self.log.exception("utilization_sample_failed", error=str(err))
                await asyncio.sleep(interval)
        finally:
            self.sampler.close()
