"""What `dra-driver run` is made of, and how the parts are wired to each other: discovery
and the inventory it keeps current, the prepare side with its sharing, MIG, metadata and
status writers, publishing, health, utilization, metrics and the kubelet's services.

The parts are made here, in one place, in the order their dependencies need; nothing runs
until the plugin (driver/service/plugin.py) starts them in the order the kubelet needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from prometheus_client.registry import Collector

from driver import logs
from driver.service import nodeview, support
from driver.service.config import Config
from driver.devices import fingerprint, sysread
from driver.devices.discovery import DiscoveryResult, discover, log_result
from driver.devices.model import Inventory
from driver.devices.nvlibs import DriverFiles
from driver.kube.client import Kube
from driver.kubelet import health as health_stream
from driver.kubelet.registration import DRA_SERVICES, Registration
from driver.kubelet.sockets import dra_ours, registration_ours, sweep_private, sweep_public
from driver.metrics import Metrics
from driver.monitoring.devicemetrics import DeviceSeries
from driver.monitoring.health import HealthState, Prober, XidWatcher
from driver.monitoring.probes import Probes
from driver.monitoring.utilization.events import EventRecorder
from driver.monitoring.utilization.idle import IdleTracker
from driver.monitoring.utilization.monitor import UtilizationMonitor
from driver.monitoring.utilization.sampler import Sampler
from driver.service.node import NodeRoots, open_node
from driver.nri import setup as nri_setup
from driver.nri.netdev import AwayNetdevs
from driver.nri.plugin import NriPlugin
from driver.prepare.cdi import CdiWriter, Mount
from driver.prepare.claims import ClaimReader
from driver.prepare.claimstatus import StatusWriter
from driver.prepare.devicestate import DeviceStates
from driver.prepare.gpucontrol import GpuControl
from driver.prepare.idlestatus import IdleConditions
from driver.prepare.metadata import MetadataFiles
from driver.prepare.mig import MigPartitions, MigRecords
from driver.prepare.fpgaprogram import FpgaPrograms, FpgaRecords
from driver.devices.bitstreams import BitstreamStore
from driver.devices.fpgatools import ToolProgrammer
from driver.devices.mock.tree import BITSTREAMS, FPGA_TOOLS
from driver.prepare.mps import MpsDaemons
from driver.prepare.preparer import Preparer
from driver.prepare.sharing import DeviceSharing
from driver.prepare.status import host_addresses
from driver.publish.hotplug import Rediscovery
from driver.publish.publisher import Publisher
from driver.state.checkpoint import Checkpoint, read_boot_id
from driver.state.instance import Instance
from driver.state.locks import ProcessLock


@dataclass
class DiscoverySettings:
    """What rediscovery reads that can change while the driver runs: the MIG mode
    ("dynamic" becomes "static" when the API server cannot take shared counters)."""

    mig_mode: str


@dataclass
class InventoryHolder:
    """The current inventory; replaced whole by rediscovery, read by prepare and publish."""

    result: DiscoveryResult

    @property
    def inventory(self) -> Inventory:
        return self.result.inventory


@dataclass
class Parts:
    """The parts of a running driver, made and wired, none of them started."""

    config: Config
    kube: Kube
    node: NodeRoots
    holder: InventoryHolder
    preparer: Preparer
    registration: Registration
    publisher: Publisher
    rediscovery: Rediscovery
    health: HealthState
    prober: Prober
    metrics: Metrics
    probes: Probes
    instance: Instance
    utilization: UtilizationMonitor | None = None
    xid: XidWatcher | None = None
    nri: NriPlugin | None = None  # --nri-socket: moves claimed NICs into pods


class CapacityGauges(Protocol):
    """Makes the fragmentation gauges' collector (driver/explain/capacitymetrics.py). The CLI
    hands it in: it runs explain's allocation model, which this layer may not import."""

    def __call__(self, driver: str, objects: Callable[[Mapping[str, Sequence[dict]]], list[dict]],
                 records: Callable[[], Iterable], published: Callable[[], object],
                 taints: Callable[[], Mapping[str, Sequence[dict]]]) -> Collector: ...


def assemble(config: Config, kube: Kube | None, instance: Instance,
             capacity_gauges: CapacityGauges | None = None) -> Parts:
    node = open_node(config, instance=instance)
    mig_records = MigRecords(config.state_dir, instance)
    settings = DiscoverySettings(config.mig_mode)
    # NICs in pods: the host's sysfs shows no netdev of theirs, the move records do.
    away = AwayNetdevs(nri_setup.records_dir(config.state_dir))

    def sources():
        return node.sources(config, settings.mig_mode, mig_records.owned, away)

    # The fingerprint's directories stay open from one periodic pass to the next.
    dirs = sysread.HeldDirs()
    baseline = fingerprint.fingerprint(node.sysfs, dirs)  # before: a change after it shows later
    result = discover(sources())
    log_result(result, logs.get("discovery"))
    holder = InventoryHolder(result)
    inventory = lambda: holder.inventory  # noqa: E731 - read the holder at call time
    kube = kube or Kube.deferred(config.kubeconfig, connections=config.api_connections)
    checkpoint = Checkpoint(config.state_dir, instance)
    driver_files = DriverFiles(node.driver_root_local, node.driver_root_host)

    def driver_mounts() -> tuple[Mount, ...]:
        files = driver_files.files(holder.result.nvidia_driver_version)
        return tuple(Mount(f.host_path, f.container_path) for f in files)

    cdi_writer = CdiWriter(config.cdi_root, config.driver_name, instance)
    boot_id = read_boot_id(node.proc)
    sharing = DeviceSharing(
        DeviceStates(config.state_dir, instance),
        GpuControl(node.nvml, node.driver_root_local),
        MpsDaemons(kube, config.driver_name, config.node_name, config.namespace,
                   config.mps_image, config.state_dir, node.driver_root_host,
                   config.mps_start_timeout, node.driver_root_local, config.mps_shm_size),
        boot_id, inventory)
    mig = MigPartitions(mig_records, node.nvml, node.sysfs, node.proc, boot_id, inventory,
                        claims=checkpoint.records)
    # A mock node brings its own store and fake tools (driver/devices/mock/fpgatools.py).
    mock_root = node.mock.root if node.mock is not None else None
    fpga = FpgaPrograms(FpgaRecords(config.state_dir, instance),
                        BitstreamStore(config.fpga_bitstreams or (mock_root / BITSTREAMS if mock_root else None)),
                        ToolProgrammer(mock_root / FPGA_TOOLS if mock_root else None),
                        node.sysfs, boot_id, config.fpga_program_timeout)
    metadata = MetadataFiles(config.state_dir / "metadata", config.driver_name, instance.token)
    metadata.sweep_temp_files(instance.owner_state)
    # Sockets of killed instances: the public names first (the kubelet keeps a dead
    # registration while its file is there), then the private ones that tell owners.
    log = logs.get("sockets")
    for directory, ours in ((config.registration_socket.parent, registration_ours(config.driver_name)),
                            (config.dra_socket.parent, dra_ours)):
        for path in sweep_public(directory, ours, instance.owner_state):
            log.info("dead_instance_socket_removed", socket=str(path))
    for directory in {config.registration_socket.parent, config.dra_socket.parent}:
        sweep_private(directory, instance.owner_state)
    instance.forget_dead()  # after the sweeps above, which need to know who died
    metrics = Metrics(config.driver_name)
    status = (StatusWriter(kube, config.driver_name, on_failure=metrics.status_write_failures.inc)
              if config.claim_status else None)
    preparer = Preparer(
        driver=config.driver_name,
        pool=config.node_name,
        inventory=inventory,
        claims=ClaimReader(kube, connections=config.claim_workers),
        cdi_writer=cdi_writer,
        checkpoint=checkpoint,
        boot_id=boot_id,
        dev_root=node.dev,
        process_lock=ProcessLock(config.state_dir / "prepare.lock"),
        driver_mounts=driver_mounts,
        sharing=sharing,
        mig=mig,
        fpga=fpga,
        status=status,
        addresses=host_addresses(node.proc),
        metadata=metadata,
        cdi_net_devices=config.nri_socket is None,
    )
    registration = Registration(config.driver_name, str(config.dra_socket),
                                (*DRA_SERVICES, *health_stream.SERVICE_NAMES))
    health = HealthState(config.driver_name, inventory)
    # For `dra-driver status`, which runs beside us without the API server: now (a
    # previous process may have left conditions that no longer hold), then on changes.
    nodeview.write_health(config.state_dir, instance.token, health)
    health.subscribe(lambda: nodeview.write_health(config.state_dir, instance.token, health))
    publisher = Publisher(kube, config.driver_name, config.node_name, inventory=inventory,
                          taints=health.taints, metrics=metrics,
                          newer_instance=instance.newer_peer, sharing=config.gpu_sharing,
                          health_ready=health.probed.is_set)
    health.subscribe(publisher.trigger)

    def static_mig() -> None:  # the server has no shared counters: publish MIG as it is
        settings.mig_mode = "static"
        rediscovery.notify()

    publisher.counters_unsupported = static_mig
    # Once the server's release is known: what this configuration lacks or needs gated there.
    publisher.negotiated = lambda server, api, kubelet: support.report(config, instance.token, server, api,
                                                                       kubelet)

    def changed(new: DiscoveryResult) -> None:
        holder.result = new
        publisher.trigger()

    rediscovery = Rediscovery(discover=lambda: discover(sources()),
                              on_change=changed, current=result,
                              interval=config.rediscover_interval,
                              incremental=lambda previous, what: discover(sources(), previous, what),
                              scan=lambda: fingerprint.fingerprint(node.sysfs, dirs),
                              diff=fingerprint.changes, baseline=baseline, release=dirs.close)
    health.on_loss = rediscovery.notify
    mig.rediscover = rediscovery.notify  # a MIG mode change (and a rebind's new minor)
    fpga.rediscover = rediscovery.notify  # a programmed FPGA publishes its new function
    prober = Prober(health, node.sysfs, node.dev, node.nvml, config.xid_recovery_seconds, away)
    metrics.watch_state(
        prepared=lambda: len(checkpoint.uids()),
        devices=lambda: _count_kinds(holder.inventory),
        health=health.summary,
        nics_withheld=lambda: holder.result.nics_withheld_routing_unknown,
    )
    if capacity_gauges is not None:
        metrics.registry.register(capacity_gauges(
            config.driver_name, lambda taints: published_objects(config, holder.inventory, taints),
            checkpoint.records, lambda: holder.inventory, lambda: published_taints(publisher, health)))

    def ready() -> tuple[bool, str]:
        registered = registration.registered.is_set()
        published = publisher.stats.published
        why = f"registered={registered} published={published}"
        if registration.last_error:
            why += f" (kubelet rejected the registration: {registration.last_error})"
        if registration.held:
            why += f" (not registering yet: {registration.held})"
        return registered and published, why

    def partitions(bus_id: str, gi: int) -> list[str]:
        devices = {d.name: d for d in holder.inventory.devices}
        return [r.device for r in mig_records.all() if r.gpu_instance == gi
                and r.device in devices and devices[r.device].pci is not None
                and devices[r.device].pci.bus_id == bus_id]

    xid = (XidWatcher(node.nvml, health, config.ignored_xids, partitions)
           if node.nvml is not None else None)
    utilization = None
    if config.utilization_interval:
        def leader() -> bool:  # during an upgrade the newest instance reports
            return instance.newer_peer() is None

        tracker = IdleTracker(config.state_dir, instance.token, config.idle_threshold,
                              config.idle_after, leader)
        utilization = UtilizationMonitor(
            Sampler(node.nvml, node.sysfs, inventory), tracker, checkpoint.records,
            config.node_name, EventRecorder(kube, config.driver_name, config.node_name),
            IdleConditions(status) if status is not None else None, leader)
        metrics.watch_utilization(DeviceSeries(utilization.views, config.driver_name))
    nri = None
    if config.nri_socket is not None:
        nri, _ = nri_setup.make(config.nri_socket, config.state_dir, node.proc, inventory,
                                checkpoint.records, status, config.mock is not None,
                                instance.token, metrics,
                                mock_sysfs=node.sysfs if config.mock is not None else None)
    return Parts(config, kube, node, holder, preparer, registration, publisher, rediscovery,
                 health, prober, metrics, Probes(ready), instance, utilization, xid, nri)


def _count_kinds(inventory: Inventory) -> dict[str, int]:
    counts: dict[str, int] = {}
    for device in inventory.devices:
        counts[device.kind.value] = counts.get(device.kind.value, 0) + 1
    return counts


def published_objects(config: Config, inventory: Inventory, taints: Mapping[str, Sequence[dict]]) -> list[dict]:
    """The node's devices as it publishes them, with these taints, and the chart's
    DeviceClasses: what the fragmentation gauges' model reads."""
    from driver.publish import mocknode, slices

    pool = slices.PoolIdentity(config.driver_name, config.node_name)
    return (slices.build(inventory, pool, 1, taints=taints, sharing=config.gpu_sharing)
            + mocknode.class_objects(config.driver_name))


def published_taints(publisher: Publisher, health: HealthState) -> dict[str, list[dict]]:
    """The device taints the node's slices carry: none where the API has no device taints
    (v1beta1) or the server drops them (the publisher found the feature gate off), as the
    publisher decides (driver/publish/publisher.py); there the scheduler still allocates
    the unhealthy device, and the gauges count it as free as the scheduler does."""
    if not publisher.taints_supported or publisher.api_version == "v1beta1":
        return {}
    return health.taints()
