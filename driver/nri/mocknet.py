"""Mock NICs that are real netdevs: the mock's interfaces exist, named as the mock profile
names them, in a network namespace the mock owns, so that moving them into pods, renaming,
addressing and returning them runs through real netlink as on a node with hardware.

Each is a `dummy` netdev where the kernel has the dummy driver, otherwise one end of a
`veth` pair whose other end stays behind in the mock's namespace. Either kind dies with
the namespace it is in (a physical NIC would come back to the host instead), so
`recreate` puts it back as the records say it was.

The mock's sysfs tree (driver/devices/mock/tree.py) is plain files, where the kernel's
sysfs shows a netdev only to the namespace it is in: `mirror` makes the tree follow this
namespace, taking a netdev's /sys/class/net entry and <bdf>/net/<if> directory out while
the netdev is elsewhere (a pod) and putting them back when it is here again, so that
discovery, health and counters read the mock as they read a node.
"""

from __future__ import annotations

import os
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from pyroute2 import netns as pyroute2_netns
from pyroute2.netlink.exceptions import NetlinkError

from driver.nri.netdev import HostSettings, _add_address, netlink

log = structlog.get_logger("driver.nri.mocknet")

NETNS_DIR = Path("/var/run/netns")
# Beside the mock's sys/ (never listed by what reads sysfs): the netdev directories of
# interfaces in other namespaces, each with a <if>.home file naming where it belongs.
ELSEWHERE = "netdevs-elsewhere"


def is_namespace(path: str) -> bool:
    """Is a network namespace mounted at path? Namespace files live on nsfs, one
    superblock for all of them: the same device as our own namespace's file."""
    try:
        return os.stat(path).st_dev == os.stat("/proc/self/ns/net").st_dev
    except OSError:
        return False


def _peer_name(ifname: str) -> str:
    return f"mp{zlib.crc32(ifname.encode()) & 0xFFFFFF:06x}"


def mock_mac(ifname: str) -> str:
    """A stable, locally administered MAC per interface name."""
    digest = zlib.crc32(b"dra-mock-nic:" + ifname.encode())
    return "02:00:" + ":".join(f"{(digest >> s) & 0xFF:02x}" for s in (24, 16, 8, 0))


@dataclass
class MockNetwork:
    """The mock's own network namespace, /var/run/netns/NAME; with `sysfs`, the mock sysfs
    tree whose netdevs it holds."""
    name: str
    sysfs: Path | None = None
    # mirror() runs on the mover's threads: one pod's move must not list the tree while
    # another's renames in it.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.name)

    def create(self) -> None:
        if is_namespace(self.path):
            return
        # A file without a namespace mounted on it: the mount point a dead instance left,
        # e.g. a driver pod, whose bind mount lived in its container's mount namespace
        # only (the host folder keeps the empty file). Taken for a live namespace, every
        # netlink call of the mock would fail on it.
        if os.path.lexists(self.path):
            log.info("mock_netns_stale_mount_point_removed", path=self.path)
            os.unlink(self.path)
        pyroute2_netns.create(self.name)

    def destroy(self) -> None:
        if os.path.exists(self.path):
            pyroute2_netns.remove(self.name)

    def add_nic(self, ifname: str, mtu: int = 1500, addresses: tuple[str, ...] = (),
                up: bool = True, mac: str | None = None) -> str:
        """Create the interface (once: an existing one is left as it is); its MAC. A veth
        whose other end is still here lives in another namespace (a pod's the records do not
        know of, e.g. one a failed run left): it is not made twice, as a node's NIC in a pod
        is not there twice."""
        mac = mac or mock_mac(ifname)
        with netlink(self.path) as ipr:
            here = ipr.link_lookup(ifname=ifname)
            if not here and ipr.link_lookup(ifname=_peer_name(ifname)):
                log.warning("mock_nic_in_another_namespace", interface=ifname,
                            reason="its veth peer is here: it is in a namespace no record names")
            elif not here:
                try:
                    ipr.link("add", ifname=ifname, kind="dummy", address=mac)
                except NetlinkError:
                    # No dummy driver in this kernel (some VM kernels): a veth pair.
                    ipr.link("add", ifname=ifname, kind="veth", address=mac,
                             peer={"ifname": _peer_name(ifname)})
                    peer = ipr.link_lookup(ifname=_peer_name(ifname))[0]
                    ipr.link("set", index=peer, state="up")
                index = ipr.link_lookup(ifname=ifname)[0]
                ipr.link("set", index=index, mtu=mtu)
                for cidr in addresses:
                    _add_address(ipr, index, cidr)
                if up:
                    ipr.link("set", index=index, state="up")
        return mac

    def recreate(self, settings: HostSettings) -> None:
        """A mock NIC that died with a pod's namespace comes back as it was."""
        log.info("mock_nic_recreated", interface=settings.name, mac=settings.mac)
        with netlink(self.path) as ipr:
            stale = ipr.link_lookup(ifname=_peer_name(settings.name))
            if stale:  # a veth's other end outlives nothing, but be sure
                ipr.link("del", index=stale[0])
        self.add_nic(settings.name, settings.mtu, tuple(settings.addresses), settings.up,
                     settings.mac)

    def pci_netdevs(self) -> list[str]:
        """The PCI functions' netdevs the mock's sysfs lists now (not the virtual ones)."""
        if self.sysfs is None:
            return []
        class_net = self.sysfs / "class" / "net"
        virtual = (self.sysfs / "devices" / "virtual").resolve()
        try:
            names = sorted(os.listdir(class_net))
        except OSError:
            return []
        return [n for n in names if not (class_net / n).resolve().is_relative_to(virtual)]

    def populate(self, elsewhere: set[str]) -> None:
        """Every PCI netdev of the mock's sysfs made a real one here, but those `elsewhere`
        (in pods, by the records): on a node each is a netdev in some namespace."""
        for ifname in self.pci_netdevs():
            if ifname not in elsewhere:
                self.add_nic_or_say(ifname)

    def add_nic_or_say(self, ifname: str) -> None:
        """add_nic at start: a mock NIC the kernel refuses is one line, not the driver's end
        (discovery then sees the NIC as absent, as on a node where it failed)."""
        try:
            self.add_nic(ifname)
        except NetlinkError as err:
            log.warning("mock_nic_not_created", interface=ifname, error=str(err))

    def mirror(self) -> None:
        """The sysfs tree shows exactly the PCI netdevs that are in this namespace (see the
        module's doc). Idempotent; judged by netlink, not by who moved what."""
        if self.sysfs is None:
            return
        with netlink(self.path) as ipr:
            here = {link.get("ifname") for link in ipr.get_links()}
        class_net = self.sysfs / "class" / "net"
        stash = self.sysfs.parent / ELSEWHERE
        with self._lock:
            for ifname in self.pci_netdevs():
                if ifname not in here:
                    self._hide(class_net, stash, ifname)
            try:
                away = sorted(n for n in os.listdir(stash) if not n.endswith(".home"))
            except OSError:
                away = []
            for ifname in away:
                if ifname in here:
                    self._show(class_net, stash, ifname)

    def _hide(self, class_net: Path, stash: Path, ifname: str) -> None:
        entry = class_net / ifname
        home = entry.resolve()
        stash.mkdir(exist_ok=True)
        try:
            (stash / f"{ifname}.home").write_text(str(home.relative_to(self.sysfs)))
            os.rename(home, stash / ifname)
            entry.unlink()
        except OSError as err:  # another instance sharing the tree (an upgrade) was first
            log.warning("mock_sysfs_mirror_failed", interface=ifname, error=str(err))
            return
        log.info("mock_netdev_left_sysfs", interface=ifname)

    def _show(self, class_net: Path, stash: Path, ifname: str) -> None:
        try:
            home = self.sysfs / (stash / f"{ifname}.home").read_text()
            os.rename(stash / ifname, home)
            os.symlink(os.path.relpath(home, class_net), class_net / ifname)
            (stash / f"{ifname}.home").unlink()
        except OSError as err:
            log.warning("mock_sysfs_mirror_failed", interface=ifname, error=str(err))
            return
        log.info("mock_netdev_back_in_sysfs", interface=ifname)
