"""PCI functions as sysfs describes them: identity, driver, NUMA node and PCIe root.

Every reader takes the sysfs root as an argument, so the same code reads the real /sys, a
captured snapshot and the mock tree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from driver.devices.model import PciLocation
from driver.devices.problems import DeviceError

BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")

CLASS_NETWORK = 0x02
CLASS_DISPLAY = 0x03
CLASS_ACCELERATOR = 0x12


@dataclass(frozen=True)
class PciFunction:
    bdf: str
    path: Path  # resolved device directory
    vendor: int
    device: int
    class_code: int  # 24-bit: base class, subclass, prog-if
    driver: str | None
    numa_node: int | None
    pcie_root: str | None

    @property
    def base_class(self) -> int:
        return self.class_code >> 16

    @property
    def location(self) -> PciLocation:
        return PciLocation(self.bdf, self.pcie_root, self.numa_node)


def read_text(path: Path) -> str | None:
    """A sysfs attribute's value, or None when it is missing or unreadable.

    Some attributes exist but fail on read (a NIC's `speed` gives EINVAL while the link is
    down), so "unreadable" is a normal answer here, not an error.
    """
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 10) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def link_name(path: Path) -> str | None:
    """The last component of a symlink's target (`driver` -> `mlx5_core`)."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def list_functions(sysfs: Path) -> list[str]:
    directory = sysfs / "bus" / "pci" / "devices"
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(e for e in entries if BDF.match(e))


def pcie_root_of(sysfs: Path, resolved: Path, devices_root: Path | None = None) -> str | None:
    """The root complex (`pci0000:00`) a resolved device path hangs under.

    It is the first component below /sys/devices; the root *port* (0000:00:01.5) further
    down is not the root. Pass `devices_root` (the resolved /sys/devices) when calling in
    a loop: resolving it costs more than the rest.
    """
    try:
        rel = resolved.relative_to(devices_root or (sysfs / "devices").resolve())
    except ValueError:
        return None
    first = rel.parts[0] if rel.parts else ""
    return first if first.startswith("pci") else None


def bdf_of(sysfs: Path, path: Path, devices_root: Path | None = None) -> str | None:
    """Walk up from a resolved sysfs path (a netdev, an RDMA device) to its PCI function."""
    devices = devices_root or (sysfs / "devices").resolve()
    current = path
    while current != devices and current != current.parent:
        if BDF.match(current.name):
            return current.name
        current = current.parent
    return None


def read_all(sysfs: Path, known: dict[str, PciFunction] | None = None,
             fresh: frozenset[str] | None = None) -> tuple[dict[str, PciFunction], dict[str, str]]:
    """Every PCI function sysfs lists, read once: (functions by address, errors by address).

    With `known` (the last discovery's functions), a function still listed is taken from it
    unless `fresh` names it: what a function reads here (identity, driver, NUMA node, place
    in the tree) changes only with a uevent for it, and `fresh` is what uevents named."""
    devices_root = (sysfs / "devices").resolve()
    functions: dict[str, PciFunction] = {}
    errors: dict[str, str] = {}
    known = known or {}
    fresh = fresh or frozenset()
    for bdf in list_functions(sysfs):
        if bdf in known and bdf not in fresh:
            functions[bdf] = known[bdf]
            continue
        try:
            functions[bdf] = read_function(sysfs, bdf, devices_root)
        except DeviceError as err:
            errors[bdf] = str(err)
    return functions, errors


def read_function(sysfs: Path, bdf: str, devices_root: Path | None = None) -> PciFunction:
    link = sysfs / "bus" / "pci" / "devices" / bdf
    path = link.resolve()
    if not path.is_dir():
        raise DeviceError(f"PCI device {bdf}: {link} does not lead to a device directory")
    vendor = read_int(path / "vendor", 16)
    device = read_int(path / "device", 16)
    class_code = read_int(path / "class", 16)
    if vendor is None or device is None or class_code is None:
        raise DeviceError(f"PCI device {bdf}: vendor, device or class unreadable in {path}")
    numa = read_int(path / "numa_node")
    return PciFunction(
        bdf=bdf,
        path=path,
        vendor=vendor,
        device=device,
        class_code=class_code,
        driver=link_name(path / "driver"),
        # -1 means "no NUMA affinity known"; it must not become node 0.
        numa_node=numa if numa is not None and numa >= 0 else None,
        pcie_root=pcie_root_of(sysfs, path, devices_root),
    )


def hex_id(value: int) -> str:
    return f"0x{value:04x}"
