"""The plugin registration service the kubelet dials on <registrar-dir>/<driver>-reg.sock.

The kubelet registers a plugin once per socket it sees appear: if it rejects us
(NotifyRegistrationStatus with plugin_registered=false) or the notification never comes,
it does not try again by itself. The plugin then re-creates the socket (a new inode the
kubelet's watcher reports as new) with backoff; `outcome()` is what that loop waits on.
"""

from __future__ import annotations

import asyncio

import structlog

from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.aio import wait_event

PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # preferred first


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str, versions: tuple[str, ...] = DRA_SERVICES) -> None:
        if not versions:
            raise ValueError("the kubelet rejects an empty supported_versions list")
        self.driver = driver
        self.endpoint = endpoint
        self.versions = versions
        self.registered = asyncio.Event()
        self.last_error: str | None = None
        # Why the socket is not offered yet (an upgrade: the peer serves until we can).
        self.held: str | None = None
        self._notified = asyncio.Event()
        self.log = structlog.get_logger(component="registration")

    async def outcome(self, timeout: float | None) -> bool | None:
        """Wait for the kubelet's next NotifyRegistrationStatus: True (registered), False
        (rejected), None (nothing within `timeout`)."""
        if not await wait_event(self._notified, timeout):
            return None
        self._notified.clear()
        return self.registered.is_set()

    async def GetInfo(self, request, context):
        return reg_pb2.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint,
                                  supported_versions=list(self.versions))

    async def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            self.last_error = None
            self.registered.set()
            self.log.info("kubelet_registration_succeeded", driver=self.driver)
        else:
            self.last_error = request.error
            self.registered.clear()
            self.log.error("kubelet_registration_failed", driver=self.driver, error=request.error)
        self._notified.set()
        return reg_pb2.RegistrationStatusResponse()
