"""The NRI side of `dra-driver run`, made from plain values (driver/service/assembly.py wires it):
the mover with its records under the state directory, the pod resolver over the
prepared-claims checkpoint and the inventory, the claim status overlay, the plugin.

On a node, our NICs live in the host's network namespace, which is not the driver pod's
(the chart runs it without hostNetwork): it is reached as PID 1's, through the host's
/proc. In mock mode they live in a namespace the mock owns, made here, one per state
directory so that two mock drivers on one machine keep apart.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import structlog

from driver.devices.model import DeviceKind, Inventory
from driver.metrics import Metrics
from driver.nri.mocknet import MockNetwork
from driver.nri.netdev import NetdevMover
from driver.nri.plugin import NriOptions, NriPlugin
from driver.nri.pods import NicPods
from driver.nri.status import NetworkConditions
from driver.prepare.claimstatus import StatusWriter
from driver.state.checkpoint import ClaimRecord

log = structlog.get_logger("driver.nri")


def mock_network(state_dir: Path, sysfs: Path | None = None) -> MockNetwork:
    return MockNetwork(f"dra-mock-{zlib.crc32(str(state_dir).encode()):08x}", sysfs)


def records_dir(state_dir: Path) -> Path:
    """Where the mover keeps its move records (driver/nri/netdev.py)."""
    return state_dir / "nri"


def make(socket: Path, state_dir: Path, proc_root: Path, inventory: Callable[[], Inventory],
         records: Callable[[], Iterable[ClaimRecord]], status: StatusWriter | None,
         mock: bool, owner: str, metrics: Metrics | None = None,
         mock_sysfs: Path | None = None) -> tuple[NriPlugin, NicPods]:
    recreate = host_changed = None
    network = mock_network(state_dir, mock_sysfs) if mock else None
    if network is not None:
        host_netns = network.path
        recreate = network.recreate
        host_changed = network.mirror
    else:
        host_netns = str(proc_root / "1" / "ns" / "net")

    def published_of(name: str) -> dict | None:
        device = inventory().get(name)
        return dict(device.attributes) if device is not None else None

    mover = NetdevMover(records_dir(state_dir), host_netns=host_netns, recreate=recreate,
                        owner=owner, published_of=published_of, host_changed=host_changed)

    def prepare_host() -> None:
        if network is not None:
            network.create()
            # A NIC a pod holds (moved before a restart) is not made again beside it.
            away = {r.host.name for r in mover.load_records()}
            if network.sysfs is not None:
                network.populate(away)
            for device in inventory().devices:
                if (device.kind is DeviceKind.NIC and device.net_interface
                        and device.net_interface not in away):
                    network.add_nic_or_say(device.net_interface)
            network.mirror()  # the tree was written whole: those in pods leave it now
        # NICs left in namespaces that died while no driver ran come back now; those of
        # pods that still run are judged at the runtime's Synchronize.
        for record in mover.reconcile():
            log.info("nic_reconciled_at_start", claim=record.claim_uid, device=record.device,
                     pod=record.pod)

    # pyroute2's blocking calls run an event loop of their own: never on a thread whose
    # loop runs (assembly happens on the driver's), so on one of their own.
    with ThreadPoolExecutor(1, thread_name_prefix="nri-setup") as pool:
        pool.submit(prepare_host).result()

    def interface_of(name: str) -> str | None:
        for device in inventory().devices:
            if device.name == name:
                return device.net_interface
        return None

    def rdma_of(name: str) -> str | None:
        for device in inventory().devices:
            if device.name == name:
                value = device.attributes.get("rdmaDevice")
                return str(value) if value else None
        return None

    nics = NicPods(mover, records, interface_of,
                   NetworkConditions(status) if status is not None else None, rdma_of)
    plugin = NriPlugin(NriOptions(socket=socket), nics)
    if metrics is not None:
        def observe(event: str, seconds: float, failed: bool) -> None:
            metrics.nri_events.labels(event).observe(seconds)
            if failed:
                metrics.nri_event_errors.labels(event).inc()
        plugin.observe = observe
    return plugin, nics
