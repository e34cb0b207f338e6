"""driver/nri/pods.py: a pod's claims -> its NICs moved on the runtime's events, with real
netdevs in real namespaces and the claim status written to the API server emulator."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from driver.kube.client import Kube, api_client
from driver.nri.mocknet import mock_mac
from driver.nri.netdev import NetdevError, NetdevMover
from driver.nri.plugin import NriOptions, NriPlugin
from driver.nri.pods import NicPods
from driver.nri.status import NetworkConditions
from driver.prepare import opaque
from driver.prepare.claims import ClaimRef
from driver.prepare.claimstatus import DeviceStatus, StatusWriter
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.state.checkpoint import ClaimRecord, PreparedDevice, State
from tests.nri_runtime import FakeRuntime, pod
from tests.test_nri_netdev import _REASON, host, link, pods  # noqa: F401 - fixtures
from tests.test_nri_plugin import sock  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

DRIVER = "accel.dra.io"
NIC = "nic-0000-41-00-2"
IFNAME = "enp65s0f0v0"


def record(config: dict | None, pods_: tuple[str, ...] = ("trainer",), uid: str = "c-1",
           namespace: str = "ml") -> ClaimRecord:
    return ClaimRecord(uid=uid, namespace=namespace, name="nic-claim",
                       state=State.PREPARE_COMPLETED, boot_id="b",
                       devices=(PreparedDevice("vf", "node-a", NIC, ("accel.dra.io/claim=x",),
                                               config or {}),),
                       pods=pods_)


MOVED = opaque.to_dict(opaque.NicConfig(moveInterface=True, interfaceName="net1"))
ADDRESSED = opaque.to_dict(opaque.NicConfig(moveInterface=True, interfaceName="net1",
                                            addresses=("10.1.0.5/24",)))


def test_a_pods_claim_moves_its_nic_and_the_status_says_so(host, pods, tmp_path) -> None:
    host.add_nic(IFNAME, addresses=("192.168.50.2/24",))
    pod_ns = pods()
    claims = [record(ADDRESSED)]
    with ApiServer() as server:
        server.put_claim(claim_allocated("ml", "nic-claim", "c-1", [
            {"request": "vf", "driver": DRIVER, "pool": "node-a", "device": NIC}]))
        writer = StatusWriter(Kube(api_client(server.kubeconfig(tmp_path))), DRIVER)
        conditions = NetworkConditions(writer)
        ref = ClaimRef("ml", "nic-claim", "c-1")
        # What prepare wrote: Ready, and the name the pod will see.
        writer.publish(ref, [DeviceStatus("node-a", NIC, None, True, "Prepared", "",
                                          {"type": "nic"}, {"interfaceName": "net1"})])
        assert writer.wait_idle(20)
        nics = NicPods(NetdevMover(tmp_path / "nri", host_netns=host.path,
                                   recreate=host.recreate),
                       lambda: claims, {NIC: IFNAME}.get, conditions)
        sandbox = pod("u-1", pod_ns, namespace="ml", name="trainer")
        asyncio.run(nics.run_pod_sandbox(sandbox))
        assert link(pod_ns, "net1") is not None and link(host.path, IFNAME) is None
        assert writer.wait_idle(20)
        entry = server.state.claims[("ml", "nic-claim")]["status"]["devices"][0]
        assert entry["networkData"] == {"interfaceName": "net1", "ips": ["10.1.0.5/24"],
                                        "hardwareAddress": mock_mac(IFNAME)}
        assert {c["type"]: c["status"] for c in entry["conditions"]} == {
            "Ready": "True", "NetworkReady": "True"}

        # Another pod of the namespace, and the same pod name elsewhere, get nothing.
        asyncio.run(nics.run_pod_sandbox(pod("u-2", pods(), namespace="ml", name="other")))
        asyncio.run(nics.run_pod_sandbox(pod("u-3", pods(), namespace="dev", name="trainer")))

        asyncio.run(nics.stop_pod_sandbox(sandbox))
        asyncio.run(nics.remove_pod_sandbox(sandbox))  # again: nothing left to do
        assert link(host.path, IFNAME)["addresses"] == ["192.168.50.2/24"]
        assert writer.wait_idle(20)
        entry = server.state.claims[("ml", "nic-claim")]["status"]["devices"][0]
        assert [c["type"] for c in entry["conditions"]] == ["Ready"]
        # Back on the host: the pod's address is no longer the interface's.
        assert entry["networkData"] == {"interfaceName": "net1",
                                        "hardwareAddress": mock_mac(IFNAME)}
        writer.close()


def test_a_nic_without_move_interface_stays_on_the_host(host, pods, tmp_path) -> None:
    host.add_nic(IFNAME)
    claims = [record(opaque.to_dict(opaque.NicConfig(interfaceName="net1"))), record(None)]
    nics = NicPods(NetdevMover(tmp_path, host_netns=host.path), lambda: claims,
                   {NIC: IFNAME}.get)
    asyncio.run(nics.run_pod_sandbox(pod("u-1", pods(), namespace="ml", name="trainer")))
    assert link(host.path, IFNAME) is not None


def test_a_host_network_pod_cannot_take_a_moved_nic(host, tmp_path) -> None:
    host.add_nic(IFNAME)
    nics = NicPods(NetdevMover(tmp_path, host_netns=host.path), lambda: [record(MOVED)],
                   {NIC: IFNAME}.get)
    with pytest.raises(NetdevError, match=r"pod ml/trainer: claim ml/nic-claim moves device "
                                          r"nic-0000-41-00-2 .*hostNetwork: true"):
        asyncio.run(nics.run_pod_sandbox(pod("u-1", "", namespace="ml", name="trainer")))
    assert link(host.path, IFNAME) is not None


def test_sync_returns_nics_of_gone_pods_and_moves_those_of_running_ones(host, pods,
                                                                        tmp_path) -> None:
    """The driver restarted: one pod ended meanwhile, another started while it was down."""
    host.add_nic(IFNAME)
    host.add_nic("enp65s0f0v1")
    gone_ns, running_ns = pods(), pods()
    claims = [record(MOVED, ("gone",), uid="c-gone"),
              record(opaque.to_dict(opaque.NicConfig(moveInterface=True)), ("running",),
                     uid="c-run")]
    interfaces = {NIC: IFNAME}
    mover = NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate)
    nics = NicPods(mover, lambda: claims[:1], interfaces.get)
    asyncio.run(nics.run_pod_sandbox(pod("u-gone", gone_ns, namespace="ml", name="gone")))
    assert link(gone_ns, "net1") is not None

    # c-run's device is another VF on the restarted driver's inventory.
    claims[1] = ClaimRecord(**{**vars(claims[1]), "devices": (PreparedDevice(
        "vf", "node-a", "nic-0000-41-00-3", ("x",), claims[1].devices[0].config),)})
    interfaces["nic-0000-41-00-3"] = "enp65s0f0v1"
    restarted = NicPods(NetdevMover(tmp_path, host_netns=host.path, recreate=host.recreate),
                        lambda: claims, interfaces.get)
    asyncio.run(restarted.synchronize([pod("u-run", running_ns, namespace="ml",
                                           name="running")]))
    assert link(host.path, IFNAME) is not None  # back from the pod that is gone
    assert link(running_ns, "enp65s0f0v1") is not None  # keeps its name: none configured


def test_run_pod_sandbox_through_the_plugin_answers_in_time(host, pods, tmp_path,
                                                            sock) -> None:
    """The whole path from the runtime's request to the answer, as the runtime times it."""
    host.add_nic(IFNAME)
    pod_ns = pods()
    claims = [record(MOVED)]
    nics = NicPods(NetdevMover(tmp_path / "nri", host_netns=host.path), lambda: claims,
                   {NIC: IFNAME}.get)
    from driver._proto.nri.v1alpha1 import api_pb2 as api

    async def main() -> list[float]:
        runtime = FakeRuntime(sock)
        await runtime.start()
        plugin = NriPlugin(NriOptions(socket=sock), nics)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 10)
        times = []
        sandbox = pod("u-1", pod_ns, namespace="ml", name="trainer")
        for _ in range(20):
            answer = await runtime.call("RunPodSandbox", api.RunPodSandboxRequest(pod=sandbox))
            assert (answer.code, answer.message) == (0, "")
            times.append(answer.seconds)
            answer = await runtime.call("StopPodSandbox", api.StopPodSandboxRequest(pod=sandbox))
            assert answer.code == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()
        return times

    times = asyncio.run(main())
    cuts = statistics.quantiles(times, n=100)
    print(f"RunPodSandbox with one NIC moved: p50 {cuts[49] * 1000:.1f} ms, "
          f"p99 {cuts[98] * 1000:.1f} ms")
    assert max(times) < 1.5
    assert link(host.path, IFNAME) is not None


def test_a_container_is_refused_until_its_pods_nic_is_in_the_pod(host, pods, tmp_path,
                                                                 sock) -> None:
    """The sandbox started while the plugin was away (the runtime starts it without an
    unregistered plugin, and without one it closed after a timeout): its containers are
    refused with one line until the NIC is in the pod, then created with it there."""
    pod_ns = pods()
    claims = [record(ADDRESSED)]
    nics = NicPods(NetdevMover(tmp_path / "nri", host_netns=host.path, recreate=host.recreate),
                   lambda: claims, {NIC: IFNAME}.get)
    from driver._proto.nri.v1alpha1 import api_pb2 as api

    sandbox = pod("u-1", pod_ns, namespace="ml", name="trainer")

    def create(name: str) -> api.CreateContainerRequest:
        return api.CreateContainerRequest(pod=sandbox, container=api.Container(
            id=f"c-{name}", name=name, pod_sandbox_id=sandbox.id))

    async def main() -> None:
        runtime = FakeRuntime(sock)
        await runtime.start()
        plugin = NriPlugin(NriOptions(socket=sock), nics)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 10)
        assert runtime.subscribed & (1 << (api.CREATE_CONTAINER - 1))
        # The VF is not on the host (another pod still holds it, or it is gone).
        answer = await runtime.call("CreateContainer", create("main"))
        assert answer.code != 0
        assert answer.message == (
            "CreateContainer: container main of pod ml/trainer is not started without its "
            f"NIC: claim c-1: device {NIC}: interface {IFNAME} is not on the host (is another "
            "pod using it?)")
        assert await asyncio.to_thread(link, pod_ns, "net1") is None

        # Once it can be moved, the kubelet's retry is created with the NIC in the pod.
        await asyncio.to_thread(host.add_nic, IFNAME)
        answer = await runtime.call("CreateContainer", create("main"))
        assert (answer.code, answer.message) == (0, "")
        inside = await asyncio.to_thread(link, pod_ns, "net1")
        assert inside is not None and inside["addresses"] == ["10.1.0.5/24"]
        # The pod's next containers find it in place and move nothing.
        times = []
        for _ in range(20):
            answer = await runtime.call("CreateContainer", create("sidecar"))
            assert (answer.code, answer.message) == (0, "")
            times.append(answer.seconds)
        assert await asyncio.to_thread(link, pod_ns, "net1") == inside
        cuts = statistics.quantiles(times, n=100)
        print(f"CreateContainer with the NIC in place: p50 {cuts[49] * 1000:.1f} ms, "
              f"max {max(times) * 1000:.1f} ms")
        # A pod without NIC claims is never refused.
        other = pod("u-2", await asyncio.to_thread(pods), namespace="ml", name="other")
        answer = await runtime.call("CreateContainer", api.CreateContainerRequest(
            pod=other, container=api.Container(id="c-x", name="x", pod_sandbox_id=other.id)))
        assert (answer.code, answer.message) == (0, "")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())
    asyncio.run(nics.stop_pod_sandbox(sandbox))
    assert link(host.path, IFNAME) is not None
