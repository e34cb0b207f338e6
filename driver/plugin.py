"""`dra-driver run`: discovery, the kubelet-facing gRPC servers, publishing, health,
metrics and probes, and their lifecycle.

Start order matters: the DRA service socket is up before the registration socket appears,
because the kubelet dials the endpoint right after GetInfo. Stop order is the reverse:
the registration socket goes first so the kubelet stops sending new calls, then in-flight
calls get a grace period. Slices are left in place for the next instance.

During a seamless upgrade another instance of this driver runs beside this one, sharing
the directories (driver/state/instance.py): the newest instance publishes, both serve.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import structlog

from driver.publish import extendedresources

from driver import logs, preflight
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.prepare.cdi import CdiWriter, Mount
from driver.state.checkpoint import Checkpoint, read_boot_id
from driver.prepare.claims import ClaimReader
from driver.prepare.claimstatus import StatusWriter
from driver.config import Config
from driver.devices import fingerprint, sysread
from driver.devices.discovery import DiscoveryResult, discover, log_result
from driver.devices.model import Inventory
from driver.devices.nvlibs import DriverFiles
from driver.monitoring.devicemetrics import DeviceSeries
from driver.monitoring.health import HealthState, Prober, XidWatcher
from driver.publish.hotplug import Rediscovery, UeventMonitor
from driver.state.instance import Instance
from driver.kube.client import ApiError, ClientConfigError, Kube
from driver.kubelet import health as health_stream
from driver.kubelet import service
from driver.kubelet.registration import DRA_SERVICES, Registration
from driver.kubelet.sockets import OwnedSocket
from driver.state.locks import ProcessLock
from driver.metrics import Metrics
from driver.node import NodeRoots, open_node
from driver.prepare.preparer import Preparer
from driver.prepare.devicestate import DeviceStates
from driver.prepare.gpucontrol import GpuControl
from driver.prepare.metadata import MetadataFiles
from driver.prepare.mig import MigPartitions, MigRecords
from driver.prepare.mps import MpsDaemons
from driver.prepare.sharing import DeviceSharing
from driver.prepare.status import host_addresses
from driver.monitoring.probes import HttpEndpoint, Probes
from driver.publish.publisher import Publisher
from driver import nodeview
from driver.monitoring.utilization.events import EventRecorder
from driver.monitoring.utilization.idle import IdleTracker
from driver.monitoring.utilization.monitor import UtilizationMonitor
from driver.monitoring.utilization.sampler import Sampler

GRACE_SECONDS = 5.0
REGISTRATION_BACKOFF_CAP = 300.0


class StartupError(Exception):
    """The plugin cannot start as configured; the message names the option."""


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
class Plugin:
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
    uevents: UeventMonitor | None = None
    endpoints: list[HttpEndpoint] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _sockets: list[OwnedSocket] = field(default_factory=list)
    _registrar: tuple[grpc.aio.Server, OwnedSocket] | None = None

    @classmethod
    def create(cls, config: Config, kube: Kube | None = None) -> "Plugin":
        instance = Instance.register(config.state_dir, config.pod_uid)
        try:
            return cls._create(config, kube, instance)
        except BaseException:
            instance.release()
            raise

    @classmethod
    def _create(cls, config: Config, kube: Kube | None, instance: Instance) -> "Plugin":
        node = open_node(config, instance=instance)
        mig_records = MigRecords(config.state_dir, instance)
        settings = DiscoverySettings(config.mig_mode)

        def sources():
            return node.sources(config, settings.mig_mode, mig_records.owned)

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
                       config.mps_start_timeout),
            boot_id, inventory)
        mig = MigPartitions(mig_records, node.nvml, node.sysfs, node.proc, boot_id, inventory,
                            claims=checkpoint.records)
        metadata = MetadataFiles(config.state_dir / "metadata", config.driver_name, instance.token)
        metadata.sweep_temp_files(instance.owner_state)
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
            status=status,
            addresses=host_addresses(node.proc),
            metadata=metadata,
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
        prober = Prober(health, node.sysfs, node.dev, node.nvml, config.xid_recovery_seconds)
        metrics.watch_state(
            prepared=lambda: len(checkpoint.uids()),
            devices=lambda: _count_kinds(holder.inventory),
            health=health.summary,
            nics_withheld=lambda: holder.result.nics_withheld_routing_unknown,
        )

        def ready() -> tuple[bool, str]:
            registered = registration.registered.is_set()
            published = publisher.stats.published
            why = f"registered={registered} published={published}"
            if registration.last_error:
                why += f" (kubelet rejected the registration: {registration.last_error})"
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
                status, leader)
            metrics.watch_utilization(DeviceSeries(utilization.views, config.driver_name))
        return cls(config, kube, node, holder, preparer, registration, publisher, rediscovery,
                   health, prober, metrics, Probes(ready), instance, utilization, xid)

    async def start(self) -> None:
        self._listen(self.config.metrics_port, "--metrics-port", metrics=self.metrics.exposition)
        self._listen(self.config.healthz_port, "--healthz-port", probes=self.probes)

        # The API client (its TLS context; for a kubeconfig with an exec plugin, the
        # `kubernetes` package and the plugin) comes after the registration socket, so
        # that the kubelet finds a starting node's driver sooner;
        # a prepare that arrives first makes it or waits for it (Kube.connect). During an
        # upgrade it comes first: a new pod whose kubeconfig only the client's loader
        # rejects must fail before it takes the registration socket from the pod that
        # still works.
        upgrade = bool(self.instance.peers())
        if upgrade:
            await self._connect()
        dra = grpc.aio.server()
        service.add_to_server(dra, self.preparer, self.metrics)
        health_stream.add_to_server(dra, self.health, self.config.node_name)
        await self._serve(dra, OwnedSocket(self.config.dra_socket, self.instance.token))
        await self._offer_registration()
        if not upgrade:
            await self._connect()

        # Publishing, rediscovery and health run beside the servers: an unreachable API
        # server delays slices, never prepare calls for claims already allocated. They
        # start after the client, which the publisher and the sharing loop need at once.
        self._tasks = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self.rediscovery.run(), name="rediscovery"),
            asyncio.create_task(self._probe_loop(), name="health-probe"),
            asyncio.create_task(self.probes.heartbeat(), name="heartbeat"),
            asyncio.create_task(self._sharing_loop(), name="sharing"),
            asyncio.create_task(self._registration_loop(), name="registration"),
        ]
        if self.config.extended_resource_names:
            self._tasks.append(asyncio.create_task(self._check_extended_resources(),
                                                   name="extended-resources"))
        if self.utilization is not None:
            self._tasks.append(asyncio.create_task(
                self.utilization.run(self.config.utilization_interval), name="utilization"))
        if self.xid is not None:
            self.xid.start()
        if self.config.mock is None:
            self.uevents = UeventMonitor(self.rediscovery.notify)
            self.uevents.start()
        structlog.get_logger(component="plugin").info(
            "plugin_serving", driver=self.config.driver_name, node=self.config.node_name,
            dra_socket=str(self.config.dra_socket),
            registration_socket=str(self.config.registration_socket),
            devices=len(self.holder.inventory.devices),
            mock=self.config.mock.name if self.config.mock else None,
            instance=self.instance.token,
        )

    async def _connect(self) -> None:
        """Make the API client, off the loop (the import is ~0.2 s of Python)."""
        try:
            await asyncio.to_thread(self.kube.connect)
        except ClientConfigError as err:
            raise StartupError(str(err)) from err

    def _listen(self, port: int, option: str, **routes) -> None:
        if not port:
            return
        try:
            self.endpoints.append(HttpEndpoint(port, **routes).start())
        except OSError as err:  # lost to a race since the preflight check
            raise StartupError(preflight.port_problem(err, port, option)) from err

    async def _offer_registration(self) -> None:
        """Bind a fresh registration socket and move it onto the public name; the old
        server (if any) stops afterwards, so the kubelet always finds a socket there."""
        server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        sock = OwnedSocket(self.config.registration_socket, self.instance.token)
        server.add_insecure_port(sock.address())
        await server.start()
        sock.publish()
        old, self._registrar = self._registrar, (server, sock)
        if old is not None:
            await old[0].stop(1.0)

    async def _registration_loop(self) -> None:
        """Re-offer the registration socket when the kubelet rejected us or never answered;
        the kubelet itself never retries a socket it has seen."""
        log = structlog.get_logger(component="registration")
        timeout = self.config.registration_timeout
        attempt = 0
        while True:
            waiting = None if self.registration.registered.is_set() else timeout
            outcome = await self.registration.outcome(waiting)
            if outcome:
                attempt = 0
                timeout = self.config.registration_timeout
                continue
            attempt += 1
            if outcome is False:
                delay = min(REGISTRATION_BACKOFF_CAP, 2.0 ** (attempt - 1))
                error = self.registration.last_error
            else:  # no answer at all: the wait was the delay; wait longer next time
                delay = 0.0
                error = f"no NotifyRegistrationStatus from the kubelet within {timeout:g}s"
                timeout = min(REGISTRATION_BACKOFF_CAP, timeout * 2)
            log.warning("kubelet_registration_retry", attempt=attempt, error=error,
                        retry_in=delay, socket=str(self.config.registration_socket))
            await asyncio.sleep(delay)
            await self._offer_registration()

    async def _check_extended_resources(self) -> None:
        """Once, at start: the extended resource names our DeviceClasses serve that the node
        also advertises (a device plugin still running; driver/publish/extendedresources.py)."""
        log = structlog.get_logger(component="extended-resources")
        node = self.config.node_name
        while True:
            try:
                obj = await asyncio.to_thread(self.kube.request, "GET", f"/api/v1/nodes/{node}")
                break
            except ApiError as err:  # the API server is down: look again later
                log.warning("node_lookup_failed", node=node, error=str(err))
                await asyncio.sleep(30)
        found = extendedresources.served_twice(obj or {}, self.config.extended_resource_names)
        for twice in found:
            log.warning("extended_resource_served_twice", node=node, resource=twice.name,
                        allocatable=twice.allocatable, message=twice.message(node))
        try:
            extendedresources.record(self.config.state_dir, self.instance.token, found)
        except OSError as err:
            log.warning("extended_resources_not_recorded", error=str(err))

    async def _sharing_loop(self) -> None:
        """Shared GPUs as the prepared claims need them: after a crash or reboot at once,
        then periodically (a dead MPS daemon, a setup whose undo failed)."""
        log = structlog.get_logger(component="sharing")
        while True:
            try:
                await self.preparer.reconcile_sharing()
            except Exception as err:  # a bug must not end the loop
                log.exception("sharing_reconcile_failed", error=str(err))
            await asyncio.sleep(self.config.sharing_reconcile_interval)

    async def _probe_loop(self) -> None:
        log = structlog.get_logger(component="health")
        try:
            while True:
                try:
                    await asyncio.to_thread(self.prober.probe)
                except Exception as err:  # a probe bug must not end health reporting
                    log.error("health_probe_failed", error=str(err))
                await asyncio.sleep(self.config.health_interval)
        finally:
            self.prober.close()

    async def _serve(self, server: grpc.aio.Server, sock: OwnedSocket) -> None:
        server.add_insecure_port(sock.address())
        await server.start()
        sock.publish()
        self._servers.append(server)
        self._sockets.append(sock)

    async def stop(self) -> None:
        for task in self._tasks:
            if task.get_name() == "registration":
                task.cancel()
        if self._registrar is not None:
            server, sock = self._registrar
            self._registrar = None
            sock.remove()  # first: the kubelet stops sending new calls
            await server.stop(GRACE_SECONDS)
        for server, sock in reversed(list(zip(self._servers, self._sockets))):
            sock.remove()
            await server.stop(GRACE_SECONDS)
        self._servers.clear()
        self._sockets.clear()
        if self.uevents is not None:
            self.uevents.stop()
        if self.xid is not None:
            self.xid.stop()
        if self.preparer.status is not None:  # what is due is written; the rest next time
            await asyncio.to_thread(self.preparer.status.close)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a task that ignores its cancellation (a bug) must not turn a SIGTERM
            # into a hang until the kubelet's SIGKILL; it is named so the bug gets found.
            _, stuck = await asyncio.wait(self._tasks, timeout=GRACE_SECONDS)
            if stuck:
                structlog.get_logger(component="plugin").error(
                    "tasks_not_stopped", tasks=sorted(t.get_name() for t in stuck))
        for endpoint in self.endpoints:
            endpoint.stop()
        # After the servers stopped: nothing new is queued; what is, is finished.
        await asyncio.to_thread(self.preparer.committer.close)
        self.preparer.claims.gets.close()  # the claim GETs' kept-alive connections
        self.preparer.checkpoint.close()
        self.instance.release()
        structlog.get_logger(component="plugin").info("plugin_stopped")


def _count_kinds(inventory: Inventory) -> dict[str, int]:
    counts: dict[str, int] = {}
    for device in inventory.devices:
        counts[device.kind.value] = counts.get(device.kind.value, 0) + 1
    return counts


async def serve(config: Config, kube: Kube | None = None) -> int:
    plugin = Plugin.create(config, kube)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Every claim's file writes run in the default executor (asyncio.to_thread; its GET
    # runs on the loop). Python sizes it from the host's CPU count (6 threads on 2 CPUs,
    # 32 on big hosts), whatever the pod's CPU limit; the work is mostly waiting on the
    # disk, so the size is ours to set, the same on every node.
    loop.set_default_executor(ThreadPoolExecutor(config.claim_workers, thread_name_prefix="claims"))
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await plugin.start()
        # What exists now lives as long as the process: the modules, the configuration,
        # the first inventory (~70,000 objects on sriov-large). Left to the cycle
        # collector, each full collection walked
        # all of it again (~50 ms, about once a minute on an idle sriov-large node);
        # frozen, it walks what came since.
        # Frozen objects are still freed when their last reference goes (the inventory
        # rediscovery replaces); only a cycle among them would outlive its use, and these
        # are made once.
        gc.freeze()
        await stop.wait()
    finally:
        await plugin.stop()
    return 0
