"""The publisher against the API emulator: exact writes, generations, self-healing,
faults, version negotiation, scale, and hotplug-driven republishing."""

from __future__ import annotations

import asyncio
import threading
import time

import kubernetes_validate
import pytest

from driver.devices import mock
from driver.devices.discovery import Sources, discover
from driver.hotplug import Rediscovery
from driver.kube import Kube, api_client
from driver.publisher import Publisher
from driver.sim.apiserver import ApiServer, Fault
from driver.sim.k8s_limits import slice_errors
from tests.conftest import discover_profile

DRIVER = "accel.dra.io"
NODE = "node-a"


class Holder:
    def __init__(self, inventory):
        self.inventory = inventory


@pytest.fixture
def api(tmp_path):
    with ApiServer() as server:
        server.add_node(NODE)
        yield server


def make_publisher(api, tmp_path, holder, timeout=10.0) -> Publisher:
    kube = Kube(api_client(api.kubeconfig(tmp_path)), timeout=timeout)
    return Publisher(kube, DRIVER, NODE, inventory=lambda: holder.inventory)


class Running:
    """Runs coroutines (publisher.run, rediscovery.run) on a loop in a background thread."""

    def __init__(self, *coroutine_factories):
        self.factories = coroutine_factories
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        asyncio.set_event_loop(self.loop)
        self.tasks = [self.loop.create_task(f()) for f in self.factories]
        try:
            self.loop.run_until_complete(asyncio.gather(*self.tasks, return_exceptions=True))
        finally:
            self.loop.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        for task in self.tasks:
            self.loop.call_soon_threadsafe(task.cancel)
        self.thread.join(10)


def devices_in_api(api) -> dict[str, dict]:
    return {d["name"]: d for s in api.slices() for d in s["spec"]["devices"]}


def test_first_publish_then_zero_writes(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    assert publisher.reconcile() == 3
    assert api.writes() == [("create", f"{NODE}-{DRIVER}-{k}-0") for k in ("gpu", "fpga", "nic")]
    stored = api.slices()
    node_uid = api.state.nodes[NODE]["metadata"]["uid"]
    for obj in stored:
        assert slice_errors(obj) == []
        assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 3}
        assert obj["metadata"]["ownerReferences"][0] == {
            "apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
        clean = {k: v for k, v in obj.items() if k != "metadata"} | {"metadata": {"name": obj["metadata"]["name"]}}
        kubernetes_validate.validate(clean, "1.34.0", strict=True)
    assert set(devices_in_api(api)) == {d.name for d in result.inventory.devices}

    api.reset_writes()
    assert publisher.reconcile() == 0 and api.writes() == []


def test_attribute_change_rewrites_one_slice_same_generation(api, tmp_path):
    node, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    api.reset_writes()
    (node.sysfs / "class" / "net" / "enp18s0f0" / "mtu").write_text("4200\n")
    holder.inventory = discover(Sources(node.sysfs, node.proc, node.nvml)).inventory
    assert publisher.reconcile() == 1
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-nic-0")]
    assert devices_in_api(api)["nic-0000-12-00-0"]["attributes"]["mtu"] == {"int": 4200}
    assert {s["spec"]["pool"]["generation"] for s in api.slices()} == {1}


def test_device_set_change_bumps_generation_then_deletes(api, tmp_path):
    node, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    api.reset_writes()
    from driver.devices.model import DeviceKind, Inventory

    holder.inventory = Inventory(tuple(d for d in result.inventory.devices if d.kind is not DeviceKind.FPGA))
    assert publisher.reconcile() == 3
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-gpu-0"), ("update", f"{NODE}-{DRIVER}-nic-0"),
                            ("delete", f"{NODE}-{DRIVER}-fpga-0")]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in api.slices()} == {(2, 2)}


def test_external_delete_and_edit_are_repaired_minimally(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    before = {s["metadata"]["name"]: s["spec"] for s in api.slices()}
    api.reset_writes()
    api.delete_slice(f"{NODE}-{DRIVER}-gpu-0")
    api.edit_slice(f"{NODE}-{DRIVER}-nic-0", lambda s: s["spec"]["devices"].pop())
    assert publisher.reconcile() == 2
    assert sorted(api.writes()) == [("create", f"{NODE}-{DRIVER}-gpu-0"), ("update", f"{NODE}-{DRIVER}-nic-0")]
    assert {s["metadata"]["name"]: s["spec"] for s in api.slices()} == before


def test_kubelet_wipe_is_restored_promptly_by_the_watch(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.resync_seconds = 3600  # only the watch can bring it back in time
    with Running(publisher.run):
        assert api.wait_for(lambda: len(api.state.slices) == 3)
        time.sleep(0.3)
        for name in list(api.state.slices):
            api.delete_slice(name)  # what the kubelet does at its start
        started = time.monotonic()
        assert api.wait_for(lambda: len(api.state.slices) == 3, timeout=10)
        elapsed = time.monotonic() - started
    assert set(devices_in_api(api)) == {d.name for d in result.inventory.devices}
    print(f"slices restored {elapsed * 1000:.0f} ms after the wipe")


@pytest.mark.parametrize("fault", [
    Fault("POST", "resourceslices", status=409, times=2),
    Fault("POST", "resourceslices", status=429, times=3),
    Fault("*", "resourceslices", status=500, times=4),
    Fault("POST", "resourceslices", status=0, delay=1.5, times=1),  # client timeout
], ids=["409", "429", "500", "timeout"])
def test_faults_converge(api, tmp_path, fault):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory), timeout=1.0)
    api.inject(fault)
    with Running(publisher.run):
        assert api.wait_for(
            lambda: set(devices_in_api(api)) == {d.name for d in result.inventory.devices}, timeout=20)
    assert publisher.stats.failures >= 1
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(api.slices()) for s in api.slices())


@pytest.mark.parametrize("versions", [["v1beta1"], ["v1beta2", "v1beta1"]])
def test_older_api_servers(tmp_path, versions):
    with ApiServer(versions=versions) as api:
        api.add_node(NODE)
        _, result = discover_profile("mixed", tmp_path / "m")
        publisher = make_publisher(api, tmp_path, Holder(result.inventory))
        assert publisher.reconcile() == 3
        assert publisher.api_version == versions[0]
        assert publisher.reconcile() == 0, "round trip through the old shape is stable"
        kube = publisher.kube
        listing = kube.request("GET", f"/apis/resource.k8s.io/{versions[0]}/resourceslices")
        for obj in listing["items"]:
            assert obj["apiVersion"] == f"resource.k8s.io/{versions[0]}"
            assert slice_errors(obj) == []
            obj["metadata"] = {"name": obj["metadata"]["name"]}
            kubernetes_validate.validate(obj, "1.33.0", strict=True)
            if versions[0] == "v1beta1":
                assert all(set(d) == {"name", "basic"} for d in obj["spec"]["devices"])


def test_scale_2048_devices(api, built, tmp_path):
    _, result = built("sriov-large")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    assert publisher.reconcile() == 16
    stored = api.slices()
    assert len(stored) >= 16 and sum(len(s["spec"]["devices"]) for s in stored) == 2048
    api.reset_writes()
    assert publisher.reconcile() == 0


def test_cleanup_command_deletes_only_this_nodes_slices(api, tmp_path):
    from driver import cli

    _, result = discover_profile("mixed", tmp_path / "m")
    make_publisher(api, tmp_path, Holder(result.inventory)).reconcile()
    other = Publisher(make_publisher(api, tmp_path, Holder(result.inventory)).kube, DRIVER, "node-b",
                      inventory=lambda: result.inventory)
    other.reconcile()
    assert cli.main(["cleanup", "--node-name", NODE, "--kubeconfig", str(api.kubeconfig(tmp_path))]) == 0
    assert {s["spec"]["nodeName"] for s in api.slices()} == {"node-b"}


NIC_PROFILE = """
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    devices:
      - {type: nic, model: connectx-6dx, vfs: %d, rdma: true}
  - numa: 1
    devices:
      - {type: nic, model: e810}
"""


def test_hotplug_64_vfs_is_one_republish_and_removal_removes(api, tmp_path):
    root = tmp_path / "m"
    node = mock.build(mock.parse(NIC_PROFILE % 0, "nic.yaml"), root)
    sources = Sources(node.sysfs, node.proc, node.nvml)
    first = discover(sources)
    holder = Holder(first.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.resync_seconds = 3600

    def changed(result):
        holder.inventory = result.inventory
        publisher.trigger()

    rediscovery = Rediscovery(lambda: discover(sources), changed, first, interval=3600, quiet=0.3)
    with Running(publisher.run, rediscovery.run):
        assert api.wait_for(lambda: len(devices_in_api(api)) == 2)
        time.sleep(0.3)
        api.reset_writes()
        mock.build(mock.parse(NIC_PROFILE % 64, "nic.yaml"), root)  # the VFs appear in sysfs...
        for i in range(64):  # ...and the kernel sends a burst of uevents
            rediscovery.notify("pci", "add")
            rediscovery.notify("net", "add")
        assert api.wait_for(lambda: len(devices_in_api(api)) == 66, timeout=10)
        time.sleep(1.0)
        assert rediscovery.runs == 1 and rediscovery.events == 128
        assert api.writes() == [("update", f"{NODE}-{DRIVER}-nic-0")], "one republish"
        assert api.slices()[0]["spec"]["pool"]["generation"] == 2

        profile = mock.parse(NIC_PROFILE.split("  - numa: 1")[0] % 64, "nic.yaml")
        mock.build(profile, root)  # the E810 is gone
        rediscovery.notify("pci", "remove")
        assert api.wait_for(lambda: "nic-0000-21-00-0" not in devices_in_api(api), timeout=10)
        assert len(devices_in_api(api)) == 65


def test_periodic_rediscovery_catches_missed_events(api, tmp_path):
    root = tmp_path / "m"
    node = mock.build(mock.parse(NIC_PROFILE % 0, "nic.yaml"), root)
    sources = Sources(node.sysfs, node.proc, node.nvml)
    first = discover(sources)
    seen = []
    rediscovery = Rediscovery(lambda: discover(sources), seen.append, first, interval=0.5)
    with Running(rediscovery.run):
        mock.build(mock.parse(NIC_PROFILE % 3, "nic.yaml"), root)  # no uevent at all
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    assert seen and len(seen[0].inventory.devices) == 5


def test_fields_the_server_adds_are_not_a_difference(api, tmp_path):
    """A newer API server may default fields we do not set; that must not cause writes."""
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    api.reset_writes()

    def default_fields(obj):
        obj["spec"]["perDeviceNodeSelection"] = None
        for device in obj["spec"]["devices"]:
            device["allowMultipleAllocations"] = False

    for name in list(api.state.slices):
        api.edit_slice(name, default_fields)
    assert publisher.reconcile() == 0 and api.writes() == []


def test_a_malformed_foreign_slice_does_not_stop_publishing(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    api.edit_slice(f"{NODE}-{DRIVER}-gpu-0", lambda s: s["spec"].pop("pool"))
    with Running(publisher.run):
        assert api.wait_for(lambda: all(s["spec"].get("pool", {}).get("generation") == 2
                                        for s in api.slices()), timeout=15)
    assert publisher.stats.failures == 0, "repaired, not crashed on"
