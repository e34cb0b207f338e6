"""The vendor-neutral device model that discovery produces and everything else consumes.

A Device carries what the scheduler needs (typed attributes and capacities), what a
container needs (device nodes, a network interface), and where the device sits (PCI/NUMA).
Devices are immutable values: a changed device is a new value, which makes "did the
inventory change?" a plain equality test for the publisher.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Union

from driver.kube import names
# The standard attribute names every DRA driver uses for cross-driver alignment.
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"

MAX_ATTRIBUTES_AND_CAPACITIES = 32


class DeviceKind(str, enum.Enum):
    GPU = "gpu"
    MIG = "mig"
    FPGA = "fpga"
    NIC = "nic"


@dataclass(frozen=True, order=True)
class Version:
    """A semver attribute value (published as `version`, compared semantically in CEL)."""

    value: str

    def __post_init__(self) -> None:
        if not names.is_semver(self.value):
            raise ValueError(f"{self.value!r} is not a semver 2.0.0 version")

    def __str__(self) -> str:
        return self.value


AttributeValue = Union[bool, int, str, Version]


@dataclass(frozen=True)
class PciLocation:
    """Where a device sits: its PCI address, the PCIe root complex and NUMA node."""

    bus_id: str  # "0000:17:00.0"
    pcie_root: str | None  # "pci0000:00"; None when sysfs does not tell
    numa_node: int | None  # None when unknown (sysfs says -1)


@dataclass(frozen=True)
class Device:
    name: str
    kind: DeviceKind
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)  # name -> Quantity string
    # Paths as a container sees them ("/dev/nvidia0"); the host path is the same path
    # under the configured dev root.
    device_nodes: tuple[str, ...] = ()
    # Nodes a container gets only when the claim's config asks for them (an FPGA's
    # management function can reflash the card; a workload rarely needs it).
    management_nodes: tuple[str, ...] = ()
    net_interface: str | None = None  # host interface name, NICs only
    pci: PciLocation | None = None
    model: str = ""  # human-readable, for `discover -o table` and logs
    # Partitionable devices (KEP-4815): counter set name -> counter -> quantity consumed.
    consumes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not names.is_dns_label(self.name):
            raise ValueError(f"device name {self.name!r} is not a DNS-1123 label")
        count = len(self.attributes) + len(self.capacity)
        if count > MAX_ATTRIBUTES_AND_CAPACITIES:
            raise ValueError(
                f"device {self.name}: {count} attributes and capacities, the API allows "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}"
            )
        for key, value in self.attributes.items():
            if not names.is_qualified_name(key):
                raise ValueError(f"device {self.name}: attribute name {key!r} is invalid")
            if isinstance(value, (str, Version)) and len(str(value)) > names.ATTRIBUTE_VALUE_MAX:
                raise ValueError(
                    f"device {self.name}: attribute {key} is longer than "
                    f"{names.ATTRIBUTE_VALUE_MAX} characters"
                )
        for key in self.capacity:
            if not names.is_qualified_name(key):
                raise ValueError(f"device {self.name}: capacity name {key!r} is invalid")


@dataclass(frozen=True)
class Inventory:
    """All devices of a node, sorted by name so that equal inventories compare equal."""

    devices: tuple[Device, ...] = ()
    # Shared counters of partitionable devices: counter set name -> counter -> quantity.
    counter_sets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    _by_name: Mapping[str, Device] = field(default_factory=dict, init=False, repr=False,
                                           compare=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.devices, key=lambda d: d.name))
        by_name: dict[str, Device] = {}
        for device in ordered:
            if device.name in by_name:
                raise ValueError(f"two devices are named {device.name!r}")
            by_name[device.name] = device
        object.__setattr__(self, "devices", ordered)
        # Prepare looks devices up by name for every claim and every record it checks: a
        # scan of 2,048 devices each time would be its largest cost on a big node.
        object.__setattr__(self, "_by_name", by_name)

    def get(self, name: str) -> Device | None:
        return self._by_name.get(name)

    def by_kind(self, kind: DeviceKind) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind is kind)


class AttributeSet:
    """Collects a device's attributes, dropping (with a reason) values the API would reject.

    Discovery reads untrusted strings from sysfs and NVML; one over-long board name must
    cost that one attribute, not the whole slice write.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.values: dict[str, AttributeValue] = {}
        self.dropped: list[str] = []

    def set(self, key: str, value: AttributeValue | None) -> None:
        if value is None:
            return
        if isinstance(value, str):
            value = value.strip()
            if not value:
                return
            if len(value) > names.ATTRIBUTE_VALUE_MAX:
                self.dropped.append(f"{key}: value longer than {names.ATTRIBUTE_VALUE_MAX} chars")
                return
        self.values[key] = value

    def version(self, key: str, raw: str | None) -> None:
        if raw is None:
            return
        value = names.normalize_semver(raw)
        if value is None:
            self.dropped.append(f"{key}: {raw!r} is not a version")
            return
        self.values[key] = Version(value)

    def pci(self, location: PciLocation | None) -> None:
        if location is None:
            return
        self.set(PCI_BUS_ID, location.bus_id)
        self.set(PCIE_ROOT, location.pcie_root)
        self.set("numaNode", location.numa_node)
