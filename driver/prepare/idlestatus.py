"""The `Idle` condition on a claim's entries in `status.devices`: set by the utilization
monitor (driver/monitoring/utilization/) while a device sits idle, cleared when it works
again, and carried on every state the status writer writes for that device meanwhile.

A claim this process has not written yet (prepared before a restart) is read back from
the server first: its entries are re-applied whole, Ready as it is there.
"""

from __future__ import annotations

import dataclasses
import threading

from driver.prepare.claims import ClaimRef
from driver.prepare.claimstatus import DeviceStatus, StatusWriter, key


class IdleConditions:
    def __init__(self, writer: StatusWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        # uid -> (pool, device, share) -> (message, since): Idle conditions to carry
        self._idle: dict[str, dict[tuple, tuple[str, str]]] = {}
        writer.overlays.append(self.overlay)

    def overlay(self, ref: ClaimRef, devices: list[DeviceStatus]) -> list[DeviceStatus]:
        """The entries with their Idle conditions; none left once the claim has no entry."""
        with self._lock:
            if not devices:
                self._idle.pop(ref.uid, None)
            idle = self._idle.get(ref.uid, {})
            return [dataclasses.replace(d, idle=idle.get(key(d))) for d in devices]

    def set_idle(self, ref: ClaimRef, pool: str, device: str, share_id: str | None,
                 idle: tuple[str, str] | None) -> None:
        """Add (message, since) or remove (None) the Idle condition of one entry."""
        entry = (pool, device, share_id)
        with self._lock:
            known = self._idle.setdefault(ref.uid, {})
            if idle is None:
                if known.pop(entry, None) is None:
                    return
            elif known.get(entry) == idle:
                return
            else:
                known[entry] = idle
        base = self.writer.current(ref.uid)
        if base is None:
            if idle is None:
                return
            base = self.writer.read_back(ref)
            if not base:
                with self._lock:
                    self._idle.pop(ref.uid, None)
                return
        self.writer.publish(ref, base)
