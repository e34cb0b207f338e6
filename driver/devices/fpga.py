"""FPGAs through sysfs: Xilinx/AMD Alveo (xocl/xclmgmt) and Intel DFL (fpga_region).

What a user needs to pick an FPGA is what a bitstream must match: the shell / interface id
of the static region. Both families publish it as `interfaceID`; the currently loaded logic
(Alveo logic uuid, DFL afu id) is published too.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from driver.kube import names
from driver.devices import pci
from driver.devices.bitstreams import canonical_uuid
from driver.devices.model import AttributeSet, Device, DeviceKind
from driver.devices.pciids import PciIds
from driver.devices.problems import DeviceError, Problems

XILINX = 0x10EE


def _first_line(path: Path) -> str | None:
    text = pci.read_text(path)
    if not text:
        return None
    return text.splitlines()[0].strip() or None


def _glob_first(directory: Path, pattern: str) -> Path | None:
    found = sorted(directory.glob(pattern))
    return found[0] if found else None


def _finish(attrs: AttributeSet, problems: Problems) -> None:
    for dropped in attrs.dropped:
        problems.note(attrs.device, f"attribute dropped: {dropped}")


class AlveoDiscovery:
    def __init__(self, sysfs: Path, pci_ids: PciIds | None = None) -> None:
        self.sysfs = sysfs
        self.pci_ids = pci_ids or PciIds(())

    def discover(self, functions: list[pci.PciFunction], problems: Problems) -> list[Device]:
        # A card shows up as two PCI functions of one slot: management (xclmgmt) and user
        # (xocl). Group by slot, i.e. the BDF without the function number.
        slots: dict[str, list[pci.PciFunction]] = defaultdict(list)
        for function in functions:
            if function.vendor == XILINX:
                slots[function.bdf.rsplit(".", 1)[0]].append(function)
        devices = []
        for slot, members in sorted(slots.items()):
            try:
                devices.append(self._card(members, problems))
            except DeviceError as err:
                problems.skip(f"fpga {slot}", str(err))
        return devices

    def _card(self, members: list[pci.PciFunction], problems: Problems) -> Device:
        members.sort(key=lambda f: f.bdf)
        mgmt = next((f for f in members if f.driver == "xclmgmt"), None)
        user = next((f for f in members if f.driver == "xocl"), None)
        if user is None:
            raise DeviceError(
                f"Alveo card at {members[0].bdf}: no user function bound to xocl "
                "(is the XRT driver loaded?)"
            )
        name = names.label_from_pci("fpga", user.bdf)
        render = _glob_first(user.path / "drm", "renderD*")
        if render is None:
            raise DeviceError(f"{name}: no DRM render node under {user.path / 'drm'}")
        management: tuple[str, ...] = ()
        rom = None
        if mgmt is not None:
            instance = pci.read_int(mgmt.path / "instance")
            if instance is not None:
                management = (f"/dev/xclmgmt{instance}",)
            else:
                problems.note(name, f"management function {mgmt.bdf} has no instance number")
            rom = _glob_first(mgmt.path, "rom.*")
        rom = rom or _glob_first(user.path, "rom.*")
        shell = _first_line(rom / "VBNV") if rom else None
        attrs = AttributeSet(name)
        attrs.set("type", "fpga")
        attrs.set("vendor", "xilinx")
        attrs.set("family", "alveo")
        attrs.set("pciVendorID", pci.hex_id(user.vendor))
        attrs.set("pciDeviceID", pci.hex_id(user.device))
        attrs.set("productName", self.pci_ids.product(user.vendor, user.device))
        if shell:
            attrs.set("shell", shell)
            # VBNV is <vendor>_<board>_<shell...>: the board is its second field.
            parts = shell.split("_")
            attrs.set("board", parts[1] if len(parts) > 2 else None)
        attrs.set("fpgaPart", _first_line(rom / "FPGA") if rom else None)
        attrs.set("interfaceID", _first_line(user.path / "interface_uuids"))
        attrs.set("logicUUID", _first_line(user.path / "logic_uuids"))
        if mgmt is not None:
            attrs.set("managementBusID", mgmt.bdf)
        attrs.pci(user.location)
        _finish(attrs, problems)
        board = attrs.values.get("board")
        return Device(
            name=name,
            kind=DeviceKind.FPGA,
            attributes=attrs.values,
            device_nodes=(f"/dev/dri/{render.name}",),
            management_nodes=management,
            pci=user.location,
            model=f"Alveo {str(board).upper()}" if board else "Alveo",
        )


class DflDiscovery:
    """Intel FPGAs under the Device Feature List framework."""

    def __init__(self, sysfs: Path, pci_ids: PciIds | None = None) -> None:
        self.sysfs = sysfs
        self.pci_ids = pci_ids or PciIds(())

    def discover(self, problems: Problems) -> list[Device]:
        regions_dir = self.sysfs / "class" / "fpga_region"
        try:
            regions = sorted(os.listdir(regions_dir))
        except OSError:
            return []
        devices = []
        for region in regions:
            path = (regions_dir / region).resolve()
            ports = sorted(path.glob("dfl-port.*"), key=lambda p: _suffix(p.name))
            fmes = sorted(path.glob("dfl-fme.*"))
            if not ports and not fmes:
                continue  # a partial-reconfiguration region inside an FME, not a card
            try:
                devices.extend(self._card(region, path, fmes, ports, problems))
            except DeviceError as err:
                problems.skip(f"fpga_region {region}", str(err))
        return devices

    def _card(
        self, region: str, path: Path, fmes: list[Path], ports: list[Path], problems: Problems
    ) -> list[Device]:
        bdf = pci.bdf_of(self.sysfs, path)
        if bdf is None:
            raise DeviceError(f"{path} is not below a PCI device")
        function = pci.read_function(self.sysfs, bdf)
        fme = fmes[0] if fmes else None
        compat = None
        bitstream = None
        if fme is not None:
            compat_file = _glob_first(fme, "*/fpga_region/*/compat_id")
            compat = _first_line(compat_file) if compat_file else None
            bitstream = _first_line(fme / "bitstream_id")
        if not ports:
            raise DeviceError(f"DFL card {bdf}: no dfl-port (no accelerator function unit)")
        devices = []
        for index, port in enumerate(ports):
            name = f"{names.label_from_pci('fpga', bdf)}-port{index}"
            attrs = AttributeSet(name)
            attrs.set("type", "fpga")
            attrs.set("vendor", "intel")
            attrs.set("family", "dfl")
            attrs.set("pciVendorID", pci.hex_id(function.vendor))
            attrs.set("pciDeviceID", pci.hex_id(function.device))
            attrs.set("productName", self.pci_ids.product(function.vendor, function.device))
            attrs.set("interfaceID", compat)
            attrs.set("afuID", _first_line(port / "afu_id"))
            attrs.set("bitstreamID", bitstream)
            attrs.set("port", index)
            attrs.pci(function.location)
            if compat is None:
                problems.note(name, "no compat_id: bitstream compatibility unknown")
            _finish(attrs, problems)
            devices.append(
                Device(
                    name=name,
                    kind=DeviceKind.FPGA,
                    attributes=attrs.values,
                    device_nodes=(f"/dev/{port.name}",),
                    management_nodes=(f"/dev/{fme.name}",) if fme else (),
                    pci=function.location,
                    model=self.pci_ids.product(function.vendor, function.device),
                )
            )
        return devices


def _suffix(name: str) -> int:
    try:
        return int(name.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return -1


def loaded_function(sysfs: Path, device: Device) -> tuple[Path, str | None]:
    """The sysfs file that names the function loaded in the device's programmable region,
    and what it says now (canonical UUID; None: empty or unreadable): Alveo's user function
    `logic_uuids`, a DFL port's `afu_id`. Read live, never from the inventory: prepare
    must see what a programming a moment ago (or one a crash cut short) left."""
    bdf = device.pci.bus_id if device.pci is not None else ""
    function = sysfs / "bus" / "pci" / "devices" / bdf
    if device.attributes.get("family") == "dfl":
        ports = sorted(function.resolve().glob("fpga_region/*/dfl-port.*"), key=lambda p: _suffix(p.name))
        index = int(device.attributes.get("port", 0))
        path = ports[index] / "afu_id" if index < len(ports) else function / "afu_id"
    else:
        path = function / "logic_uuids"
    text = _first_line(path)
    return path, canonical_uuid(text) if text else None
