"""Container runtimes for the NRI plugin's tests.

`FakeRuntime` is NRI's runtime side written here from the wire format (mux frames, ttrpc
messages, NRI's messages), deliberately without driver/nri/ttrpc.py, so that a framing
mistake there cannot cancel itself out. `GoRuntime` runs hack/nri-runtime: NRI's own Go
runtime code (pkg/adaptation) as containerd links it.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from driver._proto.nri.v1alpha1 import api_pb2 as api
from driver._proto.ttrpc import request_pb2

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "nri.pkg.api.v1alpha1.Plugin"


def pod(uid: str, netns: str = "", namespace: str = "default", name: str | None = None
        ) -> api.PodSandbox:
    sandbox = api.PodSandbox(id=f"sb-{uid}", uid=uid, namespace=namespace,
                             name=name or f"pod-{uid}")
    if netns:
        sandbox.linux.namespaces.add(type="network", path=netns)
    return sandbox


@dataclass
class Answer:
    code: int
    message: str
    payload: bytes
    seconds: float


@dataclass
class FakeRuntime:
    socket: Path
    pods: list[api.PodSandbox] = field(default_factory=list)
    # Synchronize sends this many pods per message (0: all in one), flagging `more`.
    sync_chunk: int = 0
    request_timeout_ms: int = 2000
    registrations: list[api.RegisterPluginRequest] = field(default_factory=list)
    synchronized: asyncio.Event = field(default_factory=asyncio.Event)
    subscribed: int = 0
    _server: asyncio.AbstractServer | None = None
    _writer: asyncio.StreamWriter | None = None
    _pending: dict[int, asyncio.Future] = field(default_factory=dict)
    _next_stream: int = 1
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def start(self) -> None:
        self.synchronized = asyncio.Event()
        self._server = await asyncio.start_unix_server(self._accept, path=str(self.socket))

    async def stop(self) -> None:
        """The runtime goes away: socket removed, the plugin's connection closed."""
        if self._server is not None:
            self._server.close()
        if self._writer is not None:
            self._writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()
        self.socket.unlink(missing_ok=True)
        self._server = self._writer = None

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending = {}
        self._next_stream = 1
        buffers: dict[int, bytearray] = {}
        try:
            while True:
                conn, length = struct.unpack(">II", await reader.readexactly(8))
                buffer = buffers.setdefault(conn, bytearray())
                buffer += await reader.readexactly(length)
                while len(buffer) >= 10:
                    size, stream, kind, _flags = struct.unpack(">IIBB", buffer[:10])
                    if len(buffer) < 10 + size:
                        break
                    body = bytes(buffer[10:10 + size])
                    del buffer[:10 + size]
                    if conn == 2 and kind == 1:
                        self._registered(stream, body)
                    elif conn == 1 and kind == 2:
                        future = self._pending.pop(stream, None)
                        if future is not None and not future.done():
                            future.set_result(body)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the plugin or the test closed the connection

    def _write(self, conn: int, stream: int, kind: int, body: bytes) -> None:
        message = struct.pack(">IIBB", len(body), stream, kind, 0) + body
        self._writer.write(struct.pack(">II", conn, len(message)) + message)

    def _registered(self, stream: int, body: bytes) -> None:
        request = request_pb2.Request.FromString(body)
        assert (request.service, request.method) == ("nri.pkg.api.v1alpha1.Runtime",
                                                      "RegisterPlugin"), request
        self.registrations.append(api.RegisterPluginRequest.FromString(request.payload))
        self._write(2, stream, 2, b"")  # OK, empty Empty
        self._spawn(self._configure_and_sync())

    async def _configure_and_sync(self) -> None:
        answer = await self.call("Configure", api.ConfigureRequest(
            runtime_name="fake", runtime_version="0", registration_timeout=5000,
            request_timeout=self.request_timeout_ms, NRI_version="v0.12.3"))
        assert answer.code == 0, answer
        self.subscribed = api.ConfigureResponse.FromString(answer.payload).events
        pods = list(self.pods)
        chunk = self.sync_chunk or max(len(pods), 1)
        while True:
            part, pods = pods[:chunk], pods[chunk:]
            more = bool(pods)
            answer = await self.call("Synchronize", api.SynchronizeRequest(pods=part, more=more))
            assert answer.code == 0, answer
            reply = api.SynchronizeResponse.FromString(answer.payload)
            assert reply.more == more and not reply.update
            if not more:
                break
        self.synchronized.set()

    async def call(self, method: str, message, timeout: float | None = None) -> Answer:
        """A unary call on the Plugin service, timed as the runtime times it."""
        timeout = self.request_timeout_ms / 1000 if timeout is None else timeout
        stream = self._next_stream
        self._next_stream += 2
        future = asyncio.get_running_loop().create_future()
        self._pending[stream] = future
        request = request_pb2.Request(service=PLUGIN, method=method,
                                      payload=message.SerializeToString(),
                                      timeout_nano=int(timeout * 1e9))
        started = time.monotonic()
        self._write(1, stream, 1, request.SerializeToString())
        body = await asyncio.wait_for(future, timeout)
        response = request_pb2.Response.FromString(body)
        return Answer(response.status.code, response.status.message, response.payload,
                      time.monotonic() - started)


def go_available() -> str | None:
    if shutil.which("go") is None:
        return "Go is not installed: hack/nri-runtime (NRI's own runtime code) cannot be built"
    return None


def build_go_runtime(directory: Path) -> Path:
    out = directory / "nri-runtime"
    subprocess.run(["go", "build", "-o", str(out), "."], cwd=ROOT / "hack" / "nri-runtime",
                   check=True, capture_output=True, timeout=600,
                   env={**os.environ, "CGO_ENABLED": "0"})
    return out


class GoRuntime:
    """hack/nri-runtime as a child process: JSON commands in, JSON lines out."""

    def __init__(self, binary: Path, socket: Path, args: tuple[str, ...] = ()) -> None:
        self.socket = socket
        self.process = subprocess.Popen([str(binary), "-socket", str(socket), *args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.events: list[dict] = []
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for(lambda e: e.get("event") == "listening", 30)

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def wait_for(self, predicate, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise TimeoutError("nri-runtime: the awaited event did not come") from None
            if event is None:
                raise RuntimeError("nri-runtime exited")
            self.events.append(event)
            if predicate(event):
                return event

    def command(self, op: str, timeout: float = 10, **fields) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        return self.wait_for(lambda e: e.get("op") == op, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
