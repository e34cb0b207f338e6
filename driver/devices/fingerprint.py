"""A cheap summary of what discovery reads, so that periodic rediscovery reads again only
what differs.

Periodic rediscovery is the safety net for changes no uevent announced: a link that went
down, an MTU or address set, a uevent lost while the netlink socket was full. Reading
everything again for that cost ~1.2 s of CPU a minute on a node of 2,048 VFs. This reads,
per PCI function, where it sits, its device ID and its driver (links and one small file),
and per interface where it sits and the attributes that change under a running driver
(address, MTU, operstate, speed); everything else a function or an interface publishes
stays fixed while those do (it changes with a remove and add, which changes the listing).
The inputs every NIC reads (the uverbs devices, the default routes) are compared inside
discovery itself.

`changes(old, new)` turns two fingerprints into the `Changes` discovery takes. NVML and
FPGA discovery are not summarized: they always run (a handful of devices).

Given a `sysread.HeldDirs`, the attributes are opened relative to each function's and
interface's directory, kept open from one pass to the next (keyed by its link, so that a
name that now leads elsewhere is opened again): the ~10,000 opens of a pass on
sriov-large no longer walk the whole sysfs path each.
"""

from __future__ import annotations

import os
from pathlib import Path

from driver.devices import pci
from driver.devices.discovery import Changes
from driver.devices.sysread import HeldDirs, read_small

_NET_ATTRIBUTES = ("address", "mtu", "operstate", "speed")


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


Fingerprint = tuple[dict[str, tuple], dict[str, tuple]]  # (by PCI address, by interface)


def _by_path(directory: str, key: object, names: tuple[str, ...]) -> tuple[bytes | None, ...]:
    return tuple(read_small(f"{directory}/{name}") for name in names)


def fingerprint(sysfs: Path, dirs: HeldDirs | None = None) -> Fingerprint:
    read = dirs.read if dirs is not None else _by_path
    functions: dict[str, tuple] = {}
    bus = f"{sysfs}/bus/pci/devices"
    for bdf in _listing(bus):
        if pci.BDF.match(bdf):
            base = f"{bus}/{bdf}"
            link = _link(base)
            functions[bdf] = (link, *read(base, link, ("device",)), _link(f"{base}/driver"))
    interfaces: dict[str, tuple] = {}
    net = f"{sysfs}/class/net"
    for ifname in _listing(net):
        base = f"{net}/{ifname}"
        link = _link(base)
        interfaces[ifname] = (link, *read(base, link, _NET_ATTRIBUTES))
    if dirs is not None:
        dirs.sweep()
    return functions, interfaces


def changes(old: Fingerprint, new: Fingerprint) -> Changes:
    """What differs: added, removed or changed functions and interfaces."""
    return Changes(_differing(old[0], new[0]), _differing(old[1], new[1]))


def _differing(old: dict[str, tuple], new: dict[str, tuple]) -> frozenset[str]:
    return frozenset(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
