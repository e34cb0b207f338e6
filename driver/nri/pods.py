"""Which pod gets which of our NICs, and the moves on the runtime's pod sandbox events.

A pod's NICs are the NIC devices of the claims prepared for it: the prepared-claims
checkpoint names each claim's namespace and the pods its `status.reservedFor` listed at
prepare, and NRI's PodSandbox names the pod's namespace and name. Only devices whose
NicConfig asks for it (`moveInterface: true`) move; the rest stay on the host as before.

The kubelet prepares a pod's claims before it asks the runtime for the sandbox, so the
checkpoint knows the claims when RunPodSandbox comes. A pod sandbox in the host's network
(hostNetwork: true) has no namespace of its own: a claim that wants its NIC moved fails
that pod's sandbox with a message saying so. CreateContainer checks again that the pod's
NICs are in place (moving them if they can be) and refuses the container otherwise.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import structlog
from pyroute2.netlink.exceptions import NetlinkError

from driver._proto.nri.v1alpha1 import api_pb2 as api
from driver.nri.netdev import InterfaceConfig, NetdevError, NetdevMover, Placement, Route
from driver.nri.plugin import netns_path
from driver.nri.status import NetworkConditions
from driver.prepare import opaque
from driver.prepare.claims import ClaimRef
from driver.state.checkpoint import ClaimRecord, State

log = structlog.get_logger("driver.nri.pods")


@dataclass(frozen=True)
class Wanted:
    """One NIC of ours that a pod's claim wants in the pod."""
    ref: ClaimRef
    pool: str
    device: str
    host_ifname: str
    config: InterfaceConfig
    rdma_device: str | None = None


def interface_config(config: opaque.NicConfig) -> InterfaceConfig:
    return InterfaceConfig(name=config.interfaceName, addresses=tuple(config.addresses),
                           mtu=config.mtu,
                           routes=tuple(Route(r.destination, r.gateway) for r in config.routes))


@dataclass
class NicPods:
    """The plugin's PodEvents (driver/nri/plugin.py) for NICs."""
    mover: NetdevMover
    records: Callable[[], Iterable[ClaimRecord]]  # the prepared claims, from the checkpoint
    interface_of: Callable[[str], str | None]  # our device name -> its host interface
    status: NetworkConditions | None = None
    rdma_of: Callable[[str], str | None] = lambda _: None  # our device name -> its RDMA device

    def wanted(self, pod: api.PodSandbox) -> list[Wanted]:
        out = []
        for record in self.records():
            if (record.state != State.PREPARE_COMPLETED or record.namespace != pod.namespace
                    or pod.name not in record.pods):
                continue
            ref = ClaimRef(record.namespace, record.name, record.uid)
            for prepared in record.devices:
                if not prepared.config:
                    continue
                config = opaque.from_dict(prepared.config)
                if not isinstance(config, opaque.NicConfig) or not config.moveInterface:
                    continue
                ifname = self.interface_of(prepared.device)
                if ifname is None:
                    raise NetdevError(f"claim {ref}: device {prepared.device} has no network "
                                      "interface on this node")
                out.append(Wanted(ref, prepared.pool, prepared.device, ifname,
                                  interface_config(config), self.rdma_of(prepared.device)))
        return out

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await asyncio.to_thread(self._attach_all, pod)

    def _attach_all(self, pod: api.PodSandbox) -> None:
        wanted = self.wanted(pod)
        if not wanted:
            return
        name = f"{pod.namespace}/{pod.name}"
        netns = netns_path(pod)
        if netns is None:
            raise NetdevError(f"pod {name}: claim {wanted[0].ref} moves device "
                              f"{wanted[0].device} into the pod's network namespace, but the "
                              "pod has none (hostNetwork: true?)")
        for want in wanted:
            data = self.mover.attach(Placement(
                claim_uid=want.ref.uid, device=want.device, host_ifname=want.host_ifname,
                pod_uid=pod.uid, pod=name, netns=netns, config=want.config,
                rdma_device=want.rdma_device))
            if self.status is not None:
                self.status.moved(want.ref, want.pool, want.device, data, name)

    async def create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        """Refuse a container whose pod's NICs are not in the pod. The sandbox may have
        started while we were away (not registered, or closed by the runtime after a
        timeout) and the Synchronize that followed may have failed for this pod: a
        workload that started without its NIC has already set NCCL/UCX up without it, so
        it must not start at all. The kubelet retries a refused container. The move is
        tried once more first (attach is idempotent: a NIC in place costs one link
        lookup in the pod's namespace)."""
        await asyncio.to_thread(self._ensure_in_place, pod, container.name)

    def _ensure_in_place(self, pod: api.PodSandbox, container: str) -> None:
        try:
            self._attach_all(pod)
        except (NetdevError, NetlinkError, OSError) as err:
            log.error("container_refused_without_nic", pod=f"{pod.namespace}/{pod.name}",
                      pod_uid=pod.uid, container=container, error=str(err))
            raise NetdevError(f"container {container} of pod {pod.namespace}/{pod.name} is "
                              f"not started without its NIC: {err}") from err

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await asyncio.to_thread(self._detach_all, pod.uid)

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        # Stop usually did it; after a driver restart in between, Remove does.
        await asyncio.to_thread(self._detach_all, pod.uid)

    def _detach_all(self, pod_uid: str) -> None:
        for record in self.mover.load_records():
            if record.pod_uid != pod_uid:
                continue
            self.mover.detach(record.pod_uid, record.device)
            self._returned(record.claim_uid, record.device)

    def _returned(self, claim_uid: str, device: str) -> None:
        if self.status is None:
            return
        for claim in self.records():
            if claim.uid == claim_uid:
                ref = ClaimRef(claim.namespace, claim.name, claim.uid)
                for prepared in claim.devices:
                    if prepared.device == device:
                        self.status.returned(ref, prepared.pool, device)

    async def synchronize(self, pods: Sequence[api.PodSandbox]) -> None:
        """After (re)registering: NICs of pods the runtime no longer has come back, and
        running pods get the NICs they should have (a pod started while the driver was
        down, or before NRI was on)."""
        await asyncio.to_thread(self._sync, list(pods))

    def _sync(self, pods: list[api.PodSandbox]) -> None:
        for record in self.mover.reconcile(live_pods={p.uid for p in pods}):
            self._returned(record.claim_uid, record.device)
        for pod in pods:
            try:
                self._attach_all(pod)
            except NetdevError as err:
                # One pod's trouble must not keep the others from their NICs.
                log.error("nic_sync_attach_failed", pod=f"{pod.namespace}/{pod.name}",
                          pod_uid=pod.uid, error=str(err))
