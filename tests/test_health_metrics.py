"""Device health (XID, link down, recovery) as slice taints and on the kubelet health
stream; metrics after a prepare/unprepare cycle; liveness and readiness probes."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

from driver._proto.health.v1 import api_pb2 as hpb2_v1
from driver._proto.health.v1 import api_pb2_grpc as hgrpc_v1
from driver._proto.health.v1alpha1 import api_pb2 as hpb2
from driver._proto.health.v1alpha1 import api_pb2_grpc as hgrpc
from driver.devices.model import DeviceKind, Inventory
from driver.monitoring.health import HealthState, Prober
from driver.sim.apiserver import ApiServer, claim_allocated
from tests.driverproc import DRIVER, DriverDirs
from driver.sim.kubelet import Claim, FakeKubelet
from tests.inprocess import InProcessPlugin

GPU0, GPU1, NIC = "gpu-0000-11-00-0", "gpu-0000-21-00-0", "nic-0000-12-00-0"


class HealthStream:
    """The kubelet side of NodeWatchResources: keeps the latest full device list."""

    def __init__(self, endpoint: str, pb2=hpb2, pb2_grpc=hgrpc) -> None:
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")
        self.latest: dict[str, tuple[int, str]] = {}
        self.messages = 0
        self.cond = threading.Condition()
        stub = pb2_grpc.DRAResourceHealthStub(self.channel)
        self.call = stub.NodeWatchResources(pb2.NodeWatchResourcesRequest())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                with self.cond:
                    self.latest = {d.device.device_name: (d.health, d.message) for d in response.devices}
                    self.messages += 1
                    self.cond.notify_all()
                assert all(d.device.pool_name == "node-a" for d in response.devices)
        except grpc.RpcError:
            pass

    def wait(self, predicate, timeout: float = 10) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.latest), timeout)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def taints(api) -> dict[str, list[dict]]:
    return {d["name"]: d["taints"] for s in api.slices() for d in s["spec"]["devices"] if d.get("taints")}


@pytest.fixture
def running(request):
    profile, *extra = getattr(request, "param", ("mixed",))
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        with InProcessPlugin(api, dirs, profile, *extra) as plugin:
            kubelet = FakeKubelet(dirs.registry)
            kubelet.register()
            assert api.wait_for(lambda: len(api.state.slices) > 0)
            stream = HealthStream(kubelet.info.endpoint)
            assert stream.wait(lambda s: len(s) > 0)
            yield api, plugin, kubelet, stream
            stream.close()
            kubelet.close()
    dirs.cleanup()


@pytest.mark.parametrize("running", [("mixed", "--xid-recovery-seconds", "2")], indirect=True)
def test_xid_taints_one_gpu_and_recovers(running):
    api, plugin, kubelet, stream = running
    assert list(kubelet.info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
    assert stream.latest[GPU0][0] == hpb2.HEALTHY and taints(api) == {}
    v1_stream = HealthStream(kubelet.info.endpoint, hpb2_v1, hgrpc_v1)  # newer kubelets
    nvml = plugin.plugin.node.mock.library
    nvml.inject_xid(0, 79)
    assert api.wait_for(lambda: GPU0 in taints(api))
    (taint,) = taints(api)[GPU0]
    assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/gpu-xid", "79", "NoSchedule")
    assert set(taints(api)) == {GPU0}, "other devices untouched"
    assert stream.wait(lambda s: s[GPU0][0] == hpb2.UNHEALTHY and "XID 79" in s[GPU0][1])
    assert v1_stream.wait(lambda s: s.get(GPU0, (0, ""))[0] == hpb2_v1.UNHEALTHY)
    v1_stream.close()
    assert all(h == hpb2.HEALTHY for name, (h, _) in stream.latest.items() if name != GPU0)
    # Recovery: the GPU answers NVML and the recovery period has passed.
    assert api.wait_for(lambda: taints(api) == {}, timeout=15)
    assert stream.wait(lambda s: s[GPU0][0] == hpb2.HEALTHY, timeout=10)


def test_ignored_xid_changes_nothing(running):
    api, plugin, kubelet, stream = running
    nvml = plugin.plugin.node.mock.library
    before = api.slices()
    api.reset_writes()
    nvml.inject_xid(1, 13)  # graphics engine exception: the application's fault
    nvml.inject_xid(1, 43)
    time.sleep(2.5)  # > two probe periods and the XID wait timeout
    assert api.writes() == [] and api.slices() == before
    assert stream.latest[GPU1][0] == hpb2.HEALTHY


def test_link_down_and_up(running):
    api, plugin, kubelet, stream = running
    operstate = plugin.plugin.node.sysfs / "class" / "net" / "enp18s0f0" / "operstate"
    operstate.write_text("down\n")
    assert api.wait_for(lambda: NIC in taints(api))
    assert taints(api)[NIC][0]["key"] == f"{DRIVER}/link-down"
    assert taints(api)[NIC][0]["value"] == "enp18s0f0"
    assert stream.wait(lambda s: s[NIC][0] == hpb2.UNHEALTHY)
    operstate.write_text("up\n")
    assert api.wait_for(lambda: taints(api) == {})
    assert stream.wait(lambda s: s[NIC][0] == hpb2.HEALTHY)


@pytest.mark.parametrize("running", [("a100-mig",)], indirect=True)
def test_mig_attributed_xid_taints_only_that_mig(running):
    api, plugin, kubelet, stream = running
    plugin.plugin.node.mock.library.inject_xid(0, 94, gpu_instance=3, compute_instance=0)
    assert api.wait_for(lambda: bool(taints(api)))
    time.sleep(0.5)
    assert set(taints(api)) == {"mig-0000-11-00-0-gi3-ci0"}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_move_by_exact_amounts(running):
    api, plugin, kubelet, stream = running
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated("default", "m", uid, [
        {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": GPU0}]))
    before = scrape(plugin.metrics_port)
    key = lambda name, **labels: name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"  # noqa: E731
    assert kubelet.prepare([Claim("default", "m", uid)]).claims[uid].error == ""
    mid = scrape(plugin.metrics_port)
    assert mid["dra_driver_prepared_claims"] == before["dra_driver_prepared_claims"] + 1
    assert kubelet.unprepare([Claim("default", "m", uid)]).claims[uid].error == ""
    bad = str(uuid.uuid4())
    kubelet.prepare([Claim("default", "missing", bad)], version="v1beta1.DRAPlugin")
    after = scrape(plugin.metrics_port)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta(key("dra_driver_requests_total", method="prepare", api="v1")) == 1
    assert delta(key("dra_driver_requests_total", method="unprepare", api="v1")) == 1
    assert delta(key("dra_driver_requests_total", method="prepare", api="v1beta1")) == 1
    assert delta(key("dra_driver_request_duration_seconds_count", method="prepare", api="v1")) == 1
    assert delta(key("dra_driver_request_duration_seconds_count", method="unprepare", api="v1")) == 1
    assert delta(key("dra_driver_claim_errors_total", method="prepare", api="v1beta1")) == 1
    assert delta(key("dra_driver_claim_errors_total", method="prepare", api="v1")) == 0
    assert after["dra_driver_prepared_claims"] == before["dra_driver_prepared_claims"]
    assert after[key("dra_driver_published_devices", kind="gpu")] == 2
    assert after[key("dra_driver_device_health", kind="nic", status="HEALTHY")] == 7
    assert after[key("dra_driver_build_info", version="0.1.0", driver=DRIVER)] == 1
    assert after["dra_driver_publish_writes_total"] >= 3


def probe(port: int, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
    except urllib.error.HTTPError as err:
        return err.code


def test_probes_before_and_after_registration_and_with_a_blocked_loop():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        with InProcessPlugin(api, dirs) as plugin:
            port = plugin.healthz_port
            assert probe(port, "/livez") == 200
            assert probe(port, "/readyz") == 503, "not registered with the kubelet yet"
            kubelet = FakeKubelet(dirs.registry)
            kubelet.register()
            assert api.wait_for(lambda: len(api.state.slices) == 3)
            deadline = time.monotonic() + 5
            while probe(port, "/readyz") != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert probe(port, "/readyz") == 200
            done = plugin.block_loop(7)
            time.sleep(6)
            assert probe(port, "/livez") == 503 and probe(port, "/healthz") == 503
            done.result(10)
            deadline = time.monotonic() + 5
            while probe(port, "/livez") != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert probe(port, "/livez") == 200
            kubelet.close()
    dirs.cleanup()


def test_lost_gpu_is_tainted_and_triggers_rediscovery(running):
    api, plugin, kubelet, stream = running
    runs = plugin.plugin.rediscovery.runs
    plugin.plugin.node.mock.library.gpus[1].lost = True
    assert api.wait_for(lambda: GPU1 in taints(api) or GPU1 not in
                        {d["name"] for s in api.slices() for d in s["spec"]["devices"]}, timeout=10)
    # Rediscovery ran at once (not after the 60 s period) and dropped the lost GPU.
    assert api.wait_for(lambda: GPU1 not in {d["name"] for s in api.slices() for d in s["spec"]["devices"]},
                        timeout=10)
    assert plugin.plugin.rediscovery.runs > runs
    assert stream.wait(lambda s: GPU1 not in s and s[GPU0][0] == hpb2.HEALTHY)


def test_the_probe_reads_each_inventory_at_its_own_paths(mixed):
    """The probe makes its sysfs and /dev paths once per inventory (driver/devices/
    sysread.py); a rediscovered inventory, here with the NIC on another interface, is
    probed where it is now, not where the previous one was."""
    node, result = mixed
    nic = next(d for d in result.inventory.devices if d.kind is DeviceKind.NIC and d.net_interface)
    current = {"inventory": result.inventory}
    state = HealthState(DRIVER, lambda: current["inventory"])
    prober = Prober(state, node.sysfs, node.dev, None)
    prober.probe()
    assert state.conditions(nic.name) == {}
    (node.sysfs / "class" / "net" / nic.net_interface / "operstate").write_text("down\n")
    prober.probe()
    assert state.conditions(nic.name)["link-down"].value == nic.net_interface
    renamed = node.sysfs / "class" / "net" / "renamed0"
    renamed.mkdir()
    (renamed / "operstate").write_text("up\n")
    current["inventory"] = Inventory(tuple(
        dataclasses.replace(d, net_interface="renamed0") if d.name == nic.name else d
        for d in result.inventory.devices if d.kind is DeviceKind.NIC))
    prober.probe()
    assert state.conditions(nic.name) == {}, "read at renamed0, which is up"


def test_a_device_whose_function_or_node_disappears_is_reported_gone_and_back(mixed):
    """The probe answers "still there?" from one listing per directory per probe (the
    PCI functions, /dev/infiniband, ...), not a stat per path: each answer must still be
    the device's own, and current at every probe."""
    node, result = mixed
    rdma = [d for d in result.inventory.devices if d.kind is DeviceKind.NIC and d.device_nodes]
    assert len(rdma) >= 2
    first, second = rdma[0], rdma[1]
    state = HealthState(DRIVER, lambda: result.inventory)
    prober = Prober(state, node.sysfs, node.dev, None)
    prober.probe()
    assert all(state.conditions(d.name) == {} for d in result.inventory.devices)

    function = node.sysfs / "bus" / "pci" / "devices" / first.pci.bus_id
    target = function.readlink() if function.is_symlink() else None
    aside = function.with_name(".aside")
    function.rename(aside)
    prober.probe()
    gone = state.conditions(first.name)["device-removed"]
    assert gone.message == "PCI function disappeared"
    assert state.conditions(second.name) == {}
    aside.rename(function)
    if target is not None:
        assert function.readlink() == target
    prober.probe()
    assert state.conditions(first.name) == {}

    uverbs = [n for n in second.device_nodes if "uverbs" in n]
    assert uverbs and not any(n in first.device_nodes for n in uverbs)
    node_path = node.dev / uverbs[0].removeprefix("/dev/")
    node_path.rename(node_path.with_name(".aside"))
    prober.probe()
    assert state.conditions(second.name)["device-removed"].message == "device node disappeared"
    assert state.conditions(first.name) == {}
    node_path.with_name(".aside").rename(node_path)
    prober.probe()
    assert state.conditions(second.name) == {}

    # A whole directory gone: every device with a node in it.
    infiniband = node.dev / "infiniband"
    infiniband.rename(node.dev / ".infiniband")
    prober.probe()
    assert all("device-removed" in state.conditions(d.name) for d in rdma)
    (node.dev / ".infiniband").rename(infiniband)
    prober.probe()
    assert all(state.conditions(d.name) == {} for d in rdma)

    # Function and node gone at once: the function is named. A gone device's link
    # condition stays as it was; back and up, both go.
    operstate = node.sysfs / "class" / "net" / first.net_interface / "operstate"
    operstate.write_text("down\n")
    prober.probe()
    assert set(state.conditions(first.name)) == {"link-down"}
    function.rename(aside)
    first_node = node.dev / first.device_nodes[0].removeprefix("/dev/")
    first_node.rename(first_node.with_name(".aside-node"))
    operstate.write_text("up\n")
    prober.probe()
    conditions = state.conditions(first.name)
    assert conditions["device-removed"].message == "PCI function disappeared"
    assert set(conditions) == {"device-removed", "link-down"}
    aside.rename(function)
    first_node.with_name(".aside-node").rename(first_node)
    prober.probe()
    assert state.conditions(first.name) == {}
    assert all(state.conditions(d.name) == {} for d in result.inventory.devices)
