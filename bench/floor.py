"""The floor a prepare is compared with: the primitives it cannot avoid, measured in the
same run on the same machine."""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc

from bench.harness import new_claim
from bench.table import Table
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kube.client import Kube, api_client
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
        self.claim_path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{new_claim(api).name}"
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
