"""The floor a prepare is compared with: the primitives it cannot avoid, measured in the
same run on the same machine."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import urllib.parse
import uuid
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.harness import DRIVER, new_claim
from bench.table import Table
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kube.asyncclient import _connect, _response
from driver.kube.client import USER_AGENT, Kube, api_client
from driver.prepare.claimstatus import APPLY
from driver.sim.apiserver import ApiServer
from driver.state import atomic


class _Echo(reg_grpc.RegistrationServicer):
    def GetInfo(self, request, context):
        return reg_pb2.PluginInfo()

class Floor:
    """What a prepare cannot avoid, one primitive at a time: a gRPC round trip on a unix
    socket, a claim GET with the driver's client, an atomic write of a new file with and
    without fsync, and (for unprepare) a durable remove. Sampled between the prepares it
    is compared with (`sample`), so that both meet the same state of the machine: this
    VM's disk is much slower for a while after a burst of file creation (a durable write
    0.4 ms, then 1.2 ms a minute later), and a floor measured before the start-up section
    that writes the mock trees was not the floor the prepares met."""

    def __init__(self, api: ApiServer, scratch: Path) -> None:
        directory = self.directory = Path(tempfile.mkdtemp(prefix="floor-", dir=scratch))
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        reg_grpc.add_RegistrationServicer_to_server(_Echo(), self.server)
        self.server.add_insecure_port(f"unix://{directory / 'echo.sock'}")
        self.server.start()
        self.channel = grpc.insecure_channel(f"unix://{directory / 'echo.sock'}")
        self.stub = reg_grpc.RegistrationStub(self.channel)
        self.kube = Kube(api_client(api.kubeconfig(directory)))
        # the version the driver would use (v1beta1 on 1.32, v1beta2 on 1.33, else v1)
        self.claim_path = (f"/apis/resource.k8s.io/{self.kube.resource_version()}/namespaces/default/"
                           f"resourceclaims/{new_claim(api).name}")
        self.stub.GetInfo(reg_pb2.InfoRequest())
        self.kube.request("GET", self.claim_path)
        self.times: dict[str, list[float]] = {"grpc": [], "get": [], "write": [], "write_cached": [],
                                              "remove": []}
        self._previous: Path | None = None

    def grpc(self) -> float:
        t = time.perf_counter()
        self.stub.GetInfo(reg_pb2.InfoRequest())
        return self._note("grpc", t)

    def get(self) -> float:
        t = time.perf_counter()
        self.kube.request("GET", self.claim_path)
        return self._note("get", t)

    def write(self) -> float:
        """A file of a new name, as a prepare writes for a new claim's UID."""
        path = self.directory / f"w-{uuid.uuid4()}.json"
        t = time.perf_counter()
        atomic.write(path, b"{" + b" " * 600 + b"}")
        self._previous = path
        return self._note("write", t)

    def write_cached(self) -> float:
        """The same without fsync, as the CDI spec is written (docs/crash-safety.md)."""
        path = self.directory / f"c-{uuid.uuid4()}.json"
        t = time.perf_counter()
        atomic.write(path, b"{" + b" " * 600 + b"}", durable=False)
        elapsed = self._note("write_cached", t)
        path.unlink()
        return elapsed

    def remove(self) -> float:
        """The file `write` made, removed durably, as an unprepare removes a spec."""
        assert self._previous is not None
        t = time.perf_counter()
        atomic.remove(self._previous)
        return self._note("remove", t)

    def sample(self) -> None:
        self.grpc(), self.get(), self.write(), self.write_cached(), self.remove()

    def _note(self, what: str, started: float) -> float:
        elapsed = time.perf_counter() - started
        self.times[what].append(elapsed)
        return elapsed

    def prepare(self) -> float:
        """gRPC + GET + the two writes: the CDI spec (not fsynced since 2026-12-04), then
        the checkpoint record (durable)."""
        return (statistics.median(self.times["grpc"]) + statistics.median(self.times["get"])
                + statistics.median(self.times["write_cached"]) + statistics.median(self.times["write"]))

    def unprepare(self) -> float:
        """gRPC + two durable removes (the spec, then the record)."""
        return statistics.median(self.times["grpc"]) + 2 * statistics.median(self.times["remove"])

    def rows(self, table: Table, label: str = "") -> None:
        table.latency(f"baseline: gRPC unary, unix socket{label}", self.times["grpc"])
        table.latency(f"baseline: claim GET (the driver's client){label}", self.times["get"])
        table.latency(f"baseline: atomic write+fsync+rename, a new file{label}", self.times["write"])
        table.latency(f"baseline: the same without fsync{label}", self.times["write_cached"])
        table.latency(f"baseline: unlink+fsync of the directory{label}", self.times["remove"])

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


@dataclass(frozen=True)
class BurstClaim:
    namespace: str
    name: str
    uid: str


class BurstFloor:
    """What a node's burst of one-claim prepares cannot avoid against an API server: for
    each claim the driver's claim GET and its status apply (server-side apply of
    `status.devices`, the driver's field manager, the body the driver sends), with the
    driver's credentials, every claim at once, each on a kept-alive connection of its own,
    as `clients` goroutines of a Go client would do them. No driver, no gRPC, no files:
    the API work alone, from an event loop (Python threads would spend the cores the
    server needs on the interpreter lock).

    The connections are opened (TLS included) before a burst, as the driver's are warm
    after its first claims."""

    def __init__(self, kubeconfig: Path, clients: int = 64) -> None:
        self.kube = Kube(api_client(kubeconfig))
        self.client = self.kube.ensure_client("GET", "/")
        self.version = self.kube.resource_version()  # as the driver's applies use it
        self.clients = clients
        self.loop = asyncio.new_event_loop()
        self._idle: list = []

    async def _connection(self):
        if self._idle:
            return self._idle.pop()
        return await _connect(self.client, self.kube.timeout)

    async def _request(self, connection, method: str, path: str, body: bytes = b"",
                       content_type: str = "") -> tuple[int, bytes]:
        host = urllib.parse.urlsplit(self.client.config.server).netloc
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"User-Agent: {USER_AGENT}",
                 "Accept: application/json"]
        lines += [f"{k}: {v}" for k, v in self.client.config.headers().items()]
        if body:
            lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        connection.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        status, _, answer, reusable = await _response(connection.reader)
        if not reusable:
            raise RuntimeError(f"{method} {path}: the server closed the connection")
        return status, answer

    async def _one(self, claim: BurstClaim, body: bytes, started: float) -> float:
        connection = await self._connection()
        base = f"/apis/resource.k8s.io/{self.version}/namespaces/{claim.namespace}/resourceclaims/{claim.name}"
        status, answer = await self._request(connection, "GET", base)
        if status != 200:
            raise RuntimeError(f"GET {base}: {status} {answer[:200]!r}")
        # the driver reads the claim before it writes; so does the floor
        if json.loads(answer)["metadata"]["uid"] != claim.uid:
            raise RuntimeError(f"GET {base}: another claim's UID")
        path = f"{base}/status?fieldManager={DRIVER}&force=true"
        status, answer = await self._request(connection, "PATCH", path, body, APPLY)
        if status != 200:
            raise RuntimeError(f"PATCH {path}: {status} {answer[:200]!r}")
        elapsed = time.perf_counter() - started
        self._idle.append(connection)
        return elapsed

    async def _warm(self) -> None:
        missing = self.clients - len(self._idle)
        self._idle += await asyncio.gather(*(_connect(self.client, self.kube.timeout) for _ in range(missing)))

    async def _burst(self, claims: list[BurstClaim], bodies: list[bytes]) -> tuple[float, list[float]]:
        await self._warm()
        started = time.perf_counter()
        latencies = await asyncio.gather(*(self._one(c, b, started) for c, b in zip(claims, bodies)))
        return time.perf_counter() - started, list(latencies)

    def burst(self, claims: list[BurstClaim], entries: list[dict]) -> tuple[float, list[float]]:
        """(seconds for all, each claim's seconds from the start until its apply was
        answered). `entries`: the claim's `status.devices` as the driver applies them."""
        bodies = [json.dumps({"apiVersion": f"resource.k8s.io/{self.version}", "kind": "ResourceClaim",
                              "metadata": {"name": c.name, "namespace": c.namespace, "uid": c.uid},
                              "status": {"devices": entries}}).encode() for c in claims]
        return self.loop.run_until_complete(self._burst(claims, bodies))

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle = []
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()
