"""What a prepared (or failed) claim's devices report in the claim's `status.devices`.

`data` is small, stable JSON for tools (documented in docs/claim-status.md):
  gpu   {"type": "gpu", "uuid": "GPU-…", "pciBusID": "0000:17:00.0"}
  mig   {"type": "mig", "uuid": "MIG-…", "parentUUID": "GPU-…", "profile": "1g.10gb"}
  fpga  {"type": "fpga", "pciBusID": "…", "interfaceID": "…"}
  nic   {"type": "nic", "pciBusID": "…", "ifName": "…", "rdmaDevice": "mlx5_0"}
and for a share, `"consumedCapacity"` as allocated. NICs also get `networkData`: the
interface name the pod sees, the host interface's addresses when it stays in the host's
namespace (a moved interface keeps none of them), and the MAC address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from driver.prepare import opaque
from driver.state.checkpoint import PreparedDevice
from driver.prepare.claimstatus import DeviceStatus
from driver.prepare.claims import Allocation
from driver.devices.model import Device, DeviceKind

PREPARED, FAILED = "Prepared", "PrepareFailed"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
_DATA_ATTRIBUTES = {
    DeviceKind.GPU: ("uuid", PCI_BUS_ID),
    DeviceKind.MIG: ("uuid", "parentUUID", "profile"),
    DeviceKind.FPGA: (PCI_BUS_ID, "interfaceID"),
    DeviceKind.NIC: (PCI_BUS_ID, "ifName", "rdmaDevice"),
}

Addresses = Callable[[str], list[str]]  # interface -> its IPs in CIDR form


def data_of(device: Device, prepared: PreparedDevice) -> dict:
    data: dict = {"type": device.kind.value}
    for attribute in _DATA_ATTRIBUTES[device.kind]:
        value = device.attributes.get(attribute)
        if value is not None:
            data[attribute.rpartition("/")[2]] = str(value)
    if prepared.consumed:
        data["consumedCapacity"] = dict(prepared.consumed)
    return data


def network_of(device: Device, prepared: PreparedDevice, addresses: Addresses) -> dict | None:
    if device.kind is not DeviceKind.NIC or not device.attributes.get("ifName"):
        return None
    host_name = str(device.attributes["ifName"])
    config = opaque.from_dict(prepared.config) if prepared.config else opaque.NicConfig()
    moved = isinstance(config, opaque.NicConfig) and config.moveInterface
    name = (config.interfaceName if isinstance(config, opaque.NicConfig) and config.interfaceName
            and moved else None) or host_name
    network: dict = {"interfaceName": name}
    ips = [] if moved else addresses(host_name)[:16]
    if ips:
        network["ips"] = ips
    if device.attributes.get("mac"):
        network["hardwareAddress"] = str(device.attributes["mac"])
    return network


def prepared(devices: tuple[PreparedDevice, ...], used: list[Device], addresses: Addresses,
             cdi_ids: bool = True) -> list[DeviceStatus]:
    """Ready entries: `used` are the devices as prepared (a created MIG device, not its
    placeholder), in the order of `devices`."""
    out = []
    for p, device in zip(devices, used):
        message = f"CDI device {', '.join(p.cdi_ids)}" if cdi_ids and p.cdi_ids else ""
        out.append(DeviceStatus(p.pool, p.device, p.share_id, True, PREPARED, message,
                                data_of(device, p), network_of(device, p, addresses)))
    return out


def failed(allocation: Allocation, pool: str, error: str) -> list[DeviceStatus]:
    """Not-ready entries for every device of ours in the allocation, with the reason."""
    return [DeviceStatus(d.pool, d.device, d.share_id, False, FAILED, error)
            for d in allocation.devices if d.pool == pool]


def no_addresses(_: str) -> list[str]:
    return []


def host_addresses(proc: Path) -> Addresses:
    from driver.devices.addresses import interface_addresses

    return lambda ifname: interface_addresses(proc, ifname)
