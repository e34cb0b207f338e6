"""One call that turns a node (real or mock) into an Inventory, logging what it skipped.

Given the previous result and what changed since (`Changes`: the PCI functions and
interfaces uevents named, or that driver/devices/fingerprint.py found different), PCI
functions and NICs are read again only where they changed; the rest is taken from the
previous result. NVML and FPGA discovery always run whole: they are few devices. The
result equals a full discovery's (tests/test_rediscovery.py compares both after random
hotplug sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

from driver.devices import net, pci
from driver.devices.fpga import AlveoDiscovery, DflDiscovery
from driver.devices.model import Device, Inventory
from driver.devices.net import NicDiscovery, NicFilter, NicMemo
from driver.devices.nvml import NvmlDiscovery
from driver.devices.pciids import PciIds
from driver.devices.problems import Problems


@dataclass(frozen=True)
class Sources:
    """Where discovery looks. Mock mode points every path into its generated tree."""

    sysfs: Path
    proc: Path
    nvml: Any | None  # the pynvml module or the mock's fake; None: no NVML binding
    nic_filter: NicFilter = NicFilter()
    pci_ids: PciIds = field(default_factory=PciIds)  # product names for NICs and FPGAs
    mig_mode: str = "static"  # "dynamic": MIG-capable GPUs as partitionable devices
    # (GPU UUID, GPU instance id) of the MIG instances this driver created (dynamic MIG)
    owned_mig: Callable[[], set] = set
    # The NICs whose netdev the driver moved into pods (driver/nri/netdev.py's records):
    # published though the host's sysfs lists no netdev of them (driver/devices/net.py).
    away_netdevs: Callable[[], tuple[net.AwayNetdev, ...]] = tuple
    mig_profiles: frozenset[str] = frozenset()  # dynamic MIG: the profiles offered; empty: all


@dataclass(frozen=True)
class Changes:
    """What changed since the previous discovery, by name."""

    functions: frozenset[str] = frozenset()  # PCI addresses
    interfaces: frozenset[str] = frozenset()  # network interface names

    def __or__(self, other: "Changes") -> "Changes":
        return Changes(self.functions | other.functions, self.interfaces | other.interfaces)

    def __bool__(self) -> bool:
        return bool(self.functions or self.interfaces)


@dataclass(frozen=True)
class Reusable:
    """What the next discovery may take from this one instead of reading it again."""

    functions: dict[str, pci.PciFunction]
    nics: NicMemo


@dataclass(frozen=True)
class DiscoveryResult:
    inventory: Inventory
    problems: Problems
    excluded: tuple[tuple[str, str], ...]
    nvml_unavailable: str | None  # None: NVML answered (possibly with zero GPUs)
    nvidia_driver_version: str | None = None  # raw, for locating the driver's files
    # NICs withheld because the routing table could not be read (fail closed: one of them
    # might carry the default route).
    nics_withheld_routing_unknown: int = 0
    nvidia_gpus_on_pci: int = 0  # NVIDIA display/3D functions in sysfs, whatever NVML says
    reusable: Reusable | None = field(default=None, compare=False, repr=False)


NVIDIA_VENDOR = 0x10DE


def discover(sources: Sources, previous: DiscoveryResult | None = None,
             changes: Changes | None = None) -> DiscoveryResult:
    """A full discovery; with `previous` and `changes`, one that reads again only the PCI
    functions and interfaces `changes` names (and their SR-IOV relatives) and those that
    appeared."""
    reuse = previous.reusable if previous is not None and changes is not None else None
    fresh = _relatives(sources.sysfs, previous, changes) if reuse is not None else frozenset()
    problems = Problems()
    devices: list[Device] = []
    nvml_unavailable = "the nvidia-ml-py package is not installed"
    driver_version = None
    counter_sets: dict = {}
    if sources.nvml is not None:
        gpus = NvmlDiscovery(sources.nvml, sources.sysfs, sources.proc, sources.mig_mode,
                             sources.owned_mig, sources.mig_profiles)
        devices += gpus.discover(problems)
        nvml_unavailable = gpus.unavailable
        driver_version = gpus.driver_version
        counter_sets = gpus.counter_sets

    # Every PCI function is read once here and shared: on a node with thousands of VFs,
    # reading them again per subsystem doubled the cost of each rediscovery.
    functions, unreadable = pci.read_all(sources.sysfs, reuse.functions if reuse else None, fresh)
    for bdf, error in unreadable.items():
        # Only fatal for a device we would have published; NIC and DFL discovery report
        # their own devices by name.
        problems.note(bdf, error)
    devices += AlveoDiscovery(sources.sysfs, sources.pci_ids).discover(list(functions.values()), problems)
    devices += DflDiscovery(sources.sysfs, sources.pci_ids).discover(problems)
    nics = NicDiscovery(sources.sysfs, sources.proc, sources.nic_filter, functions, sources.pci_ids,
                        reuse.nics if reuse else None, changes.interfaces if reuse else frozenset(), fresh,
                        sources.away_netdevs())
    devices += nics.discover(problems)
    return DiscoveryResult(
        Inventory(tuple(devices), counter_sets), problems, tuple(nics.excluded), nvml_unavailable, driver_version,
        nics.withheld_routing_unknown,
        sum(1 for f in functions.values() if f.vendor == NVIDIA_VENDOR and f.class_code >> 16 == 0x03),
        Reusable(functions, nics.memo),
    )


def _relatives(sysfs: Path, previous: DiscoveryResult, changes: Changes) -> frozenset[str]:
    """The functions to read again for `changes`: those named, the functions of the
    interfaces named, and the physical function of every VF among them (its VF count and
    list changed with it), as sysfs says now or, for one gone, as the last result said."""
    fresh = set(changes.functions)
    memo = previous.reusable.nics if previous.reusable else NicMemo()
    for ifname in changes.interfaces:
        known = memo.outcomes.get(ifname)
        if known is not None and known.bdf is not None:
            fresh.add(known.bdf)
    pf_of = {d.pci.bus_id: d.attributes.get("pfPciBusID") for d in previous.inventory.devices
             if d.pci is not None and d.attributes.get("pfPciBusID")}
    for bdf in list(fresh):
        physfn = pci.link_name(sysfs / "bus" / "pci" / "devices" / bdf / "physfn")
        for pf in (physfn, pf_of.get(bdf)):
            if isinstance(pf, str):
                fresh.add(pf)
    return frozenset(fresh)


def log_result(
    result: DiscoveryResult,
    log: structlog.typing.FilteringBoundLogger,
    previous: DiscoveryResult | None = None,
) -> None:
    """Log what discovery found; with `previous`, only what changed since, so that periodic
    rediscovery does not repeat the same warning every minute."""
    seen = set(previous.problems) if previous else set()
    if result.nvml_unavailable and not (previous and previous.nvml_unavailable):
        if result.nvidia_gpus_on_pci:
            # GPUs on the bus but no NVML: a broken driver installation, worth a warning.
            log.warning("nvml_unavailable", reason=result.nvml_unavailable,
                        unpublished_gpus=result.nvidia_gpus_on_pci)
        else:  # a node without NVIDIA GPUs: nothing is wrong
            log.debug("nvml_unavailable", reason=result.nvml_unavailable)
    for problem in result.problems:
        if problem in seen:
            continue
        event = "device_skipped" if problem.skipped else "device_degraded"
        log.warning(event, device=problem.device, reason=problem.message)
    withheld = result.nics_withheld_routing_unknown
    if withheld and not (previous and previous.nics_withheld_routing_unknown):
        log.error("nics_withheld", count=withheld,
                  reason=f"{net.ROUTING_UNKNOWN} (<proc-root>/1/net/route); no NIC is published until it "
                         "can be read, unless --nic-allow-default-route is set")
    for ifname, reason in result.excluded:
        if withheld and reason.startswith(net.ROUTING_UNKNOWN):
            continue  # said once above
        if not (previous and (ifname, reason) in previous.excluded):
            log.info("nic_excluded", interface=ifname, reason=reason)
    counts: dict[str, int] = {}
    for device in result.inventory.devices:
        counts[device.kind.value] = counts.get(device.kind.value, 0) + 1
    log.info("discovery_done", devices=len(result.inventory.devices), **counts)
