"""The publisher against the API emulator: exact writes, generations, self-healing,
faults, version negotiation, scale, and hotplug-driven republishing."""

from __future__ import annotations

import asyncio
import threading
import time

import kubernetes_validate
import pytest

from driver.devices import mock
from driver.devices.discovery import discover
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
    holder.inventory = discover(node.sources()).inventory
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
    sources = node.sources()
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
    sources = node.sources()
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


@pytest.mark.parametrize("profile", sorted(mock.builtin_profiles()))
def test_zero_writes_when_nothing_changed_on_every_profile(api, built, tmp_path, profile):
    """The emulator stores quantities canonically, as the real API server does (`81559Mi`
    stays, `40960Mi` becomes `40Gi`); comparing strings would rewrite such slices on every
    pass."""
    _, result = built(profile)
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    api.reset_writes()
    assert publisher.reconcile() == 0 and api.writes() == []
    # A fresh process (the new pod of an upgrade) agrees with what is stored, too.
    assert make_publisher(api, tmp_path, Holder(result.inventory)).reconcile() == 0
    assert api.writes() == []


def test_the_server_rewrites_some_quantities_we_publish(api, built, tmp_path):
    """Keeps the test above honest: at least one profile publishes a spelling the server
    changes, so a string comparison would fail it."""
    from driver.quantity import canonical

    rewritten = [(p, d.name, q) for p in sorted(mock.builtin_profiles())
                 for d in built(p)[1].inventory.devices for q in d.capacity.values() if canonical(q) != q]
    assert rewritten, "no profile exercises canonicalization"


def test_updates_keep_what_others_added(api, tmp_path):
    node, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    name = f"{NODE}-{DRIVER}-nic-0"
    foreign_owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keep", "uid": "u-1"}

    def decorate(obj):
        meta = obj["metadata"]
        meta["labels"] = {"team": "infra"}
        meta["annotations"] = {"example.com/audit": "yes"}
        meta["finalizers"] = ["example.com/hold"]
        meta["ownerReferences"] = meta.get("ownerReferences", []) + [foreign_owner]

    api.edit_slice(name, decorate)
    assert publisher.reconcile() == 0, "metadata others add is not a difference"
    (node.sysfs / "class" / "net" / "enp18s0f0" / "mtu").write_text("4200\n")
    holder.inventory = discover(node.sources()).inventory
    api.reset_writes()
    assert publisher.reconcile() == 1 and api.writes() == [("update", name)]
    meta = next(s for s in api.slices() if s["metadata"]["name"] == name)["metadata"]
    assert meta["labels"] == {"team": "infra"} and meta["annotations"] == {"example.com/audit": "yes"}
    assert meta["finalizers"] == ["example.com/hold"]
    assert foreign_owner in meta["ownerReferences"]
    assert [r["kind"] for r in meta["ownerReferences"]].count("Node") == 1
    assert devices_in_api(api)["nic-0000-12-00-0"]["attributes"]["mtu"] == {"int": 4200}
    assert publisher.reconcile() == 0


def test_deletes_spare_a_slice_re_created_meanwhile(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    name = f"{NODE}-{DRIVER}-fpga-0"
    listed = next(s for s in publisher.list_existing() if s["metadata"]["name"] == name)
    # Between our list and our delete, someone deletes and re-creates the slice.
    api.delete_slice(name)
    recreated = dict(listed, metadata={"name": name})
    kube = publisher.kube
    kube.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body=recreated)
    api.reset_writes()
    assert publisher._delete(listed) == 0
    assert name in {s["metadata"]["name"] for s in api.slices()}, "the new slice stays"
    # The emulator answers stale preconditions as the real server does.
    current = next(s for s in api.slices() if s["metadata"]["name"] == name)
    stale = {"apiVersion": "v1", "kind": "DeleteOptions",
             "preconditions": {"uid": current["metadata"]["uid"], "resourceVersion": "1"}}
    with pytest.raises(Exception, match="409.*Precondition failed: ResourceVersion"):
        kube.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}", body=stale)
    assert publisher._delete(current) == 1 and api.writes() == [("delete", name)]


def test_an_older_instance_stands_by_while_a_newer_one_publishes(api, tmp_path):
    """Two versions side by side with different inventories: the newer writes once, the
    older writes nothing (no ping-pong), and takes over when the newer one is gone."""
    from driver.devices.model import Inventory
    from driver.instance import Instance

    _, result = discover_profile("mixed", tmp_path / "m")
    old_inventory = result.inventory
    new_inventory = Inventory(tuple(
        d if d.name != "gpu-0000-11-00-0" else type(d)(**{**d.__dict__, "attributes": {**d.attributes, "newAttribute": True}})
        for d in old_inventory.devices))
    old_instance = Instance.register(tmp_path / "state", "old-pod")
    old = make_publisher(api, tmp_path, Holder(old_inventory))
    old.newer_instance = old_instance.newer_peer
    assert old.reconcile() == 3
    new_instance = Instance.register(tmp_path / "state", "new-pod")
    new = make_publisher(api, tmp_path, Holder(new_inventory))
    new.newer_instance = new_instance.newer_peer
    api.reset_writes()
    for _ in range(3):
        new.reconcile()
        assert old.reconcile() == 0
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-gpu-0")]
    assert devices_in_api(api)["gpu-0000-11-00-0"]["attributes"]["newAttribute"] == {"bool": True}
    assert old.stats.deferred == 3 and old.stats.published
    new_instance.release()  # the newer pod stops (e.g. a rollback)
    assert old.reconcile() == 1
    assert "newAttribute" not in devices_in_api(api)["gpu-0000-11-00-0"]["attributes"]
    old_instance.release()
