"""Mock NICs that are real netdevs: the mock's interfaces exist, named as the mock profile
names them, in a network namespace the mock owns, so that moving them into pods, renaming,
addressing and returning them runs through real netlink as on a node with hardware.

Each is a `dummy` netdev where the kernel has the dummy driver, otherwise one end of a
`veth` pair whose other end stays behind in the mock's namespace. Either kind dies with
the namespace it is in (a physical NIC would come back to the host instead), so
`recreate` puts it back as the records say it was.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import structlog
from pyroute2 import netns as pyroute2_netns
from pyroute2.netlink.exceptions import NetlinkError

from driver.nri.netdev import HostSettings, _add_address, netlink

log = structlog.get_logger("driver.nri.mocknet")

NETNS_DIR = Path("/var/run/netns")


def _peer_name(ifname: str) -> str:
    return f"mp{zlib.crc32(ifname.encode()) & 0xFFFFFF:06x}"


def mock_mac(ifname: str) -> str:
    """A stable, locally administered MAC per interface name."""
    digest = zlib.crc32(b"dra-mock-nic:" + ifname.encode())
    return "02:00:" + ":".join(f"{(digest >> s) & 0xFF:02x}" for s in (24, 16, 8, 0))


@dataclass
class MockNetwork:
    """The mock's own network namespace, /var/run/netns/NAME."""
    name: str

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.name)

    def create(self) -> None:
        if not os.path.exists(self.path):
            pyroute2_netns.create(self.name)

    def destroy(self) -> None:
        if os.path.exists(self.path):
            pyroute2_netns.remove(self.name)

    def add_nic(self, ifname: str, mtu: int = 1500, addresses: tuple[str, ...] = (),
                up: bool = True, mac: str | None = None) -> str:
        """Create the interface (once: an existing one is left as it is); its MAC."""
        mac = mac or mock_mac(ifname)
        with netlink(self.path) as ipr:
            if not ipr.link_lookup(ifname=ifname):
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
