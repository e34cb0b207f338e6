"""A cheap summary of what discovery reads, so that periodic rediscovery reads again only
what differs.

Periodic rediscovery is the safety net for changes no uevent announced: a link that went
down, an MTU or address set, a uevent lost while the netlink socket was full. Reading
everything again for that cost ~1.2 s of CPU a minute on a node of 2,048 VFs. This reads,
per PCI function, where it sits, its device ID and its driver (links and one small file),
and per interface where it sits and the attributes that change under a running driver
(address, MTU, operstate, speed); everything else a function or an interface publishes
stays fixed while those do (it changes with a remove and add, which changes the listing).
It also reads where each uverbs entry (an RDMA device's user-space handle) leads: an
entry that came, went or moved names the functions it led from and to, and discovery
reads no uverbs entry of a function nobody named. The default routes, which every NIC
reads, are compared inside discovery itself.

`changes(old, new)` turns two fingerprints into the `Changes` discovery takes. NVML and
FPGA discovery are not summarized: they always run (a handful of devices).

Given a `sysread.HeldDirs`, the attributes are opened relative to each function's and
interface's directory, kept open from one pass to the next (keyed by what the name leads
to, so that a name another device has taken is opened again): the ~10,000 opens of a
pass on sriov-large no longer walk the whole sysfs path each.
"""

from __future__ import annotations

import os
from pathlib import Path

from driver.devices import net, pci
from driver.devices.discovery import Changes
from driver.devices.sysread import HeldDirs, read_small

_NET_ATTRIBUTES = ("address", "mtu", "operstate", "speed")


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _entries(path: str) -> list[tuple[str, int]]:
    """A directory's names and their inode numbers (from the same getdents call)."""
    try:
        with os.scandir(path) as entries:
            return [(entry.name, entry.inode()) for entry in entries]
    except OSError:
        return []


# (by PCI address, by interface, uverbs entry -> its link)
Fingerprint = tuple[dict[str, tuple], dict[str, tuple], dict[str, str | None]]


def _key(inode: int, link: str | None) -> tuple[int, str] | None:
    """What a name leads to now, for HeldDirs: its entry's inode and its link. The link
    alone is not enough: a virtual interface's is ../../devices/virtual/net/NAME, the same
    for whichever device has the name, and so are two ports of one PCI function swapping
    names. The entry (a symlink in sysfs) is made anew when a device takes the name, and
    keeps its inode when its device is renamed; kernfs does not reuse inode numbers soon."""
    return (inode, link) if link is not None else None


def _by_path(directory: str, key: object, names: tuple[str, ...]) -> tuple[bytes | None, ...]:
    return tuple(read_small(f"{directory}/{name}") for name in names)


def fingerprint(sysfs: Path, dirs: HeldDirs | None = None) -> Fingerprint:
    read = dirs.read if dirs is not None else _by_path
    functions: dict[str, tuple] = {}
    bus = f"{sysfs}/bus/pci/devices"
    for bdf, inode in _entries(bus):
        if pci.BDF.match(bdf):
            base = f"{bus}/{bdf}"
            link = _link(base)
            functions[bdf] = (link, *read(base, _key(inode, link), ("device",)),
                              _link(f"{base}/driver"))
    interfaces: dict[str, tuple] = {}
    net = f"{sysfs}/class/net"
    for ifname, inode in _entries(net):
        base = f"{net}/{ifname}"
        link = _link(base)
        interfaces[ifname] = (link, *read(base, _key(inode, link), _NET_ATTRIBUTES))
    verbs = f"{sysfs}/class/infiniband_verbs"
    uverbs = {entry: _link(f"{verbs}/{entry}") for entry, _ in _entries(verbs) if entry.startswith("uverbs")}
    if dirs is not None:
        dirs.sweep()
    return functions, interfaces, uverbs


def changes(old: Fingerprint, new: Fingerprint) -> Changes:
    """What differs: added, removed or changed functions and interfaces, and the functions
    a uverbs entry that came, went or moved led from or leads to."""
    moved = {net.uverbs_owner(link) for entry in _differing(old[2], new[2])
             for link in (old[2].get(entry), new[2].get(entry))}
    return Changes(_differing(old[0], new[0]) | (moved - {None}), _differing(old[1], new[1]))


def _differing(old: dict[str, tuple], new: dict[str, tuple]) -> frozenset[str]:
    return frozenset(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
