"""The checkpoint of what the driver changed on a device: <state-dir>/devices/<device>.json.

A record is written (durably) before the change it describes, and removed only after the
change was undone, so that after SIGKILL at any point a restart knows what to undo or to
finish: every record either belongs to a device some prepared claim still needs set up
(keep, re-apply after a reboot) or to none (undo, then remove). The original compute mode
is recorded so that undoing restores it rather than guessing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from driver.state.instance import Instance
from driver.prepare.records import RecordStore
from driver.prepare.setup import Setup

FORMAT_VERSION = 1


class DeviceStateError(Exception):
    pass


@dataclass(frozen=True)
class DeviceState:
    device: str  # our device name
    uuid: str  # the NVML UUID the change was made on
    setup: Setup
    boot_id: str  # changes to a GPU do not survive a reboot
    compute_mode_before: int | None = None  # None: compute mode not changed (MIG devices)
    daemon: str | None = None  # the MPS control daemon pod's name
    # Wall-clock time (seconds since the epoch: both instances of an upgrade read it) until
    # which the setup is kept although no prepared claim needs it yet: a prepare waits for
    # its daemon outside the locks, or failed and the kubelet will retry. Without it, a
    # reconcile pass in that gap would stop the daemon the prepare is waiting for.
    reserved_until: float | None = None
    reserved_by: str | None = None  # the instance token of the prepare that reserved it

    def reserved(self, now: float, alive: Callable[[str], bool]) -> bool:
        """Kept for a prepare in flight: by a live instance (a crashed one's prepare is
        gone, and its half-made setup is undone at once) and not for longer than allowed."""
        return (self.reserved_until is not None and now < self.reserved_until
                and self.reserved_by is not None and alive(self.reserved_by))

    def to_json(self) -> bytes:
        data = {
            "version": FORMAT_VERSION, "device": self.device, "uuid": self.uuid,
            "setup": self.setup.to_dict(), "boot_id": self.boot_id,
            "compute_mode_before": self.compute_mode_before, "daemon": self.daemon,
        }
        if self.reserved_until is not None:  # optional: older versions read the record as before
            data["reserved_until"] = self.reserved_until
            data["reserved_by"] = self.reserved_by
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: Path) -> "DeviceState":
        try:
            data = json.loads(raw)
            if data.get("version") != FORMAT_VERSION:
                raise DeviceStateError(f"{source}: unknown format {data.get('version')!r}")
            return cls(device=data["device"], uuid=data["uuid"],
                       setup=Setup.from_dict(data["setup"]), boot_id=data["boot_id"],
                       compute_mode_before=data.get("compute_mode_before"),
                       daemon=data.get("daemon"), reserved_until=data.get("reserved_until"),
                       reserved_by=data.get("reserved_by"))
        except DeviceStateError:
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise DeviceStateError(f"{source}: corrupt device state record: {err}") from err


class DeviceStates(RecordStore[DeviceState]):
    """<state-dir>/devices: what was changed on each device."""

    def __init__(self, state_dir: Path, instance: Instance) -> None:
        super().__init__(state_dir / "devices", instance, DeviceState.from_json, DeviceStateError)

    def all(self) -> list[DeviceState | DeviceStateError]:
        return self.all_or_errors()
