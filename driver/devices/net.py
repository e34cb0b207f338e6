"""Network functions through sysfs: physical NICs, SR-IOV VFs and their RDMA devices.

Only PCI-backed interfaces are devices. Virtual interfaces (lo, bridges, veth, bonds) live
under /sys/devices/virtual and are never handed to a pod, and neither is any interface an
operator excludes or the one carrying the node's default route: giving away the
management NIC would cut the node off the cluster.

Interfaces are found through /sys/class/net, which lists only those in the host's network
namespace. A NIC the driver moved into a pod is found through its PCI function instead
(network class, a netdev-making driver bound) joined with its move record (`AwayNetdev`).
"""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from driver.kube import names
from driver.devices import pci
from driver.devices.model import AttributeSet, AttributeValue, Device, DeviceKind
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

# What a NIC publishes from its netdev's own sysfs directory (/sys/class/net/<if>), in the
# order discovery sets them; the rest comes from its PCI function.
NETDEV_ATTRIBUTES = ("ifName", "mac", "mtu", "linkState", "speedMbps", "netDriver")


@dataclass(frozen=True)
class AwayNetdev:
    """A NIC whose netdev the driver moved into a pod's network namespace (its move record,
    driver/nri/netdev.py). sysfs shows a netdev only to the network namespace it is in:
    /sys/class/net/<if> and /sys/bus/pci/devices/<bdf>/net/<if> are tagged with it
    (the kernel's Documentation/networking/sysfs-tagging.rst), so the host's sysfs lists
    the function but no netdev of it. Discovery publishes such a NIC from its function and
    from what the record kept: it is allocated, not gone."""

    device: str  # our device name: nic-0000-41-00-2, or ...-portN for one port of several
    ifname: str  # the name it had and gets back on the host
    mac: str
    mtu: int
    # NETDEV_ATTRIBUTES as discovery published them before the move; empty for a record
    # of a driver that did not keep them (then ifName, mac and mtu come from the record).
    published: tuple[tuple[str, AttributeValue], ...] = ()
    rdma_device: str | None = None  # moved with it (RDMA exclusive netns mode)

    def netdev_attributes(self) -> dict[str, AttributeValue]:
        if self.published:
            return {k: v for k, v in self.published if k in NETDEV_ATTRIBUTES}
        return {"ifName": self.ifname, "mac": self.mac, "mtu": self.mtu}


# Bound to one of these, a network function has no netdev in any namespace (dranet keeps
# the same list): nothing of it can be handed to a pod as a NIC.
NO_NETDEV_DRIVERS = frozenset({"vfio-pci", "uio_pci_generic", "igb_uio", "pci-stub"})


def holds_netdevs(function: pci.PciFunction) -> bool:
    """A network controller (PCI base class 0x02: Ethernet 0x0200, InfiniBand 0x0207, ...)
    bound to a kernel driver that makes netdevs: what the host may see no netdev of while
    the netdev is in another namespace. The driver link is not namespaced."""
    return (function.base_class == pci.CLASS_NETWORK and function.driver is not None
            and function.driver not in NO_NETDEV_DRIVERS)


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
                 fresh_functions: frozenset[str] = frozenset(),
                 away: tuple[AwayNetdev, ...] = ()) -> None:
        self.sysfs = sysfs
        self.away = away
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

        away = self._away_by_function(by_function)
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
        for bdf, moved_away in sorted(away.items()):
            self._publish_away(bdf, moved_away, uverbs, default_route, problems, devices)
        for bdf, ifnames in sorted(by_function.items()):
            known_order = self.previous.groups.get(bdf)
            if (shared_unchanged and bdf not in self.fresh_functions and bdf not in owners
                    and bdf not in away
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
            # A port in a pod still counts: the others keep their -portN names.
            several = len(ports) + len(away.get(bdf, ())) > 1
            for ifname in ports:
                found = Problems()
                outcome = self._outcome(ifname, bdf, several, function, uverbs, default_route, found)
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

    def _away_by_function(self, visible: dict[str, list[str]]) -> dict[str, list[AwayNetdev]]:
        """The moved NICs to publish, by function: those whose function is still a network
        function with a netdev-making driver and whose netdev the host does not see (one
        it sees again, under any name, is read from sysfs as any other)."""
        found: dict[str, list[AwayNetdev]] = defaultdict(list)
        if not self.away:
            return found
        by_label = {names.label_from_pci("nic", bdf): bdf for bdf, f in self.functions.items()
                    if holds_netdevs(f)}
        # One device per name: a stale record (a pod that died while we were down, not
        # yet reconciled) beside the current one names the same device.
        for record in {r.device: r for r in reversed(self.away)}.values():
            label, _, port = record.device.partition("-port")
            bdf = by_label.get(label)
            if port and not port.isdigit():
                continue
            if bdf is None or record.ifname in visible.get(bdf, ()):
                continue
            if bdf not in visible or record.device != label:  # one port of several may go
                found[bdf].append(record)
        return found

    def _publish_away(self, bdf: str, moved: list[AwayNetdev], uverbs: dict[str, str],
                      default_route: set[str] | None, problems: Problems,
                      devices: list[Device]) -> None:
        """Not memoized: a handful of reads per moved NIC, and its return must be read from
        sysfs afresh (it comes back as an interface no memo knows). Its name is the one
        the record kept: the one the claim was allocated."""
        function = self.functions[bdf]
        for record in moved:
            found = Problems()
            reason = self.filter.reason_to_skip(record.ifname, function, default_route)
            if reason:
                self.excluded.append((record.ifname, reason))
                if default_route is None and reason.startswith(ROUTING_UNKNOWN):
                    self.withheld_routing_unknown += 1
                continue
            try:
                devices.append(self._nic(record.device, record.ifname, function, uverbs, found,
                                         record))
            except (DeviceError, ValueError) as err:
                found.skip(record.device, f"interface {record.ifname} (in a pod): {err}")
            problems.items.extend(found.items)

    def _outcome(self, ifname: str, bdf: str, several: bool, function: pci.PciFunction,
                 uverbs: dict[str, str], default_route: set[str] | None,
                 problems: Problems) -> tuple[Device | None, str | None, bool]:
        reason = self.filter.reason_to_skip(ifname, function, default_route)
        if reason:
            return None, reason, default_route is None and reason.startswith(ROUTING_UNKNOWN)
        name = names.label_from_pci("nic", bdf)
        if several:
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
        away: AwayNetdev | None = None,
    ) -> Device:
        attrs = AttributeSet(name)
        attrs.set("type", "nic")
        if away is not None:
            # In a pod: its sysfs directory is out of our sight, and what it was on the
            # host is what it gets back; publishing that keeps the slice as it was.
            for key, value in away.netdev_attributes().items():
                attrs.set(key, value)
        else:
            self._netdev_attributes(attrs, name, ifname, function, problems)
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
        if not ibdevs and away is not None and away.rdma_device:
            # Exclusive netns mode: the RDMA device went along and <bdf>/infiniband is
            # tagged with the namespace too; its uverbs entry is not.
            ibdevs = [away.rdma_device]
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

    def _netdev_attributes(self, attrs: AttributeSet, name: str, ifname: str,
                           function: pci.PciFunction, problems: Problems) -> None:
        """NETDEV_ATTRIBUTES, from the netdev's sysfs directory."""
        net = self.sysfs / "class" / "net" / ifname
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
