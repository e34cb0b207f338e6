"""A fake kubelet: the plugin-registration dance and DRA calls over the real unix sockets.

It does what the kubelet's plugin manager and DRA manager do: find the registration socket
in the registry directory, call GetInfo, validate the answer as the DRA handler does, call
NotifyRegistrationStatus, then dial the advertised endpoint with the newest DRA service
version both sides support.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver._proto.dra.v1 import api_pb2 as v1_pb2
from driver._proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver._proto.dra.v1beta1 import api_pb2 as v1beta1_pb2
from driver._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

VERSIONS = {"v1.DRAPlugin": (v1_pb2, v1_grpc), "v1beta1.DRAPlugin": (v1beta1_pb2, v1beta1_grpc)}


class RegistrationRejected(Exception):
    pass


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
        self.info = info
        self.version = next(v for v in info.supported_versions if v in self.known)
        self.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
        return info

    def _validate(self, info: reg_pb2.PluginInfo) -> str | None:
        if info.type != "DRAPlugin":
            return f"unexpected plugin type {info.type!r}"
        if not info.endpoint.startswith("/"):
            return f"endpoint {info.endpoint!r} is not absolute"
        if not info.supported_versions:
            return "empty supported_versions"
        if not any(v in self.known for v in info.supported_versions):
            return f"none of {list(info.supported_versions)} is supported"
        return None

    def _stub(self, version: str | None):
        pb2, pb2_grpc = VERSIONS[version or self.version]
        return pb2, pb2_grpc.DRAPluginStub(self.channel)

    def prepare(self, claims: list[Claim], version: str | None = None, timeout: float = 45):
        pb2, stub = self._stub(version)
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        return stub.NodePrepareResources(request, timeout=timeout)

    def unprepare(self, claims: list[Claim], version: str | None = None, timeout: float = 45):
        pb2, stub = self._stub(version)
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        return stub.NodeUnprepareResources(request, timeout=timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
