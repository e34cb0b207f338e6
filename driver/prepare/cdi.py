"""CDI spec files: one transient spec per claim, written atomically into --cdi-root.

The spec declares the lowest cdiVersion that covers the fields it uses, because runtimes
reject versions newer than they know (podman 4.3 stops at 0.5.0) and specs that use a
field newer than they declare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from driver.state import atomic

from driver.kube import names
from driver.state.instance import Instance

CLAIM_CLASS = "claim"


class CdiError(ValueError):
    """A spec would be invalid; the message names the claim or device."""


@dataclass(frozen=True)
class DeviceNode:
    path: str  # in the container
    host_path: str  # on the host (the runtime stats it for type/major/minor)
    permissions: str = "rw"


@dataclass(frozen=True)
class NetDevice:
    host_interface_name: str
    name: str  # inside the container


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()
    mounts: tuple[Mount, ...] = ()

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.net_devices or self.mounts)

    def to_json(self) -> dict:
        out: dict = {}
        if self.env:
            out["env"] = list(self.env)
        if self.device_nodes:
            out["deviceNodes"] = [
                {"path": n.path, "hostPath": n.host_path, "permissions": n.permissions}
                for n in self.device_nodes
            ]
        if self.mounts:
            # No `type`: it needs cdiVersion 0.4.0, and "bind" in the options says it all.
            out["mounts"] = [
                {"hostPath": m.host_path, "containerPath": m.container_path, "options": list(m.options)}
                for m in self.mounts
            ]
        if self.net_devices:
            out["netDevices"] = [
                {"hostInterfaceName": n.host_interface_name, "name": n.name}
                for n in self.net_devices
            ]
        return out


@dataclass(frozen=True)
class CdiDevice:
    name: str
    edits: ContainerEdits = field(default_factory=ContainerEdits)


def minimum_version(kind: str, devices: list[CdiDevice]) -> str:
    """The oldest cdiVersion whose schema covers what the spec uses (reference.md §5)."""
    version = (0, 3, 0)
    if any(n.host_path for d in devices for n in d.edits.device_nodes):
        version = max(version, (0, 5, 0))
    if any(d.name[:1].isdigit() for d in devices):
        version = max(version, (0, 5, 0))
    if "." in kind.split("/", 1)[1]:
        version = max(version, (0, 6, 0))
    if any(d.edits.net_devices for d in devices):
        version = max(version, (1, 1, 0))
    return ".".join(map(str, version))


def build_spec(vendor: str, devices: list[CdiDevice], where: str) -> dict:
    kind = f"{vendor}/{CLAIM_CLASS}"
    if not names.is_cdi_vendor_or_class(vendor):
        raise CdiError(f"{where}: CDI vendor {vendor!r} is invalid")
    if not devices:
        raise CdiError(f"{where}: a CDI spec needs at least one device")
    seen = set()
    for device in devices:
        if not names.is_cdi_device_name(device.name):
            raise CdiError(f"{where}: CDI device name {device.name!r} is invalid")
        if device.name in seen:
            raise CdiError(f"{where}: CDI device name {device.name!r} used twice")
        if device.edits.is_empty():
            raise CdiError(f"{where}: CDI device {device.name} has no container edits")
        seen.add(device.name)
    return {
        "cdiVersion": minimum_version(kind, devices),
        "kind": kind,
        "devices": [{"name": d.name, "containerEdits": d.edits.to_json()} for d in devices],
    }


def qualified_id(vendor: str, device_name: str) -> str:
    return f"{vendor}/{CLAIM_CLASS}={device_name}"


class CdiWriter:
    def __init__(self, root: Path, vendor: str, instance: Instance) -> None:
        self.root = root
        self.vendor = vendor
        self.instance = instance
        self.root.mkdir(parents=True, exist_ok=True)
        atomic.sweep_temp_files(self.root, instance.owner_state, prefix=f"{vendor}-{CLAIM_CLASS}_")

    def path(self, claim_uid: str) -> Path:
        if not names.is_dns_label(claim_uid):
            raise CdiError(f"claim UID {claim_uid!r} cannot name a CDI spec file")
        return self.root / f"{self.vendor}-{CLAIM_CLASS}_{claim_uid}.json"

    def write(self, claim_uid: str, spec: dict) -> Path:
        path = self.path(claim_uid)
        # One line: json's C encoder writes that, while `indent` falls back to its Python
        # encoder (~6x slower, once per prepare). `jq . FILE` shows it indented.
        # Not fsynced (docs/crash-safety.md): a process crash loses nothing in the page
        # cache, and after a power loss, the reboot that follows, every record is from
        # another boot and the next prepare rebuilds its spec whatever the file holds
        # (on tmpfs, the usual /var/run/cdi, it is gone anyway).
        atomic.write(path, json.dumps(spec).encode(), owner=self.instance.token, durable=False)
        return path

    def read(self, claim_uid: str) -> dict | None:
        try:
            return json.loads(self.path(claim_uid).read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def remove(self, claim_uid: str) -> bool:
        return atomic.remove(self.path(claim_uid))
