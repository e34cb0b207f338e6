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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import structlog

from driver.service import loops, preflight
from driver.aio import wait_event
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.service.assembly import CapacityGauges, Parts, assemble
from driver.service.config import Config
from driver.devices.driverwait import LIBRARY, DriverWait
from driver.kube.client import ClientConfigError, Kube
from driver.kubelet import health as health_stream
from driver.kubelet import service
from driver.kubelet.sockets import OwnedSocket
from driver.monitoring.probes import HttpEndpoint, Probes
from driver.publish.hotplug import UeventMonitor
from driver.state.instance import Instance

GRACE_SECONDS = 5.0


class StartupError(Exception):
    """The plugin cannot start as configured; the message names the option."""


@dataclass
class Plugin(Parts):
    """The parts (driver/service/assembly.py) started in the order the kubelet needs, serving, and
    stopped in the reverse order."""

    uevents: UeventMonitor | None = None
    endpoints: list[HttpEndpoint] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _sockets: list[OwnedSocket] = field(default_factory=list)
    _registrar: tuple[grpc.aio.Server, OwnedSocket] | None = None

    @classmethod
    def create(cls, config: Config, kube: Kube | None = None,
               capacity_gauges: CapacityGauges | None = None) -> "Plugin":
        instance = Instance.register(config.state_dir, config.pod_uid)
        try:
            parts = assemble(config, kube, instance, capacity_gauges)
        except BaseException:
            instance.release()
            raise
        return cls(**vars(parts))

    async def start(self) -> None:
        self._listen(self.config.metrics_port, "--metrics-port", metrics=self.metrics.exposition)
        self._listen(self.config.healthz_port, "--healthz-port", probes=self.probes)

        # The API client (its TLS context; for a kubeconfig with an exec plugin, the
        # `kubernetes` package and the plugin) comes after the registration socket, so
        # that the kubelet finds a starting node's driver sooner;
        # a prepare that arrives first makes it or waits for it (Kube.connect); with no
        # other instance there is nobody to take the node's prepares from. During an
        # upgrade the registration waits until this instance has published its slices
        # (its credentials, CA and network work; loops.register_when_serving): the kubelet
        # sends every new call to the newest registration, and a new pod that cannot read
        # claims would take them from the pod that still can.
        upgrade = bool(self.instance.peers())
        if upgrade:
            await self._connect()
        dra = grpc.aio.server()
        service.add_to_server(dra, self.preparer, self.metrics)
        health_stream.add_to_server(dra, self.health, self.config.node_name)
        await self._serve(dra, OwnedSocket(self.config.dra_socket, self.instance.token))
        if not upgrade:
            await self._offer_registration()
            await self._connect()

        # Publishing, rediscovery and health run beside the servers: an unreachable API
        # server delays slices, never prepare calls for claims already allocated. They
        # start after the client, which the publisher and the sharing loop need at once.
        self._tasks = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self.rediscovery.run(), name="rediscovery"),
            asyncio.create_task(loops.probe(self.prober, self.config.health_interval),
                                name="health-probe"),
            asyncio.create_task(self.probes.heartbeat(), name="heartbeat"),
            asyncio.create_task(loops.reconcile_sharing(self.preparer,
                                                        self.config.sharing_reconcile_interval),
                                name="sharing"),
            asyncio.create_task(self._registration(held=upgrade), name="registration"),
        ]
        if self.config.extended_resource_names:
            self._tasks.append(asyncio.create_task(loops.check_extended_resources(
                self.kube, self.config.node_name, self.config.extended_resource_names,
                self.config.state_dir, self.instance.token),
                                                   name="extended-resources"))
        if self.utilization is not None:
            self._tasks.append(asyncio.create_task(
                self.utilization.run(self.config.utilization_interval), name="utilization"))
        if self.nri is not None:
            # After the servers: a pod's claims are prepared before its sandbox is made.
            self._tasks.append(asyncio.create_task(self.nri.run(), name="nri"))
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

    async def _registration(self, held: bool) -> None:
        """The registration socket, offered now (`held` False: already offered) or once
        this instance can serve, then offered again until the kubelet takes it."""
        if held:
            await loops.register_when_serving(self.registration, lambda: self.publisher.stats.published,
                                              self.instance.peers)
            await self._offer_registration()
        await loops.reoffer_registration(self.registration, self._offer_registration,
                                         self.config.registration_timeout,
                                         self.config.registration_socket)

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
        sock.publish(replaces=self._registrar[1] if self._registrar is not None else None)
        old, self._registrar = self._registrar, (server, sock)
        if old is not None:
            await old[0].stop(1.0)

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


async def serve(config: Config, kube: Kube | None = None, capacity_gauges: CapacityGauges | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # Before the plugin is made: its first discovery loads NVML from the installation.
    if not await wait_for_nvidia_driver(config, stop):
        return 0  # stopped while waiting; nothing was started
    plugin = Plugin.create(config, kube, capacity_gauges)
    # Every claim's file writes run in the default executor (asyncio.to_thread; its GET
    # runs on the loop). Python sizes it from the host's CPU count (6 threads on 2 CPUs,
    # 32 on big hosts), whatever the pod's CPU limit; the work is mostly waiting on the
    # disk, so the size is ours to set, the same on every node.
    loop.set_default_executor(ThreadPoolExecutor(config.claim_workers, thread_name_prefix="claims"))
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


NVIDIA_WAIT_POLL_SECONDS = 1.0


async def wait_for_nvidia_driver(config: Config, stop: asyncio.Event) -> bool:
    """On a node with NVIDIA GPUs whose driver installation has no NVML library yet (the GPU
    operator's driver container has not mounted it; driver/devices/driverwait.py), wait
    for it up to --nvidia-driver-wait, serving /livez (ok) and /readyz (not ready, saying
    why) meanwhile. After the bound the driver starts without GPUs and says so; rediscovery
    loads the library when it appears (driver/service/node.py). False when stopped while waiting."""
    if config.mock is not None or not config.nvidia_driver_wait:
        return True  # a mock node's NVML lives in this process
    wait = DriverWait(config.sysfs_root, config.nvidia_driver_root_mount)
    gpus = wait.gpus_without_library()
    if not gpus:
        return True
    log = structlog.get_logger(component="plugin")
    root, bound = str(config.nvidia_driver_root), config.nvidia_driver_wait
    log.info("nvidia_driver_waiting", driver_root=root, library=LIBRARY, gpus_on_pci=gpus,
             timeout_seconds=bound)
    started = time.monotonic()

    def ready() -> tuple[bool, str]:
        return False, (f"waiting for the NVIDIA driver: no {LIBRARY} under {root} yet, {gpus} "
                       f"NVIDIA GPU(s) on the PCI bus ({time.monotonic() - started:.0f}s of at "
                       f"most {bound:g}s, --nvidia-driver-wait)")

    probes = Probes(ready)
    endpoint = None
    if config.healthz_port:
        try:
            endpoint = HttpEndpoint(config.healthz_port, probes=probes).start()
        except OSError as err:
            raise StartupError(preflight.port_problem(err, config.healthz_port, "--healthz-port")) from err
    heartbeat = asyncio.create_task(probes.heartbeat(), name="heartbeat")
    library = None
    try:
        while not stop.is_set():
            library = wait.library()
            remaining = started + bound - time.monotonic()
            if library is not None or remaining <= 0:
                break
            await wait_event(stop, min(NVIDIA_WAIT_POLL_SECONDS, remaining))
    finally:
        heartbeat.cancel()
        if endpoint is not None:
            endpoint.stop()  # the plugin serves the probes on the same port next
    waited = round(time.monotonic() - started, 1)
    if library is not None:
        log.info("nvidia_driver_wait_ended", found=True, library=str(library), waited_seconds=waited)
    elif stop.is_set():
        log.info("nvidia_driver_wait_ended", found=False, waited_seconds=waited, reason="stopping")
    else:
        log.warning("nvidia_driver_wait_ended", found=False, waited_seconds=waited, driver_root=root,
                    reason=f"no {LIBRARY} within {bound:g}s: starting without GPUs; rediscovery "
                           "publishes them once it appears (--rediscover-interval)")
    return not stop.is_set()
