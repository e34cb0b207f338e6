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

from driver.instance import Instance
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

    def to_json(self) -> bytes:
        return json.dumps({
            "version": FORMAT_VERSION, "device": self.device, "uuid": self.uuid,
            "setup": self.setup.to_dict(), "boot_id": self.boot_id,
            "compute_mode_before": self.compute_mode_before, "daemon": self.daemon,
        }, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: Path) -> "DeviceState":
        try:
            data = json.loads(raw)
            if data.get("version") != FORMAT_VERSION:
                raise DeviceStateError(f"{source}: unknown format {data.get('version')!r}")
            return cls(device=data["device"], uuid=data["uuid"],
                       setup=Setup.from_dict(data["setup"]), boot_id=data["boot_id"],
                       compute_mode_before=data.get("compute_mode_before"),
                       daemon=data.get("daemon"))
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
