"""Moving a claimed NIC's netdev into a pod's network namespace and back, over netlink.

attach: note the interface's host settings (name, MTU, addresses, up, MAC) in a record
on disk BEFORE touching it, move it into the pod's namespace under its pod name in one
netlink request (a name taken in the host does not matter then), set MTU, addresses and
routes there, bring it up, and mark the record "moved" with what the pod got.

detach: find it in the pod's namespace by name and MAC, move it back under its host
name, restore its MTU, addresses and link state, delete the record.

A crash between the two leaves the record. `reconcile` (at start, and for every pod the
runtime no longer knows) brings such interfaces back. When a pod's namespace is
destroyed the kernel hands a physical netdev back to the host namespace by itself,
possibly under another name (`devN` when its own is taken), so the host is searched by
MAC; a virtual one (the mock's veth or dummy) is destroyed with the namespace and is
re-created through `recreate`.

Moving a netdev flushes its addresses (the kernel re-registers it), so the host's must be
put back, and the pod's never travel back with it.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import structlog
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from driver.devices.model import AttributeValue
from driver.devices.net import NETDEV_ATTRIBUTES, AwayNetdev
from driver.nri import rdma
from driver.state import atomic

log = structlog.get_logger("driver.nri.netdev")

RECORD_VERSION = 1
T = TypeVar("T")
IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
IFF_UP = 0x1


class NetdevError(Exception):
    """A move that cannot be done; the message names the device and the pod."""


@dataclass(frozen=True)
class Route:
    destination: str  # CIDR, or "default"
    gateway: str | None = None


@dataclass(frozen=True)
class InterfaceConfig:
    """What the pod's interface gets (from the claim's opaque config)."""
    name: str | None = None  # None: keep the host's name
    addresses: tuple[str, ...] = ()  # CIDRs, "10.1.0.5/24" or "fd00::5/64"
    mtu: int | None = None
    routes: tuple[Route, ...] = ()


@dataclass(frozen=True)
class Placement:
    claim_uid: str
    device: str  # our device name, nic-0000-41-00-2
    host_ifname: str
    pod_uid: str
    pod: str  # namespace/name, for messages
    netns: str
    config: InterfaceConfig = field(default_factory=InterfaceConfig)
    rdma_device: str | None = None  # the netdev's RDMA device (mlx5_3), if it has one


@dataclass(frozen=True)
class NetworkData:
    """Claim status networkData: what the pod sees."""
    interface_name: str
    ips: tuple[str, ...]
    hardware_address: str


@dataclass
class HostSettings:
    name: str
    mtu: int
    addresses: list[str]
    up: bool
    mac: str


@dataclass
class Record:
    claim_uid: str
    device: str
    pod_uid: str
    pod: str
    netns: str
    pod_ifname: str
    host: HostSettings
    state: str  # "moving" (written before the move) | "moved"
    network: dict | None = None
    version: int = RECORD_VERSION
    # the RDMA device that goes with the netdev (the RDMA subsystem in exclusive netns
    # mode); None: it stays (shared mode, or none)
    rdma_device: str | None = None
    # What discovery published of the netdev (net.NETDEV_ATTRIBUTES) before it left: the
    # host's sysfs cannot show it while it is in the pod, and the NIC stays published as
    # it was (AwayNetdevs). None in records of drivers that did not keep it.
    published: dict | None = None

    @classmethod
    def load(cls, path: Path) -> "Record":
        data = json.loads(path.read_bytes())
        data["host"] = HostSettings(**data["host"])
        return cls(**data)

    def away(self) -> AwayNetdev:
        published = tuple((k, v) for k, v in (self.published or {}).items()
                          if k in NETDEV_ATTRIBUTES and isinstance(v, (bool, int, str)))
        return AwayNetdev(self.device, self.host.name, self.host.mac, self.host.mtu, published,
                          self.rdma_device)


class AwayNetdevs:
    """The NICs the records say are (or are being) moved into pods, for discovery and the
    health probe (driver/service/assembly.py wires them): the host's sysfs no longer shows their
    netdevs. A record is written before its netdev moves and removed after it is back, so
    no moment has the netdev gone without a record saying why.

    Called by the health probe every few seconds: a record file is parsed again only when
    it was replaced (atomic writes make a new file: another inode, or an inode number
    reused with another mtime or size), so a call costs a directory read and a stat per
    record."""

    def __init__(self, records: Path) -> None:
        self.records = records
        self._lock = threading.Lock()  # discovery's and the probe's threads
        # file -> ((inode, mtime, size), parsed)
        self._parsed: dict[str, tuple[tuple[int, int, int], AwayNetdev | None]] = {}

    def __call__(self) -> tuple[AwayNetdev, ...]:
        files: dict[str, tuple[int, int, int]] = {}
        try:
            with os.scandir(self.records) as entries:
                for e in entries:
                    if e.name.endswith(".json"):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue  # removed since the listing: back on the host
                        files[e.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            pass
        with self._lock:
            for name in self._parsed.keys() - files.keys():
                del self._parsed[name]
            for name, identity in files.items():
                known = self._parsed.get(name)
                if known is None or known[0] != identity:
                    self._parsed[name] = (identity, self._parse(self.records / name))
            return tuple(sorted((a for _, a in self._parsed.values() if a is not None),
                                key=lambda a: a.device))

    @staticmethod
    def _parse(path: Path) -> AwayNetdev | None:
        try:
            return Record.load(path).away()
        except FileNotFoundError:
            return None  # removed between the listing and the read: back on the host
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            log.error("nic_record_unreadable", file=str(path), error=str(err))
            return None


def record_name(pod_uid: str, device: str) -> str:
    return f"{pod_uid}_{device}.json"


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def made_in(netns: str | None, make: Callable[[], T]) -> T:
    """`make()` (a socket) with this thread switched into `netns` (a path:
    /var/run/netns/x, /proc/PID/ns/net; None: ours) for the moment of its creation: a
    socket stays in the namespace it was made in. That is pyroute2's own netns= way
    without its fork of the whole process, which costs twice the time and forks a process
    that holds gRPC's threads. A missing namespace is an error, never created (pyroute2's
    netns= would create it)."""
    if not netns:
        return make()
    target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            return make()
        finally:
            _setns(own)  # raises if this thread cannot get home: never carry on there
    finally:
        os.close(target)
        os.close(own)


@contextmanager
def netlink(netns: str | None) -> Iterator[IPRoute]:
    """A netlink (route) socket in `netns` (see made_in)."""
    ipr = made_in(netns, IPRoute)
    try:
        yield ipr
    finally:
        ipr.close()


def rdma_netlink(netns: str | None) -> rdma.RdmaNetlink:
    """An RDMA netlink socket in `netns` (see made_in); RdmaError where the kernel has none."""
    return made_in(netns, rdma.RdmaNetlink.open)


def _link(ipr: IPRoute, name: str | None = None, mac: str | None = None) -> dict | None:
    for link in ipr.get_links():
        if name is not None and link.get("ifname") != name:
            continue
        if mac is not None and (link.get("address") or "").lower() != mac.lower():
            continue
        return {"index": link["index"], "ifname": link.get("ifname"), "mtu": link.get("mtu"),
                "mac": (link.get("address") or "").lower(),
                "up": bool(link["flags"] & IFF_UP)}
    return None


def _addresses(ipr: IPRoute, index: int) -> list[str]:
    out = []
    for msg in ipr.get_addr(index=index):
        address = msg.get("address")
        if address is None:
            continue
        ip = ipaddress.ip_address(address)
        if ip.version == 6 and ip.is_link_local:
            continue  # the kernel makes these itself
        out.append(f"{address}/{msg['prefixlen']}")
    return sorted(out)


def _add_address(ipr: IPRoute, index: int, cidr: str) -> None:
    interface = ipaddress.ip_interface(cidr)
    try:
        ipr.addr("add", index=index, address=str(interface.ip),
                 prefixlen=interface.network.prefixlen)
    except NetlinkError as err:
        if err.code != errno.EEXIST:
            raise


def _namespace_fd(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


class NetdevMover:
    """Blocking netlink work: call from a thread (asyncio.to_thread)."""

    def __init__(self, records: Path, host_netns: str | None = None,
                 recreate: Callable[[HostSettings], None] | None = None,
                 owner: str | None = None,
                 rdma_open: Callable[[str | None], rdma.RdmaNetlink] = rdma_netlink,
                 published_of: Callable[[str], dict[str, AttributeValue] | None] = lambda _: None,
                 host_changed: Callable[[], None] | None = None) -> None:
        self.records = records
        # our device name -> its attributes as published now (kept in the record)
        self.published_of = published_of
        # Called after netdevs left or came back to the host namespace. A kernel updates
        # sysfs by itself; the mock mirrors its namespace into its sysfs tree here
        # (driver/nri/mocknet.py), so that everything reading sysfs runs as on a node.
        self.host_changed = host_changed
        self.rdma_open = rdma_open
        self._rdma_mode: str | None = None
        # Where our NICs live when no pod has them: the driver's namespace (None) on a
        # real node, the namespace the mock owns in mock mode.
        self.host_netns = host_netns
        self.recreate = recreate
        self.owner = owner

    def rdma_mode(self) -> str:
        """The host's RDMA netns mode, read once: "exclusive", or "shared" (also where the
        kernel has no RDMA netlink: then there are no RDMA devices to move)."""
        if self._rdma_mode is None:
            try:
                with self.rdma_open(self.host_netns) as nl:
                    self._rdma_mode = nl.netns_mode()
            except (rdma.RdmaError, OSError) as err:
                log.info("rdma_netlink_unavailable", error=str(err))
                self._rdma_mode = rdma.SHARED
            log.info("rdma_netns_mode", mode=self._rdma_mode)
        return self._rdma_mode

    def _path(self, pod_uid: str, device: str) -> Path:
        return self.records / record_name(pod_uid, device)

    def _save(self, record: Record) -> None:
        atomic.write(self._path(record.pod_uid, record.device),
                     json.dumps(asdict(record), sort_keys=True).encode(), mode=0o600,
                     owner=self.owner)

    def load_records(self) -> list[Record]:
        out = []
        for path in sorted(self.records.glob("*.json")):
            try:
                out.append(Record.load(path))
            except (OSError, ValueError, TypeError, KeyError) as err:
                log.error("nic_record_unreadable", file=str(path), error=str(err))
        return out

    def attach(self, placement: Placement) -> NetworkData:
        """Move the NIC into the pod. Idempotent: a NIC already moved for this pod (a
        re-sent RunPodSandbox, a driver restart) answers with what the pod has."""
        fields = {"claim": placement.claim_uid, "device": placement.device,
                  "pod": placement.pod, "pod_uid": placement.pod_uid}
        pod_ifname = placement.config.name or placement.host_ifname
        path = self._path(placement.pod_uid, placement.device)
        if path.exists():
            record = Record.load(path)
            if record.state == "moved" and record.network and record.netns == placement.netns:
                with netlink(placement.netns) as pod_ns:
                    if _link(pod_ns, record.pod_ifname, record.host.mac) is not None:
                        return NetworkData(**{**record.network,
                                              "ips": tuple(record.network["ips"])})
            self.detach(placement.pod_uid, placement.device)  # half done: start over

        with netlink(self.host_netns) as host:
            link = _link(host, placement.host_ifname)
            if link is None:
                raise NetdevError(f"claim {placement.claim_uid}: device {placement.device}: "
                                  f"interface {placement.host_ifname} is not on the host "
                                  f"(is another pod using it?)")
            settings = HostSettings(name=placement.host_ifname, mtu=link["mtu"],
                                    addresses=_addresses(host, link["index"]),
                                    up=link["up"], mac=link["mac"])
            rdma_device = placement.rdma_device if placement.rdma_device and \
                self.rdma_mode() == rdma.EXCLUSIVE else None
            published = self.published_of(placement.device)
            record = Record(claim_uid=placement.claim_uid, device=placement.device,
                            pod_uid=placement.pod_uid, pod=placement.pod,
                            netns=placement.netns, pod_ifname=pod_ifname, host=settings,
                            state="moving", rdma_device=rdma_device,
                            published={k: v for k, v in (published or {}).items()
                                       if k in NETDEV_ATTRIBUTES} or None)
            self._save(record)  # before anything changes: a crash from here on is undone
            try:
                fd = _namespace_fd(placement.netns)
            except OSError as err:
                atomic.remove(path)
                hint = (" (the driver sees only the namespace directories mounted into it: chart "
                        "value nri.netnsDirs)" if err.errno == errno.ENOENT else "")
                raise NetdevError(f"claim {placement.claim_uid}: pod {placement.pod}: network "
                                  f"namespace {placement.netns}: {err.strerror}{hint}") from err
            try:
                if link["up"]:
                    host.link("set", index=link["index"], state="down")
                host.link("set", index=link["index"], net_ns_fd=fd, ifname=pod_ifname)
            except NetlinkError as err:
                # The kernel moves first and renames after: a name taken in the pod fails
                # with the netdev already there under its host name. Fetch it back.
                self._return(record)
                atomic.remove(path)
                raise NetdevError(f"claim {placement.claim_uid}: device {placement.device}: "
                                  f"moving {placement.host_ifname} into pod {placement.pod} "
                                  f"as {pod_ifname}: {err.args[1] if len(err.args) > 1 else err}"
                                  ) from err
            finally:
                os.close(fd)
        self._host_changed()
        if record.rdma_device:
            self._move_rdma(placement, record)
        try:
            network = self._configure_in_pod(placement, record)
        except (NetlinkError, ValueError, NetdevError) as err:
            self.detach(placement.pod_uid, placement.device)
            reason = err.args[1] if isinstance(err, NetlinkError) and len(err.args) > 1 else err
            raise NetdevError(f"claim {placement.claim_uid}: device {placement.device}: "
                              f"configuring {pod_ifname} in pod {placement.pod}: {reason}"
                              ) from err
        record.state = "moved"
        record.network = {**asdict(network), "ips": list(network.ips)}
        self._save(record)
        log.info("nic_moved_into_pod", interface=pod_ifname, ips=list(network.ips), **fields)
        return network

    def _move_rdma(self, placement: Placement, record: Record) -> None:
        """The netdev's RDMA device into the pod too (exclusive mode): without it verbs and
        RoCE in the pod see no device."""
        try:
            fd = _namespace_fd(placement.netns)
            try:
                with self.rdma_open(self.host_netns) as nl:
                    nl.move(record.rdma_device, fd)
            finally:
                os.close(fd)
        except (rdma.RdmaError, OSError) as err:
            self.detach(placement.pod_uid, placement.device)
            raise NetdevError(f"claim {placement.claim_uid}: device {placement.device}: moving RDMA "
                              f"device {record.rdma_device} into pod {placement.pod}: {err}") from err
        log.info("rdma_device_moved_into_pod", rdma_device=record.rdma_device, claim=placement.claim_uid,
                 device=placement.device, pod=placement.pod)

    def _configure_in_pod(self, placement: Placement, record: Record) -> NetworkData:
        config = placement.config
        with netlink(placement.netns) as pod_ns:
            link = _link(pod_ns, record.pod_ifname, record.host.mac)
            if link is None:
                raise NetdevError(f"{record.pod_ifname} did not arrive in {placement.netns}")
            index = link["index"]
            if config.mtu is not None:
                pod_ns.link("set", index=index, mtu=config.mtu)
            for cidr in config.addresses:
                _add_address(pod_ns, index, cidr)
            pod_ns.link("set", index=index, state="up")
            for route in config.routes:
                spec: dict = {"oif": index}
                if route.destination != "default":
                    spec["dst"] = route.destination
                elif route.gateway and ipaddress.ip_address(route.gateway).version == 6:
                    spec["family"] = 10
                if route.gateway:
                    spec["gateway"] = route.gateway
                pod_ns.route("add", **spec)
            ips = tuple(_addresses(pod_ns, index))
        return NetworkData(interface_name=record.pod_ifname, ips=ips,
                           hardware_address=record.host.mac)

    def detach(self, pod_uid: str, device: str) -> bool:
        """Bring the NIC back to the host as it was; False when no record says it left."""
        path = self._path(pod_uid, device)
        try:
            record = Record.load(path)
        except FileNotFoundError:
            return False
        self._return(record)
        atomic.remove(path)
        log.info("nic_returned_to_host", claim=record.claim_uid, device=record.device,
                 pod=record.pod, pod_uid=record.pod_uid, interface=record.host.name)
        return True

    def _return(self, record: Record) -> None:
        try:
            fd = _namespace_fd(record.netns)
        except OSError:
            fd = None  # the namespace is gone: the kernel decided where the netdev went
        if fd is not None:
            try:
                self._return_netdev(record)
                if record.rdma_device:
                    self._return_rdma(record)
            finally:
                os.close(fd)
        # (a namespace that is gone has handed its RDMA devices back to the initial one)
        try:
            self._restore_on_host(record)
        finally:
            self._host_changed()

    def _host_changed(self) -> None:
        if self.host_changed is None:
            return
        try:
            self.host_changed()
        except (NetlinkError, OSError) as err:  # never in place of the move's own outcome
            log.warning("host_change_hook_failed", error=str(err))

    def _return_netdev(self, record: Record) -> None:
        try:
            with netlink(record.netns) as pod_ns:
                link = _link(pod_ns, record.pod_ifname, record.host.mac) or \
                    _link(pod_ns, mac=record.host.mac)
                if link is not None:
                    with open(self.host_netns or "/proc/self/ns/net", "rb") as host_fd:
                        pod_ns.link("set", index=link["index"], state="down")
                        pod_ns.link("set", index=link["index"], net_ns_fd=host_fd.fileno(),
                                    ifname=record.host.name)
        except (NetlinkError, OSError) as err:
            log.warning("nic_return_from_pod_failed", device=record.device,
                        pod=record.pod, netns=record.netns, error=str(err))

    def _return_rdma(self, record: Record) -> None:
        try:
            with self.rdma_open(record.netns) as nl, \
                    open(self.host_netns or "/proc/self/ns/net", "rb") as host_fd:
                if record.rdma_device in nl.devices():
                    nl.move(record.rdma_device, host_fd.fileno())
        except (rdma.RdmaError, OSError) as err:
            log.warning("rdma_return_from_pod_failed", rdma_device=record.rdma_device, device=record.device,
                        pod=record.pod, netns=record.netns, error=str(err))

    def _restore_on_host(self, record: Record) -> None:
        host_settings = record.host
        with netlink(self.host_netns) as host:
            link = _link(host, mac=host_settings.mac)
            if link is None and self.recreate is not None:
                self.recreate(host_settings)
                link = _link(host, mac=host_settings.mac)
            if link is None:
                raise NetdevError(f"device {record.device}: interface {host_settings.name} "
                                  f"({host_settings.mac}) is neither in pod {record.pod} nor on "
                                  f"the host")
            index = link["index"]
            if link["ifname"] != host_settings.name:
                host.link("set", index=index, state="down")
                host.link("set", index=index, ifname=host_settings.name)
            if link["mtu"] != host_settings.mtu:
                host.link("set", index=index, mtu=host_settings.mtu)
            for cidr in host_settings.addresses:
                _add_address(host, index, cidr)
            host.link("set", index=index, state="up" if host_settings.up else "down")

    def reconcile(self, live_pods: set[str] | None = None) -> list[Record]:
        """Bring back every NIC whose record is half done ("moving": we died mid-move),
        whose namespace is gone, or whose pod is not in `live_pods` (pod UIDs the runtime
        reported; None: do not judge by that). Returns the records it undid."""
        undone = []
        for record in self.load_records():
            gone = not os.path.exists(record.netns)
            stale = live_pods is not None and record.pod_uid not in live_pods
            if record.state == "moved" and not gone and not stale:
                continue
            try:
                self.detach(record.pod_uid, record.device)
            except (NetdevError, NetlinkError, OSError) as err:
                log.error("nic_reconcile_failed", claim=record.claim_uid, device=record.device,
                          pod=record.pod, error=str(err))
                continue
            undone.append(record)
        return undone
