"""The NRI plugin: register with the container runtime, follow its pod sandboxes.

The runtime (containerd 2.x by default, CRI-O with enable_nri) listens on the NRI socket.
We dial it, serve NRI's Plugin service on mux connection 1 and call RegisterPlugin on
connection 2; the runtime then calls Configure (we answer with the events we want),
Synchronize (every pod it knows, possibly in several messages flagged `more`), and from
then on RunPodSandbox, StopPodSandbox and RemovePodSandbox as pods come and go, and
CreateContainer for each of their containers. Each call must be answered within the
request timeout Configure names (2 s by default): a call that times out makes the runtime drop the plugin and carry on without it, so a
slow handler is answered with an error before that, and the pod is retried by the kubelet.

When the runtime restarts the socket goes away; we dial again with backoff, and the new
registration's Synchronize tells the pod handler what it missed. While we are away the
runtime starts sandboxes and containers without us; CreateContainer is where a container
is refused when what its pod needs from us is not in place (the kubelet retries it), and
containerd's default validator (`required_plugins`, or the pod annotation
`required-plugins.noderesource.dev`) refuses it while we are not registered at all.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Protocol, Sequence

import structlog

from driver.aio import within
from driver._proto.nri.v1alpha1 import api_pb2 as api
from driver.nri import ttrpc

log = structlog.get_logger("driver.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = Path("/var/run/nri/nri.sock")
# NRI's own default for a plugin's request timeout, used until Configure names one.
DEFAULT_REQUEST_TIMEOUT = 2.0
# Share of the runtime's request timeout a pod event may take before we answer with an
# error: the answer itself must still reach the runtime in time.
HANDLER_BUDGET = 0.75
# Our NRI version as the runtime logs it; we speak the API of this module version.
NRI_VERSION = "v0.12.3"


def event_mask(*events: int) -> int:
    """NRI's subscription bit set: event E is bit E-1."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


# CreateContainer too: a sandbox may have started while we were away (no plugin, or one
# the runtime closed after a timeout), and its containers must not run without their NIC.
SUBSCRIBED = event_mask(api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX,
                        api.CREATE_CONTAINER)


class PodEvents(Protocol):
    """What the plugin tells the rest of the driver. Each may raise; the runtime gets
    the error (a failed RunPodSandbox fails the pod's sandbox, and the kubelet retries)."""

    async def synchronize(self, pods: Sequence[api.PodSandbox]) -> None: ...

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None: ...

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None: ...

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None: ...

    async def create_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@dataclass(frozen=True)
class NriOptions:
    socket: Path = DEFAULT_SOCKET
    # The runtime calls plugins in ascending index order; name and index form the
    # plugin's identity in the runtime's logs ("10-dra-accel-driver").
    name: str = "dra-accel-driver"
    index: str = "10"
    registration_timeout: float = 5.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0


def netns_path(pod: api.PodSandbox) -> str | None:
    """The pod sandbox's network namespace, as the runtime passes it (None: the pod
    shares the host's network, or the runtime did not say)."""
    for namespace in pod.linux.namespaces:
        if namespace.type == "network" and namespace.path:
            return namespace.path
    return None


@dataclass
class NriPlugin:
    options: NriOptions
    events: PodEvents
    # Set while registered and synchronized; cleared when the connection goes.
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Completed registrations (a reconnect adds one).
    sessions: int = 0
    # Seconds each RunPodSandbox took to answer, the most recent first-in-first-out.
    run_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    # (event, seconds, failed) for each pod event answered: the driver's metrics
    observe: Callable[[str, float, bool], None] = lambda event, seconds, failed: None
    _endpoint: ttrpc.Endpoint | None = None
    _sync_pods: list[api.PodSandbox] = field(default_factory=list)

    async def run(self) -> None:
        """Stay registered until cancelled: dial, register, serve; on any loss dial again
        after a backoff that doubles up to backoff_max and starts over once registered."""
        delay = self.options.backoff_initial
        quiet = False  # one warning per outage, not one per dial
        while True:
            registered_before = self.sessions
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (OSError, ttrpc.ConnectionClosed, ttrpc.ProtocolError,
                    ttrpc.RemoteError, asyncio.TimeoutError) as err:
                (log.debug if quiet else log.warning)(
                    "nri_disconnected", socket=str(self.options.socket),
                    error=str(err) or type(err).__name__, retry_in=round(delay, 2))
                quiet = True
            finally:
                self.ready.clear()
            if self.sessions > registered_before:
                delay = self.options.backoff_initial
                quiet = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.options.backoff_max)

    async def _session(self) -> None:
        reader, writer = await asyncio.open_unix_connection(str(self.options.socket))
        endpoint = ttrpc.Endpoint(reader, writer, {ttrpc.PLUGIN_SERVICE_CONN: self._services()})
        self._endpoint = endpoint
        self._sync_pods = []
        serving = asyncio.create_task(endpoint.run(), name="nri-trunk")
        try:
            request = api.RegisterPluginRequest(plugin_name=self.options.name,
                                                plugin_idx=self.options.index,
                                                NRI_version=NRI_VERSION)
            register = asyncio.create_task(endpoint.call(
                ttrpc.RUNTIME_SERVICE_CONN, RUNTIME_SERVICE, "RegisterPlugin",
                request.SerializeToString(), self.options.registration_timeout))
            done, _ = await asyncio.wait({serving, register},
                                         return_when=asyncio.FIRST_COMPLETED)
            if register not in done:
                register.cancel()
            await register  # raises what registration failed with
            log.info("nri_registered", socket=str(self.options.socket),
                     plugin=f"{self.options.index}-{self.options.name}")
            await serving
        finally:
            serving.cancel()
            await endpoint.close()
            self._endpoint = None

    def _services(self) -> dict[tuple[str, str], ttrpc.Handler]:
        def method(name: str, request_type, handler: Callable[[object], Awaitable[object]]):
            async def serve(payload: bytes) -> bytes:
                request = request_type()
                try:
                    request.ParseFromString(payload)
                except Exception as err:  # noqa: BLE001 - any decode error
                    raise ttrpc.RemoteError(ttrpc.Code.INVALID_ARGUMENT,
                                            f"{name}: undecodable request: {err}") from err
                reply = await handler(request)
                return reply.SerializeToString()
            return (PLUGIN_SERVICE, name), serve

        return dict([
            method("Configure", api.ConfigureRequest, self._configure),
            method("Synchronize", api.SynchronizeRequest, self._synchronize),
            method("Shutdown", api.Empty, self._shutdown),
            method("RunPodSandbox", api.RunPodSandboxRequest, self._run_pod_sandbox),
            method("StopPodSandbox", api.StopPodSandboxRequest, self._stop_pod_sandbox),
            method("RemovePodSandbox", api.RemovePodSandboxRequest, self._remove_pod_sandbox),
            method("CreateContainer", api.CreateContainerRequest, self._create_container),
        ])

    async def _configure(self, request: api.ConfigureRequest) -> api.ConfigureResponse:
        if request.request_timeout > 0:
            self.request_timeout = request.request_timeout / 1000
        log.info("nri_configured", runtime=request.runtime_name,
                 runtime_version=request.runtime_version, nri_version=request.NRI_version,
                 request_timeout_s=self.request_timeout)
        return api.ConfigureResponse(events=SUBSCRIBED)

    async def _synchronize(self, request: api.SynchronizeRequest) -> api.SynchronizeResponse:
        self._sync_pods.extend(request.pods)
        if request.more:
            # A split sync: the runtime wants `more` echoed and no updates until the last.
            return api.SynchronizeResponse(more=True)
        pods, self._sync_pods = self._sync_pods, []
        await self._bounded("Synchronize", None, self.events.synchronize(pods))
        self.sessions += 1
        self.ready.set()
        log.info("nri_synchronized", pods=len(pods))
        return api.SynchronizeResponse()

    async def _shutdown(self, _request: api.Empty) -> api.Empty:
        log.info("nri_runtime_shutting_down")
        return api.Empty()

    async def _run_pod_sandbox(self, request: api.RunPodSandboxRequest
                               ) -> api.RunPodSandboxResponse:
        started = time.monotonic()
        try:
            await self._bounded("RunPodSandbox", request.pod,
                                self.events.run_pod_sandbox(request.pod))
        finally:
            self.run_latencies.append(time.monotonic() - started)
        return api.RunPodSandboxResponse()

    async def _stop_pod_sandbox(self, request: api.StopPodSandboxRequest
                                ) -> api.StopPodSandboxResponse:
        await self._bounded("StopPodSandbox", request.pod,
                            self.events.stop_pod_sandbox(request.pod))
        return api.StopPodSandboxResponse()

    async def _remove_pod_sandbox(self, request: api.RemovePodSandboxRequest
                                  ) -> api.RemovePodSandboxResponse:
        await self._bounded("RemovePodSandbox", request.pod,
                            self.events.remove_pod_sandbox(request.pod))
        return api.RemovePodSandboxResponse()

    async def _create_container(self, request: api.CreateContainerRequest
                                ) -> api.CreateContainerResponse:
        # No adjustment: an error refuses the container, the kubelet retries it later.
        await self._bounded("CreateContainer", request.pod,
                            self.events.create_container(request.pod, request.container))
        return api.CreateContainerResponse()

    async def _bounded(self, event: str, pod: api.PodSandbox | None, work: Awaitable) -> None:
        """Run `work` but answer before the runtime's deadline. The work is shielded, not
        cancelled: a half-done netlink change must finish and be recorded, and the pod's
        next event (or the next Synchronize) finds it."""
        started = time.monotonic()
        failed = True
        try:
            await self._within_budget(event, pod, work)
            failed = False
        finally:
            self.observe(event, time.monotonic() - started, failed)

    async def _within_budget(self, event: str, pod: api.PodSandbox | None,
                             work: Awaitable) -> None:
        budget = self.request_timeout * HANDLER_BUDGET
        task = asyncio.ensure_future(work)
        pod_fields = {} if pod is None else {"pod": f"{pod.namespace}/{pod.name}",
                                             "pod_uid": pod.uid}
        try:
            await within(task, budget)
        except asyncio.TimeoutError:
            log.error("nri_event_too_slow", nri_event=event, budget_s=round(budget, 3),
                      **pod_fields)
            raise ttrpc.RemoteError(ttrpc.Code.UNAVAILABLE,
                                    f"{event} took longer than {budget:.2f}s; "
                                    "the driver finishes it in the background") from None
        except ttrpc.RemoteError:
            raise
        except Exception as err:  # noqa: BLE001 - becomes the runtime's error for this pod
            log.error("nri_event_failed", nri_event=event, error=str(err), **pod_fields)
            raise ttrpc.RemoteError(ttrpc.Code.UNKNOWN, f"{event}: {err}") from err
