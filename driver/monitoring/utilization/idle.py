"""Idle periods: since when a claim has left its device idle, kept across restarts.

A device is idle in a sample when its highest NVML utilization sample since the last one (the
share of time a kernel ran; not SM activity) is below the threshold (a short burst counts as busy), or, for a MIG device (NVML has no
utilization counter for one), when it runs no compute process. A sample that could not be
taken neither starts nor ends a period. Periods belong to (device, claim): a claim that
takes an idle device starts its own. Admin-access claims (monitoring beside a workload)
have none: they are not the ones wasting the device.

Each period is reported once, when it passes `idle_after`: the caller posts an Event and
sets the claim's Idle condition, then `reported()`; the condition is cleared when the
period ends. Periods live in `<state-dir>/utilization/idle.json`, written (without fsync:
a power loss costs at most a timer restart) only when one starts, ends or is reported.
During an upgrade only the publishing instance writes and reports; the new instance
reads the file when it starts.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import structlog

from driver.state import atomic
from driver.devices.model import DeviceKind
from driver.monitoring.utilization.sampler import Sample

FILE_VERSION = 1
FILE = Path("utilization") / "idle.json"  # below the state directory


@dataclass(frozen=True)
class Holder:
    """A claim that holds a device (from the checkpoint)."""

    uid: str
    namespace: str
    name: str
    share: str | None = None
    admin: bool = False
    pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Period:
    device: str
    claim_uid: str
    claim_namespace: str
    claim_name: str
    share: str | None
    since: float  # unix seconds
    reported: bool = False


@dataclass
class Changes:
    due: list[Period]  # passed idle_after just now: to report
    ended: list[Period]  # reported periods that ended: to clear


def is_idle(sample: Sample, threshold: float) -> bool | None:
    """True/False, or None when the sample cannot tell."""
    if sample.peak is not None:
        return sample.peak < threshold
    if sample.kind is DeviceKind.MIG and sample.processes is not None:
        return sample.processes == 0
    return None


class IdleTracker:
    def __init__(self, state_dir: Path, owner: str, threshold: float, idle_after: float,
                 leader: Callable[[], bool] = lambda: True) -> None:
        self.path = state_dir / FILE
        self.owner = owner
        self.threshold = threshold
        self.idle_after = idle_after  # 0: never reported
        self.leader = leader
        self._lock = threading.Lock()
        self.log = structlog.get_logger(component="utilization")
        self._periods: dict[tuple[str, str], Period] = {p_key(p): p for p in load(self.path)}

    def periods(self) -> list[Period]:
        with self._lock:
            return list(self._periods.values())

    def idle_for(self, device: str, claim_uid: str, now: float) -> float:
        with self._lock:
            period = self._periods.get((device, claim_uid))
        return max(0.0, now - period.since) if period is not None else 0.0

    def update(self, now: float, samples: dict[str, Sample],
               holders: dict[str, list[Holder]]) -> Changes:
        changes = Changes([], [])
        with self._lock:
            before = dict(self._periods)
            wanted = {(device, h.uid): h for device, held in holders.items()
                      for h in held if not h.admin}
            for key, period in list(self._periods.items()):
                if key not in wanted:  # the claim left the device
                    del self._periods[key]
                    if period.reported:
                        changes.ended.append(period)
            for (device, uid), holder in wanted.items():
                sample = samples.get(device)
                idle = is_idle(sample, self.threshold) if sample is not None else None
                period = self._periods.get((device, uid))
                if idle is False and period is not None:
                    del self._periods[(device, uid)]
                    if period.reported:
                        changes.ended.append(period)
                elif idle and period is None:
                    self._periods[(device, uid)] = Period(device, uid, holder.namespace,
                                                          holder.name, holder.share, now)
                period = self._periods.get((device, uid))
                if (period is not None and not period.reported and self.idle_after
                        and now - period.since >= self.idle_after):
                    changes.due.append(period)
            if self._periods != before:
                self._save()
        return changes

    def reported(self, period: Period) -> None:
        """The Event went out: not again for this period (also after a restart)."""
        with self._lock:
            key = p_key(period)
            current = self._periods.get(key)
            if current is not None and current.since == period.since:
                self._periods[key] = Period(**{**asdict(current), "reported": True})
                self._save()

    def _save(self) -> None:
        if not self.leader():
            return
        body = {"version": FILE_VERSION,
                "periods": [asdict(p) for p in sorted(self._periods.values(), key=p_key)]}
        try:
            atomic.write(self.path, json.dumps(body, sort_keys=True).encode(), mode=0o600,
                         owner=self.owner, durable=False)
        except OSError as err:  # the timers go on in memory; the next change retries
            self.log.warning("idle_state_write_failed", file=str(self.path), error=str(err))


def p_key(period: Period) -> tuple[str, str]:
    return period.device, period.claim_uid


def load(path: Path) -> Iterable[Period]:
    """The periods in the file; a missing file is none, an unreadable one is logged and
    ignored (timers start again: nothing else depends on them)."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"unknown format {data.get('version')!r}")
        return [Period(str(p["device"]), str(p["claim_uid"]), str(p["claim_namespace"]),
                       str(p["claim_name"]), p.get("share"), float(p["since"]),
                       bool(p.get("reported", False))) for p in data["periods"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        structlog.get_logger(component="utilization").warning(
            "idle_state_unreadable", file=str(path), error=str(err))
        return []
