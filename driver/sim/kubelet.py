"""A fake kubelet: the plugin-registration dance and DRA calls over the real unix sockets.

It does what the kubelet's plugin manager and DRA manager do: find the registration socket
in the registry directory, call GetInfo, validate the answer as the DRA handler does, call
NotifyRegistrationStatus, then dial the advertised endpoint with the newest DRA service
version both sides support.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from driver._proto.dra.v1 import api_pb2 as v1_pb2
from driver._proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver._proto.dra.v1beta1 import api_pb2 as v1beta1_pb2
from driver._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.sim import inotify

VERSIONS = {"v1.DRAPlugin": (v1_pb2, v1_grpc), "v1beta1.DRAPlugin": (v1beta1_pb2, v1beta1_grpc)}


class RegistrationRejected(Exception):
    pass


def validate(info: reg_pb2.PluginInfo, known: tuple[str, ...]) -> str | None:
    """What the kubelet's DRA handler checks before it accepts a plugin."""
    if info.type != "DRAPlugin":
        return f"unexpected plugin type {info.type!r}"
    if not info.endpoint.startswith("/"):
        return f"endpoint {info.endpoint!r} is not absolute"
    if not info.supported_versions:
        return "empty supported_versions"
    if not any(v in known for v in info.supported_versions):
        return f"none of {list(info.supported_versions)} is supported"
    return None


@dataclass
class Claim:
    namespace: str
    name: str
    uid: str


class FakeKubelet:
    def __init__(self, registry: Path, known: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> None:
        self.registry = registry
        self.known = known
        self.info: reg_pb2.PluginInfo | None = None
        self.channel: grpc.Channel | None = None
        self.version: str | None = None

    def wait_for_socket(self, timeout: float = 20.0) -> Path:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # The kubelet ignores dot files; it registers any other socket that appears.
            sockets = [p for p in self.registry.glob("*.sock") if not p.name.startswith(".")]
            if sockets:
                return sockets[0]
            time.sleep(0.05)
        raise TimeoutError(f"no registration socket appeared in {self.registry}")

    def register(self, timeout: float = 20.0) -> reg_pb2.PluginInfo:
        sock = self.wait_for_socket(timeout)
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=1)
            error = self._validate(info)
            stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=error is None, error=error or ""),
                timeout=5)
        if error:
            raise RegistrationRejected(error)
        return self.connect(info)

    def connect(self, info: reg_pb2.PluginInfo) -> reg_pb2.PluginInfo:
        """Dial the DRA endpoint of a registered plugin with the newest common version."""
        self.info = info
        self.version = next(v for v in info.supported_versions if v in self.known)
        self.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
        return info

    def _validate(self, info: reg_pb2.PluginInfo) -> str | None:
        return validate(info, self.known)

    def _stub(self, version: str | None):
        pb2, pb2_grpc = VERSIONS[version or self.version]
        return pb2, pb2_grpc.DRAPluginStub(self.channel)

    def prepare(self, claims: list[Claim], version: str | None = None, timeout: float = 45):
        pb2, stub = self._stub(version)
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        return stub.NodePrepareResources(request, timeout=timeout)

    def prepare_each(self, claims: list[Claim], version: str | None = None,
                     timeout: float = 45) -> list:
        """One request per claim, all in flight at once, as the kubelet sends them for pods
        that start together (a goroutine each). gRPC's futures rather than a thread each: a
        Python thread per request would cost more CPU than the kubelet's goroutines, on
        the cores the driver is measured on."""
        pb2, stub = self._stub(version)
        calls = [stub.NodePrepareResources.future(pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid)]), timeout=timeout)
            for c in claims]
        return [call.result() for call in calls]

    def unprepare(self, claims: list[Claim], version: str | None = None, timeout: float = 45):
        pb2, stub = self._stub(version)
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        return stub.NodeUnprepareResources(request, timeout=timeout)

    def future(self, method: str, claims: list[Claim], version: str | None = None,
               timeout: float = 45):
        """`NodePrepareResources` or `NodeUnprepareResources` as a gRPC future: its caller
        can wait in short steps and act on a signal between them (the demo), rather than
        have an exception raised by a signal handler inside gRPC's own code."""
        pb2, stub = self._stub(version)
        request = getattr(pb2, f"{method}Request")(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        return getattr(stub, method).future(request, timeout=timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


@dataclass
class Attempt:
    socket: str
    inode: int
    outcome: str  # "registered", "rejected: <error>", "no answer", "unreachable: <error>"
    changed_ns: int = 0  # the socket file's ctime: with the inode, which socket this was


@dataclass
class PluginWatcher:
    """The kubelet's plugin watcher and DRA handler, as strict as the real ones.

    Every socket file that appears in the registry (under any non-dot name) is registered
    exactly once: GetInfo, validation, NotifyRegistrationStatus. A socket that was
    rejected, or that the kubelet could not reach, is never tried again; only a new socket
    at the name is. The real watcher learns of a new socket from its create or rename
    event; polling here, a new socket is a new (inode, ctime): the inode number alone
    repeats, since a socket file freed after its replacement was renamed over it gives
    its number to the next one (seen here: every other re-offered registration socket).
    `decide(info, path)` scripts the kubelet's side: None accepts, a string rejects with
    that error, `SILENT` sends no NotifyRegistrationStatus at all.

    Like the real watcher (pluginwatcher's handleCreateEvent), every name created in or
    moved into the registry is stat'ed *before* dot-names are ignored, from its inotify
    event; a name gone by then is an error the real kubelet logs ("Error when handling
    create event ... stat file ... failed"), kept in `errors`. `stat_lag` delays each
    stat, as a busy kubelet's event loop does, so that a test sees every short-lived name.
    """

    registry: Path
    known: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    decide: Callable[[reg_pb2.PluginInfo, Path], str | None] = lambda info, path: None
    poll_seconds: float = 0.02
    attempts: list[Attempt] = field(default_factory=list)
    registered: dict[str, reg_pb2.PluginInfo] = field(default_factory=dict)  # socket -> info
    stat_lag: float = 0.0
    errors: list[str] = field(default_factory=list)
    _seen: set = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _events: threading.Thread | None = None

    SILENT = "<no NotifyRegistrationStatus>"

    def __enter__(self) -> "PluginWatcher":
        self.registry.mkdir(parents=True, exist_ok=True)
        watch = inotify.Watch(str(self.registry))  # before the first poll: no event missed
        self._events = threading.Thread(target=self._stat_events, args=(watch,), daemon=True,
                                        name="plugin-watcher-events")
        self._events.start()
        self._thread = threading.Thread(target=self._run, daemon=True, name="plugin-watcher")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in (self._thread, self._events):
            if thread is not None:
                thread.join(5)

    def _stat_events(self, watch: "inotify.Watch") -> None:
        due: list[tuple[float, str]] = []  # (when, name), in arrival order
        try:
            while not self._stop.is_set() or due:
                wait = max(0.0, min(due[0][0] - time.monotonic(), 0.1)) if due else 0.1
                due += [(time.monotonic() + self.stat_lag, n) for n in watch.read(wait)]
                while due and due[0][0] <= time.monotonic():
                    _, name = due.pop(0)
                    path = self.registry / name
                    try:
                        path.stat()
                    except FileNotFoundError:
                        with self._changed:
                            self.errors.append(f"Error when handling create event: stat file {path} "
                                               "failed: no such file or directory")
                if self._stop.is_set() and due:
                    time.sleep(max(0.0, due[0][0] - time.monotonic()))
        finally:
            watch.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            present = {}
            for path in self.registry.glob("*"):
                if path.name.startswith("."):
                    continue  # the kubelet ignores dot files
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                present[path.name] = (stat.st_ino, stat.st_ctime_ns)
            with self._changed:
                for name in list(self.registered):
                    if name not in present:
                        del self.registered[name]  # socket removed: plugin deregistered
                        self._changed.notify_all()
            for name, identity in sorted(present.items()):
                if (name, identity) not in self._seen:
                    self._seen.add((name, identity))
                    self._register(self.registry / name, *identity)
            self._stop.wait(self.poll_seconds)

    def _register(self, path: Path, inode: int, changed_ns: int) -> None:
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                stub = reg_grpc.RegistrationStub(channel)
                info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=1)
                error = validate(info, self.known) or self.decide(info, path)
                if error == self.SILENT:
                    outcome = "no answer"
                else:
                    stub.NotifyRegistrationStatus(
                        reg_pb2.RegistrationStatus(plugin_registered=error is None, error=error or ""),
                        timeout=5)
                    outcome = "registered" if error is None else f"rejected: {error}"
        except (grpc.RpcError, grpc.FutureTimeoutError) as err:
            info, outcome = None, f"unreachable: {err}"
        with self._changed:
            self.attempts.append(Attempt(path.name, inode, outcome, changed_ns))
            if outcome == "registered":
                self.registered[path.name] = info
            self._changed.notify_all()

    def wait(self, predicate: Callable[["PluginWatcher"], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.2))
        return True

    def client(self, socket_name: str) -> FakeKubelet:
        """A DRA client for a registered plugin (what the kubelet's DRA manager dials)."""
        with self._changed:
            info = self.registered[socket_name]
        kubelet = FakeKubelet(self.registry, self.known)
        kubelet.connect(info)
        return kubelet
