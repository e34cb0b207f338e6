"""The kubelet DRA service, v1 and v1beta1, as thin adapters over one Preparer.

The two versions are wire-identical except for v1's `share_id`; each adapter only converts
messages, so the behaviour cannot drift between versions.
"""

from __future__ import annotations

import time
from types import ModuleType

import grpc

from driver._proto.dra.v1 import api_pb2 as v1_pb2
from driver._proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver._proto.dra.v1beta1 import api_pb2 as v1beta1_pb2
from driver._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from driver.prepare.claims import ClaimRef
from driver.metrics import Metrics
from driver.prepare.preparer import Preparer, base_request


class _DraService:
    def __init__(self, preparer: Preparer, pb2: ModuleType, version: str,
                 metrics: Metrics | None = None) -> None:
        self.preparer = preparer
        self.metrics = metrics
        self.pb2 = pb2
        self.version = version
        self.share_ids = "share_id" in pb2.Device.DESCRIPTOR.fields_by_name

    async def NodePrepareResources(self, request, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        outcomes = await self.preparer.prepare(refs)
        response = self.pb2.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for prepared in outcome.devices:
                device = entry.devices.add(
                    request_names=[base_request(prepared.request)],
                    pool_name=prepared.pool,
                    device_name=prepared.device,
                    cdi_device_ids=list(prepared.cdi_ids),
                )
                if self.share_ids and prepared.share_id:
                    device.share_id = prepared.share_id
        self._observe("prepare", started, sum(1 for o in outcomes.values() if o.error))
        return response

    async def NodeUnprepareResources(self, request, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        errors = await self.preparer.unprepare(refs)
        response = self.pb2.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        self._observe("unprepare", started, sum(1 for e in errors.values() if e))
        return response

    def _observe(self, method: str, started: float, failed_claims: int) -> None:
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.requests.labels(method, self.version).inc()
            self.metrics.latency.labels(method, self.version).observe(seconds)
            if failed_claims:
                self.metrics.claim_errors.labels(method, self.version).inc(failed_claims)


class V1Service(_DraService, v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer, metrics: Metrics | None = None) -> None:
        super().__init__(preparer, v1_pb2, "v1", metrics)


class V1beta1Service(_DraService, v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer, metrics: Metrics | None = None) -> None:
        super().__init__(preparer, v1beta1_pb2, "v1beta1", metrics)


def add_to_server(server: grpc.aio.Server, preparer: Preparer, metrics: Metrics | None = None) -> None:
    v1_grpc.add_DRAPluginServicer_to_server(V1Service(preparer, metrics), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Service(preparer, metrics), server)
