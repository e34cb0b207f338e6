"""Claim status for moved NICs: `networkData` (the name, addresses and MAC the pod sees)
and a `NetworkReady` condition on the device's entry in `status.devices`, written once
the interface is in the pod's namespace and configured, and taken off when it returns.

Like the Idle condition (driver/prepare/idlestatus.py) it is an overlay of the status
writer: prepare's Ready entries are written as before, and every state written for the
claim afterwards carries what this module knows.
"""

from __future__ import annotations

import dataclasses
import threading

from driver.nri.netdev import NetworkData
from driver.prepare.claims import ClaimRef
from driver.prepare.claimstatus import DeviceStatus, StatusWriter, now


class NetworkConditions:
    def __init__(self, writer: StatusWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        # claim uid -> (pool, device) -> (networkData, (message, since) or None once the
        # interface is back on the host: then networkData keeps its name and MAC only, as
        # prepare wrote it, and the pod's addresses go)
        self._moved: dict[str, dict[tuple[str, str], tuple[dict, tuple[str, str] | None]]] = {}
        writer.overlays.append(self.overlay)

    def overlay(self, ref: ClaimRef, devices: list[DeviceStatus]) -> list[DeviceStatus]:
        with self._lock:
            if not devices:  # unprepared: nothing of it is left to describe
                self._moved.pop(ref.uid, None)
            moved = self._moved.get(ref.uid, {})
            out = []
            for d in devices:
                found = moved.get((d.pool, d.device))
                out.append(dataclasses.replace(d, network=found[0], network_ready=found[1])
                           if found else dataclasses.replace(d, network_ready=None))
            return out

    def moved(self, ref: ClaimRef, pool: str, device: str, data: NetworkData, pod: str) -> None:
        network = {"interfaceName": data.interface_name,
                   "hardwareAddress": data.hardware_address}
        if data.ips:
            network["ips"] = list(data.ips)[:16]
        message = f"interface {data.interface_name} is in pod {pod}'s network namespace"
        with self._lock:
            known = self._moved.setdefault(ref.uid, {})
            found = known.get((pool, device))
            # CreateContainer re-attaches a NIC already in place (driver/nri/pods.py): the
            # condition has not changed, so it keeps its transition time and costs no write.
            if found is not None and found[0] == network and found[1] is not None \
                    and found[1][0] == message:
                return
            known[(pool, device)] = (network, (message, now()))
        self._republish(ref)

    def returned(self, ref: ClaimRef, pool: str, device: str) -> None:
        with self._lock:
            known = self._moved.get(ref.uid, {})
            found = known.get((pool, device))
            if found is None or found[1] is None:
                return
            known[(pool, device)] = ({k: v for k, v in found[0].items() if k != "ips"}, None)
        self._republish(ref)

    def _republish(self, ref: ClaimRef) -> None:
        base = self.writer.current(ref.uid)
        if base is None:
            base = self.writer.read_back(ref)  # prepared before this process started
        if base:
            self.writer.publish(ref, base)
