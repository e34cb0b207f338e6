"""The kubelet's DRAResourceHealth stream (v1alpha1): the full device list on every
change and periodically, so pods see allocatedResourcesStatus."""

from __future__ import annotations

import asyncio
import time

import structlog

from types import ModuleType

from driver._proto.health.v1 import api_pb2 as v1_pb2
from driver._proto.health.v1 import api_pb2_grpc as v1_grpc
from driver._proto.health.v1alpha1 import api_pb2 as v1alpha1_pb2
from driver._proto.health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from driver.aio import wait_event
from driver.monitoring.health import HealthState

# Kubelets 1.34-1.36 speak v1alpha1; newer ones v1. Both are served, newest first.
SERVICE_NAMES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
# Kubelets 1.34+ mark a device Unknown 30 s after its last update whatever timeout we
# send, so the full list goes out every 10 s: two lost or late messages are tolerated.
RESEND_SECONDS = 10.0
TIMEOUT_SECONDS = 30


class HealthService:
    """One implementation; `pb2` picks the wire package (v1 or v1alpha1)."""

    def __init__(self, state: HealthState, pool: str, pb2: ModuleType = v1alpha1_pb2,
                 resend_seconds: float = RESEND_SECONDS) -> None:
        self.pb2 = pb2
        self.state = state
        self.pool = pool
        self.resend_seconds = resend_seconds
        self.log = structlog.get_logger(component="health-stream")

    def snapshot(self):
        pb2 = self.pb2
        now = int(time.time())
        response = pb2.NodeWatchResourcesResponse()
        for device in self.state.inventory().devices:
            conditions = self.state.conditions(device.name)
            message = "; ".join(f"{c.reason}: {c.message}" for c in conditions.values())
            response.devices.add(
                device=pb2.DeviceIdentifier(pool_name=self.pool, device_name=device.name),
                health=pb2.UNHEALTHY if conditions else pb2.HEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=TIMEOUT_SECONDS,
                message=message[:1024],
            )
        return response

    async def NodeWatchResources(self, request, context):
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        unsubscribe = self.state.subscribe(lambda: loop.call_soon_threadsafe(changed.set))
        self.log.info("health_stream_opened")
        try:
            while True:
                yield self.snapshot()
                await wait_event(changed, self.resend_seconds)
                changed.clear()
        finally:
            unsubscribe()
            self.log.info("health_stream_closed")


class _V1(HealthService, v1_grpc.DRAResourceHealthServicer):
    pass


class _V1alpha1(HealthService, v1alpha1_grpc.DRAResourceHealthServicer):
    pass


def add_to_server(server, state: HealthState, pool: str) -> None:
    v1_grpc.add_DRAResourceHealthServicer_to_server(_V1(state, pool, v1_pb2), server)
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(_V1alpha1(state, pool, v1alpha1_pb2), server)
