"""Network functions through sysfs: physical NICs, SR-IOV VFs and their RDMA devices.

Only PCI-backed interfaces are devices. Virtual interfaces (lo, bridges, veth, bonds) live
under /sys/devices/virtual and are never handed to a pod, and neither is any interface an
operator excludes or the one carrying the node's default route: giving away the
management NIC would cut the node off the cluster.
"""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from driver.kube import names
from driver.devices import pci
from driver.devices.model import AttributeSet, Device, DeviceKind
from driver.devices.pciids import PciIds
from driver.devices.problems import DeviceError, Problem, Problems

RDMA_CM = "/dev/infiniband/rdma_cm"


@dataclass(frozen=True)
class NicSelector:
    """One include/exclude rule: `eth*` (interface name glob), `vendor=0x15b3` or
    `pci=0000:3b:*` (PCI address glob)."""

    field: str  # "name" | "vendor" | "pci"
    pattern: str

    @classmethod
    def parse(cls, text: str) -> "NicSelector":
        text = text.strip()
        key, sep, value = text.partition("=")
        if not sep:
            key, value = "name", text
        key = key.strip().lower()
        value = value.strip().lower() if key != "name" else value.strip()
        if key not in ("name", "vendor", "pci") or not value:
            raise ValueError(
                f"NIC selector {text!r}: use NAME-GLOB, vendor=0xVVVV or pci=BDF-GLOB"
            )
        if key == "vendor":
            try:
                value = f"0x{int(value, 16):04x}"
            except ValueError as err:
                raise ValueError(f"NIC selector {text!r}: vendor must be hex") from err
        return cls(key, value)

    def matches(self, ifname: str, function: pci.PciFunction) -> bool:
        if self.field == "name":
            return fnmatch.fnmatchcase(ifname, self.pattern)
        if self.field == "vendor":
            return pci.hex_id(function.vendor) == self.pattern
        return fnmatch.fnmatchcase(function.bdf, self.pattern)

    def __str__(self) -> str:
        return self.pattern if self.field == "name" else f"{self.field}={self.pattern}"


ROUTING_UNKNOWN = "the node's routing table cannot be read"


@dataclass(frozen=True)
class NicFilter:
    include: tuple[NicSelector, ...] = ()  # empty: every physical NIC
    exclude: tuple[NicSelector, ...] = ()
    exclude_default_route: bool = True

    def reason_to_skip(
        self, ifname: str, function: pci.PciFunction, default_route: set[str] | None
    ) -> str | None:
        for rule in self.exclude:
            if rule.matches(ifname, function):
                return f"excluded by NIC filter {rule}"
        if self.include and not any(r.matches(ifname, function) for r in self.include):
            return "not matched by any NIC include filter"
        if self.exclude_default_route and default_route is None:
            # Fail closed: giving away the management NIC cuts the node off.
            return (f"{ROUTING_UNKNOWN}, so this NIC might carry the default route (set "
                    "--nic-allow-default-route to publish anyway)")
        if self.exclude_default_route and ifname in default_route:
            return "carries the node's default route (management NIC)"
        return None


def route_table(proc: Path, name: str) -> Path:
    """The host's routing table: /proc/1/net/... is PID 1's network namespace, which is the
    host's also when the driver runs in a pod of its own network namespace with the host's
    /proc mounted (/proc/net would be our own namespace there). Captured trees without
    PIDs fall back to /proc/net."""
    host = proc / "1" / "net" / name
    return host if (proc / "1").is_dir() else proc / "net" / name


def default_route_interfaces(proc: Path) -> set[str] | None:
    """Interfaces with an IPv4 or IPv6 default route, from the host's net/{route,
    ipv6_route}; None when the IPv4 table cannot be read (nothing is known then)."""
    found: set[str] = set()
    text = pci.read_text(route_table(proc, "route"))
    if text is None:
        return None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            found.add(fields[0])
    text = pci.read_text(route_table(proc, "ipv6_route")) or ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 10 and fields[0] == "0" * 32 and fields[1] == "00" and fields[9] != "lo":
            found.add(fields[9])
    return found


@dataclass(frozen=True)
class NicOutcome:
    """What discovery made of one interface, kept for the next discovery to reuse."""

    ifname: str
    link: str | None  # its /sys/class/net symlink's target: where it sits
    bdf: str | None  # None: not a PCI function's interface (virtual, USB, dangling)
    device: Device | None = None
    excluded: str | None = None  # the reason it is not published
    withheld: bool = False  # excluded because the routing table is unreadable
    problems: tuple[Problem, ...] = ()


@dataclass
class NicMemo:
    """The last NIC discovery, by interface; reusable while its inputs are unchanged."""

    outcomes: dict[str, NicOutcome] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # bdf -> ifnames, port order
    shared: tuple = ()  # (default-route interfaces, filter): every NIC reads them
    uverbs: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # entry -> (link, ibdev)


def _readlink(path: str) -> str | None:
    # Strings, not Paths: called for every interface and uverbs entry of every discovery,
    # where pathlib's object building cost more than the system call.
    try:
        return os.readlink(path)
    except OSError:
        return None


def uverbs_owner(link: str | None) -> str | None:
    """The PCI function of a uverbs entry, from its link (`.../0000:17:00.2/infiniband_verbs/uverbs3`)."""
    parts = (link or "").split("/")
    for part in reversed(parts):
        if pci.BDF.match(part):
            return part
    return None


class NicDiscovery:
    """With `previous` (the last run's memo), an interface is rebuilt only when its link,
    its function's group of interfaces, or an input every NIC reads changed, or when
    `fresh_interfaces`/`fresh_functions` (what uevents named) name it or its function."""

    def __init__(self, sysfs: Path, proc: Path, nic_filter: NicFilter,
                 functions: dict[str, pci.PciFunction] | None = None,
                 pci_ids: PciIds | None = None, previous: NicMemo | None = None,
                 fresh_interfaces: frozenset[str] = frozenset(),
                 fresh_functions: frozenset[str] = frozenset()) -> None:
        self.sysfs = sysfs
        self.pci_ids = pci_ids or PciIds(())
        self.proc = proc
        self.filter = nic_filter
        self.functions = functions or {}  # already read by the caller
        self.excluded: list[tuple[str, str]] = []  # (interface, reason), for the caller's log
        self.withheld_routing_unknown = 0  # NICs not published because routes are unreadable
        self._vf_indices: dict[Path, dict[Path, int]] = {}  # PF path -> {VF path: index}
        self.previous = previous or NicMemo()
        self.fresh_interfaces = fresh_interfaces
        self.fresh_functions = fresh_functions
        self.memo = NicMemo()  # this run's, for the next

    def discover(self, problems: Problems) -> list[Device]:
        class_net = self.sysfs / "class" / "net"
        try:
            interfaces = sorted(os.listdir(class_net))
        except OSError:
            return []
        devices_root = (self.sysfs / "devices").resolve()
        virtual = devices_root / "virtual"
        by_function: dict[str, list[str]] = defaultdict(list)
        outcomes = self.memo.outcomes
        links: dict[str, str | None] = {}  # interfaces found (again) to be a function's
        net_dir = str(class_net)
        for ifname in interfaces:
            known = self.previous.outcomes.get(ifname)
            # Not named by a uevent nor by the fingerprint, which compares every
            # interface's link: where it leads is what it was (a name another device took
            # comes with a remove and an add, which name it).
            if known is not None and ifname not in self.fresh_interfaces:
                if known.bdf is None:
                    outcomes[ifname] = known
                    problems.items.extend(known.problems)
                else:
                    by_function[known.bdf].append(ifname)
                continue
            link = _readlink(f"{net_dir}/{ifname}")
            resolved = (class_net / ifname).resolve()
            if resolved.is_relative_to(virtual):
                outcomes[ifname] = NicOutcome(ifname, link, None)
                continue
            device_link = class_net / ifname / "device"
            if not device_link.exists():
                found = ()
                if device_link.is_symlink():
                    found = (Problem(ifname, f"dangling device link {device_link}", skipped=True),)
                    problems.items.extend(found)
                outcomes[ifname] = NicOutcome(ifname, link, None, problems=found)
                continue
            bdf = pci.bdf_of(self.sysfs, device_link.resolve(), devices_root)
            if bdf is None:  # not PCI (USB, platform): nothing we can hand to a pod safely
                outcomes[ifname] = NicOutcome(ifname, link, None)
                continue
            by_function[bdf].append(ifname)
            links[ifname] = link

        uverbs = self._uverbs_by_ibdev()
        # A uverbs device belongs to one function's RDMA device: one that came, went or
        # moved makes that function's NICs be read again, not every NIC.
        moved = {e for e in self.memo.uverbs.keys() | self.previous.uverbs.keys()
                 if self.memo.uverbs.get(e) != self.previous.uverbs.get(e)}
        owners = {uverbs_owner(known[0]) for e in moved
                  for known in (self.memo.uverbs.get(e), self.previous.uverbs.get(e)) if known is not None}
        default_route = default_route_interfaces(self.proc)
        self.memo.shared = (default_route, self.filter)
        shared_unchanged = self.previous.shared == self.memo.shared and None not in owners
        devices: list[Device] = []
        for bdf, ifnames in sorted(by_function.items()):
            known_order = self.previous.groups.get(bdf)
            if (shared_unchanged and bdf not in self.fresh_functions and bdf not in owners
                    and bdf in self.functions
                    and known_order is not None and sorted(known_order) == ifnames
                    and not any(i in links for i in ifnames)):
                # Nothing this function's interfaces read changed: last run's outcomes.
                self.memo.groups[bdf] = known_order
                for ifname in known_order:
                    self._record(self.previous.outcomes[ifname], problems, devices)
                continue
            try:
                function = self.functions.get(bdf) or pci.read_function(self.sysfs, bdf, devices_root)
            except DeviceError as err:
                problems.skip(", ".join(ifnames), str(err))  # not kept: read again next time
                continue
            # dev_port only matters (and is only read) when one function has several netdevs.
            ports = sorted(ifnames, key=lambda n: (self._dev_port(n), n)) if len(ifnames) > 1 else ifnames
            self.memo.groups[bdf] = tuple(ports)
            for ifname in ports:
                found = Problems()
                outcome = self._outcome(ifname, bdf, ports, function, uverbs, default_route, found)
                link = links[ifname] if ifname in links else self.previous.outcomes[ifname].link
                outcome = NicOutcome(ifname, link, bdf, *outcome, tuple(found.items))
                self._record(outcome, problems, devices)
        return devices

    def _record(self, outcome: NicOutcome, problems: Problems, devices: list[Device]) -> None:
        self.memo.outcomes[outcome.ifname] = outcome
        problems.items.extend(outcome.problems)
        if outcome.excluded is not None:
            self.excluded.append((outcome.ifname, outcome.excluded))
            if outcome.withheld:
                self.withheld_routing_unknown += 1
        if outcome.device is not None:
            devices.append(outcome.device)

    def _outcome(self, ifname: str, bdf: str, ports: list[str], function: pci.PciFunction,
                 uverbs: dict[str, str], default_route: set[str] | None,
                 problems: Problems) -> tuple[Device | None, str | None, bool]:
        reason = self.filter.reason_to_skip(ifname, function, default_route)
        if reason:
            return None, reason, default_route is None and reason.startswith(ROUTING_UNKNOWN)
        name = names.label_from_pci("nic", bdf)
        if len(ports) > 1:
            name = f"{name}-port{self._dev_port(ifname)}"
        try:
            return self._nic(name, ifname, function, uverbs, problems), None, False
        except (DeviceError, ValueError) as err:
            problems.skip(name, f"interface {ifname}: {err}")
            return None, None, False

    def _dev_port(self, ifname: str) -> int:
        value = pci.read_int(self.sysfs / "class" / "net" / ifname / "dev_port")
        return value if value is not None else 0

    def _uverbs_by_ibdev(self) -> dict[str, str]:
        directory = self.sysfs / "class" / "infiniband_verbs"
        mapping: dict[str, str] = {}
        try:
            entries = sorted(os.listdir(directory))
        except OSError:
            return mapping
        for entry in entries:
            if not entry.startswith("uverbs"):
                continue
            known = self.previous.uverbs.get(entry)
            if (known is not None and known[0] is not None
                    and uverbs_owner(known[0]) not in self.fresh_functions):
                # Its function is not to be read again: the entry is where it was (the
                # fingerprint compares every entry's link and names both functions of one
                # that moved; uevents name a function whose RDMA device came or went).
                link, ibdev = known
            else:
                # A uverbs entry's ibdev is fixed while its link (the device it belongs to) is.
                link = _readlink(f"{directory}/{entry}")
                ibdev = known[1] if known is not None and link is not None and known[0] == link \
                    else pci.read_text(directory / entry / "ibdev")
            self.memo.uverbs[entry] = (link, ibdev)
            if ibdev:
                mapping[ibdev] = entry
        return mapping

    def _nic(
        self,
        name: str,
        ifname: str,
        function: pci.PciFunction,
        uverbs: dict[str, str],
        problems: Problems,
    ) -> Device:
        net = self.sysfs / "class" / "net" / ifname
        attrs = AttributeSet(name)
        attrs.set("type", "nic")
        attrs.set("ifName", ifname)
        mac = pci.read_text(net / "address")
        attrs.set("mac", mac)
        mtu = pci.read_int(net / "mtu")
        if mtu is None:
            problems.note(name, f"interface {ifname}: mtu unreadable")
        attrs.set("mtu", mtu)
        attrs.set("linkState", pci.read_text(net / "operstate"))
        speed = pci.read_int(net / "speed")
        # -1 or EINVAL: the link is down or the driver does not say; no value beats a lie.
        attrs.set("speedMbps", speed if speed is not None and speed > 0 else None)
        # The network driver of the interface: for virtio that is virtio_net on the virtio
        # device, not virtio-pci, the transport bound to the PCI function.
        attrs.set("netDriver", pci.link_name(net / "device" / "driver") or function.driver)
        attrs.set("pciVendorID", pci.hex_id(function.vendor))
        attrs.set("pciDeviceID", pci.hex_id(function.device))
        attrs.set("productName", self.pci_ids.product(function.vendor, function.device))

        total_vfs = pci.read_int(function.path / "sriov_totalvfs")
        physfn = function.path / "physfn"
        if physfn.is_symlink():
            pf_path = physfn.resolve()
            attrs.set("sriovVF", True)
            attrs.set("pfPciBusID", pf_path.name)
            attrs.set("vfIndex", self._vf_index(pf_path, function.path))
        else:
            attrs.set("sriovVF", False)
            if total_vfs:
                attrs.set("sriovTotalVFs", total_vfs)
                attrs.set("sriovNumVFs", pci.read_int(function.path / "sriov_numvfs"))

        nodes: list[str] = []
        ibdevs = sorted(p.name for p in (function.path / "infiniband").glob("*"))
        if ibdevs:
            ibdev = ibdevs[0]
            attrs.set("rdma", True)
            attrs.set("rdmaDevice", ibdev)
            if ibdev in uverbs:
                nodes = [f"/dev/infiniband/{uverbs[ibdev]}", RDMA_CM]
            else:
                problems.note(name, f"RDMA device {ibdev} has no uverbs character device")
        else:
            attrs.set("rdma", False)
        attrs.pci(function.location)
        for dropped in attrs.dropped:
            problems.note(name, f"attribute dropped: {dropped}")
        return Device(
            name=name,
            kind=DeviceKind.NIC,
            attributes=attrs.values,
            device_nodes=tuple(nodes),
            net_interface=ifname,
            pci=function.location,
            model=attrs.values.get("productName") or pci.hex_id(function.device),
        )

    def _vf_index(self, pf_path: Path, vf_path: Path) -> int | None:
        # Built once per PF: resolving every virtfnN link for every VF is quadratic, and a
        # node with 16 PFs x 127 VFs would spend seconds on it.
        if pf_path not in self._vf_indices:
            indices: dict[Path, int] = {}
            for link in pf_path.glob("virtfn*"):
                suffix = link.name.removeprefix("virtfn")
                if suffix.isdigit():
                    indices[link.resolve()] = int(suffix)
            self._vf_indices[pf_path] = indices
        return self._vf_indices[pf_path].get(vf_path)
