"""The publisher against the API emulator: exact writes, generations, self-healing,
faults, version negotiation, scale, and hotplug-driven republishing."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import kubernetes_validate
import pytest

from driver.devices import mock
from driver.devices.discovery import discover
from driver.devices.model import DeviceKind, Inventory
from driver.publish.hotplug import Rediscovery
from driver.kube.client import ApiError, Kube, api_client
from driver.publish.publisher import Publisher
from driver.sim.apiserver import ApiServer, Fault
from driver.scheduling.k8s_limits import slice_errors
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
    assert api.writes() == [("create", f"{NODE}-{DRIVER}-{k}-0") for k in ("0-gpu", "4-fpga", "3-nic")]
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
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-3-nic-0")]
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
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-0-gpu-0"), ("update", f"{NODE}-{DRIVER}-3-nic-0"),
                            ("delete", f"{NODE}-{DRIVER}-4-fpga-0")]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in api.slices()} == {(2, 2)}


def test_external_delete_and_edit_are_repaired_minimally(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    before = {s["metadata"]["name"]: s["spec"] for s in api.slices()}
    api.reset_writes()
    api.delete_slice(f"{NODE}-{DRIVER}-0-gpu-0")
    api.edit_slice(f"{NODE}-{DRIVER}-3-nic-0", lambda s: s["spec"]["devices"].pop())
    assert publisher.reconcile() == 2
    assert sorted(api.writes()) == [("create", f"{NODE}-{DRIVER}-0-gpu-0"), ("update", f"{NODE}-{DRIVER}-3-nic-0")]
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
    if fault.status == 429:  # never executed: sent again within the pass, which does not fail
        assert (publisher.stats.throttled, publisher.stats.failures) == (3, 0)
    else:
        assert publisher.stats.failures >= 1
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(api.slices()) for s in api.slices())


def test_a_throttled_write_waits_out_retry_after_and_is_sent_once_more(api, tmp_path):
    """API Priority and Fairness turns a request away with 429 and Retry-After: 1 before
    executing it. The pass sends that request again after at least the server's wait, and
    neither fails nor starts over (no second LIST, no slice sent twice)."""
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    api.inject(Fault("POST", "resourceslices", status=429, times=2, retry_after="1"))
    t0 = time.monotonic()
    assert publisher.reconcile() == 3
    elapsed = time.monotonic() - t0
    assert publisher.stats.throttled == 2 and publisher.stats.lists == 1
    assert 1.0 <= publisher.stats.throttle_wait_max and elapsed >= publisher.stats.throttle_wait >= 2.0
    assert sorted(api.state.writes) == sorted(("create", s["metadata"]["name"]) for s in api.slices())
    assert len(api.slices()) == 3


def test_a_request_throttled_past_the_retries_fails_the_pass(api, tmp_path, monkeypatch):
    from driver.publish import publisher as module

    monkeypatch.setattr(module, "THROTTLE_RETRIES", 2)
    monkeypatch.setattr(module, "BACKOFF_BASE", 0.01)
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    api.inject(Fault("POST", "resourceslices", status=429, times=3))
    with pytest.raises(ApiError) as err:
        publisher.reconcile()
    assert err.value.status == 429 and publisher.stats.throttled == 2


def test_throttled_nodes_do_not_come_back_in_step():
    """A fleet turned away at one moment: the waits are never shorter than Retry-After and
    spread over a second and more, then grow per attempt."""
    publishers = [Publisher(None, DRIVER, f"n{i}", inventory=lambda: None) for i in range(200)]
    first = [p.throttle_delay(1.0, 1) for p in publishers]
    assert min(first) >= 1.0 and max(first) <= 2.0 and max(first) - min(first) > 0.8
    assert len({round(d, 2) for d in first}) > 50  # not a handful of slots either
    fifth = [p.throttle_delay(1.0, 5) for p in publishers]
    assert min(fifth) >= 8.0  # 0.5 s doubled four times


def test_the_pass_after_a_throttled_one_waits_for_retry_after(api, tmp_path):
    """A 429 outside the slice requests (the API group's discovery) fails the pass; the
    run loop's next try honours the server's Retry-After over its own shorter backoff."""
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    api.inject(Fault("GET", "^/apis/resource.k8s.io$", status=429, times=1, retry_after="2"))
    t0 = time.monotonic()
    with Running(publisher.run):
        assert api.wait_for(lambda: len(api.slices()) == 3, timeout=20)
    assert time.monotonic() - t0 >= 2.0 and publisher.stats.failures == 1


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
        assert api.writes() == [("update", f"{NODE}-{DRIVER}-3-nic-0")], "one republish"
        # The VFs joined their PF's slice, the only one that changed: one atomic update, so
        # the generation stays (see the next tests).
        assert api.slices()[0]["spec"]["pool"]["generation"] == 1

        profile = mock.parse(NIC_PROFILE.split("  - numa: 1")[0] % 64, "nic.yaml")
        mock.build(profile, root)  # the E810 is gone
        rediscovery.notify("pci", "remove")
        assert api.wait_for(lambda: "nic-0000-21-00-0" not in devices_in_api(api), timeout=10)
        assert len(devices_in_api(api)) == 65


TWO_PFS = """
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    devices:
      - {type: nic, model: connectx-6dx, vfs: %d}
      - {type: nic, model: connectx-6dx, vfs: %d}
  - numa: 1
    devices:
      - {type: nic, model: e810, vfs: 2}
"""


def test_vfs_added_or_removed_rewrite_their_pfs_slice_alone(api, tmp_path):
    """A PF and its VFs share a slice; VFs added to or removed from it are one update at
    the same generation, even from a fresh process. A change that moves devices between
    slices or changes the slice count takes a new generation, as before."""
    root = tmp_path / "m"

    def rediscover(a: int, b: int) -> Inventory:
        node = mock.build(mock.parse(TWO_PFS % (a, b), "nic.yaml"), root)
        return discover(node.sources()).inventory

    holder = Holder(rediscover(70, 70))
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    first, second = f"{NODE}-{DRIVER}-3-nic-0", f"{NODE}-{DRIVER}-3-nic-1"

    def published() -> list[tuple[str, int, int]]:
        for obj in api.slices():
            assert slice_errors(obj) == []
        names = [d["name"] for s in api.slices() for d in s["spec"]["devices"]]
        assert sorted(names) == sorted(d.name for d in holder.inventory.devices), "each device once"
        return sorted((s["metadata"]["name"], len(s["spec"]["devices"]), s["spec"]["pool"]["generation"])
                      for s in api.slices())

    assert published() == [(first, 71, 1), (second, 74, 1)]

    for counts, writes, expected in (
            ((71, 70), [("update", first)], [(first, 72, 1), (second, 74, 1)]),  # one VF more
            ((71, 60), [("update", second)], [(first, 72, 1), (second, 64, 1)]),  # ten fewer
    ):
        api.reset_writes()
        holder.inventory = rediscover(*counts)
        assert publisher.reconcile() == len(writes) and api.writes() == writes
        assert published() == expected

    # A fresh process (an upgrade, a restart) trusts what the server has: still one update.
    api.reset_writes()
    holder.inventory = rediscover(80, 60)
    assert make_publisher(api, tmp_path, holder).reconcile() == 1
    assert api.writes() == [("update", first)] and published() == [(first, 81, 1), (second, 64, 1)]

    # The second PF no longer fits beside the E810: a third slice, so a new generation.
    api.reset_writes()
    holder.inventory = rediscover(80, 125)
    assert publisher.reconcile() == 3
    assert api.writes() == [("update", first), ("update", second), ("create", f"{NODE}-{DRIVER}-3-nic-2")]
    assert published() == [(first, 81, 2), (second, 126, 2), (f"{NODE}-{DRIVER}-3-nic-2", 3, 2)]

    # Both PFs fit one slice again: devices move and a slice goes, so a new generation.
    api.reset_writes()
    holder.inventory = rediscover(40, 20)
    publisher.reconcile()
    assert published() == [(first, 41 + 21 + 3, 3)]


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
    api.edit_slice(f"{NODE}-{DRIVER}-0-gpu-0", lambda s: s["spec"].pop("pool"))
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
    from driver.kube.quantity import canonical

    rewritten = [(p, d.name, q) for p in sorted(mock.builtin_profiles())
                 for d in built(p)[1].inventory.devices for q in d.capacity.values() if canonical(q) != q]
    assert rewritten, "no profile exercises canonicalization"


def test_updates_keep_what_others_added(api, tmp_path):
    node, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    name = f"{NODE}-{DRIVER}-3-nic-0"
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
    name = f"{NODE}-{DRIVER}-4-fpga-0"
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
    from driver.state.instance import Instance

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
    assert api.writes() == [("update", f"{NODE}-{DRIVER}-0-gpu-0")]
    assert devices_in_api(api)["gpu-0000-11-00-0"]["attributes"]["newAttribute"] == {"bool": True}
    assert old.stats.deferred == 3 and old.stats.published
    new_instance.release()  # the newer pod stops (e.g. a rollback)
    assert old.reconcile() == 1
    assert "newAttribute" not in devices_in_api(api)["gpu-0000-11-00-0"]["attributes"]
    old_instance.release()


# -- the watch-fed copy of our slices (driver/publish/slicecache.py) ------------------------------------

def watch_events(api, tmp_path, **query) -> list[dict]:
    kube = Kube(api_client(api.kubeconfig(tmp_path)))
    params = {"fieldSelector": f"spec.nodeName={NODE}", "watch": "1", "timeoutSeconds": "1", **query}
    return list(kube.stream("/apis/resource.k8s.io/v1/resourceslices", params, timeout=5))


def test_the_emulator_watch_starts_resumes_and_expires_as_the_server_does(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.reconcile()
    names = sorted(api.state.slices)
    # No resourceVersion: the current state as ADDED events first.
    events = watch_events(api, tmp_path, allowWatchBookmarks="true")
    assert [e["type"] for e in events] == ["ADDED"] * 3 + ["BOOKMARK"]
    assert sorted(e["object"]["metadata"]["name"] for e in events[:3]) == names
    bookmark = events[-1]["object"]["metadata"]["resourceVersion"]
    assert bookmark == str(api.state.resource_version)
    # From a version: only what happened after it; a deletion at its own version.
    api.delete_slice(names[0])
    events = watch_events(api, tmp_path, resourceVersion=bookmark)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("DELETED", names[0])]
    assert int(events[0]["object"]["metadata"]["resourceVersion"]) > int(bookmark)
    # Compacted away: one ERROR event with a 410 Status, then the server ends the watch.
    api.compact()
    events = watch_events(api, tmp_path, resourceVersion=bookmark)
    assert [e["type"] for e in events] == ["ERROR"]
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"


def test_no_change_reconciles_list_nothing_while_the_watch_runs(api, built, tmp_path):
    _, result = built("sriov-large")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.resync_seconds = 3600
    with Running(publisher.run):
        assert api.wait_for(lambda: len(api.state.slices) == 16, timeout=30)
        assert wait_until(lambda: publisher.cache.synced)
        time.sleep(0.3)
        lists, requests = publisher.stats.lists, api.state.requests
        api.reset_writes()
        for _ in range(5):
            assert publisher.reconcile() == 0
        assert publisher.stats.lists == lists, "the watch's copy, not a LIST"
        assert api.state.requests == requests, "not one request to the API server"
        # The copy is not blind: an outside edit arrives through the watch and is repaired.
        api.edit_slice(f"{NODE}-{DRIVER}-3-nic-3", lambda s: s["spec"]["devices"][0].pop("attributes"))
        assert api.wait_for(lambda: ("update", f"{NODE}-{DRIVER}-3-nic-3") in api.writes(), timeout=10)
        time.sleep(0.5)
        assert api.writes() == [("update", f"{NODE}-{DRIVER}-3-nic-3")]
        assert publisher.stats.lists == lists and publisher.stats.failures == 0


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_resumed_watch_misses_nothing_and_an_expired_one_lists_again(api, tmp_path):
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.resync_seconds = 3600  # only the watch can repair in time
    publisher.watch_seconds = 1  # the server ends each watch after 1 s: we resume
    api.add_node("node-b")
    other = Publisher(publisher.kube, DRIVER, "node-b", inventory=lambda: result.inventory)
    with Running(publisher.run):
        assert api.wait_for(lambda: len(api.state.slices) == 3)
        time.sleep(2.5)  # two resumed watches
        assert publisher.cache.lists == 1
        api.delete_slice(f"{NODE}-{DRIVER}-0-gpu-0")
        assert api.wait_for(lambda: f"{NODE}-{DRIVER}-0-gpu-0" in api.state.slices, timeout=5)
        assert publisher.cache.lists == 1, "resumed from its version, no LIST"
        # A quiet watch on a busy cluster: without bookmarks its version falls behind
        # what the server keeps, and the resume gets 410 Expired.
        api.state.bookmarks = False
        time.sleep(1.5)
        other.reconcile()  # events our field selector does not pass
        api.compact()
        assert wait_until(lambda: publisher.cache.lists == 2, timeout=5), "listed again after 410"
        api.edit_slice(f"{NODE}-{DRIVER}-3-nic-0", lambda s: s["spec"]["devices"].pop())
        assert api.wait_for(lambda: len(devices_in_api_of(api, NODE)) == len(result.inventory.devices),
                            timeout=5)
    assert publisher.stats.failures == 0


def devices_in_api_of(api, node) -> set[str]:
    return {d["name"] for s in api.slices() if s["spec"]["nodeName"] == node for d in s["spec"]["devices"]}


def test_a_stale_copy_costs_one_conflict_then_a_list(api, tmp_path):
    """Were the copy ever behind the server (a watch event still in flight), the update it
    leads to fails its resourceVersion check, and the next pass LISTs and converges."""
    _, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.reconcile()
    items, version = publisher._list()
    publisher.cache.replace(items, version)  # as the watch would
    name = f"{NODE}-{DRIVER}-3-nic-0"
    api.edit_slice(name, lambda s: s["spec"]["devices"].pop())  # its event never arrives
    # Our next change is to that slice: the update carries the copy's resourceVersion.
    nic = next(d for d in result.inventory.devices if d.kind is DeviceKind.NIC)
    changed = dataclasses.replace(nic, attributes={**nic.attributes, "model": "changed"})
    holder.inventory = Inventory(tuple(changed if d is nic else d for d in result.inventory.devices),
                                 result.inventory.counter_sets)
    with pytest.raises(ApiError, match="409"):
        publisher.reconcile()
    lists = publisher.stats.lists
    assert publisher.reconcile() >= 1 and publisher.stats.lists == lists + 1
    assert publisher.reconcile() == 0
    assert make_publisher(api, tmp_path, holder).reconcile() == 0, "the server has what we want"


def test_random_outside_changes_and_inventories_converge(api, tmp_path):
    """Deletes, edits and inventory changes at random while the watch runs: the server
    ends where a fresh process would leave it, and the copy equals the server."""
    _, result = discover_profile("mixed", tmp_path / "m")
    holder = Holder(result.inventory)
    publisher = make_publisher(api, tmp_path, holder)
    publisher.watch_seconds = 1
    rng = random.Random(1234)
    devices = list(result.inventory.devices)
    with Running(publisher.run):
        assert api.wait_for(lambda: len(api.state.slices) == 3)
        for _ in range(40):
            names = sorted(api.state.slices)
            action = rng.choice(["delete", "edit", "inventory", "sleep"])
            try:
                if action == "delete" and names:
                    api.delete_slice(rng.choice(names))
                elif action == "edit" and names:
                    api.edit_slice(rng.choice(names), lambda s: s["spec"].get("devices", [None]).pop()
                                   if s["spec"].get("devices") else None)
            except KeyError:
                pass  # the publisher deleted it meanwhile
            if action == "inventory":
                holder.inventory = Inventory(tuple(rng.sample(devices, rng.randint(1, len(devices)))),
                                             result.inventory.counter_sets)
                publisher.trigger()
            time.sleep(rng.uniform(0, 0.15))
        final = holder.inventory
        assert wait_until(lambda: devices_in_api_of(api, NODE) == {d.name for d in final.devices}, 15)
        time.sleep(1.0)
        with api.state.lock:
            server = {n: s["metadata"]["resourceVersion"] for n, s in api.state.slices.items()}
        assert wait_until(lambda: {n: s["metadata"]["resourceVersion"]
                                   for n, s in (publisher.cache.snapshot() or {}).items()} == server, 5)
    api.reset_writes()
    assert make_publisher(api, tmp_path, Holder(final)).reconcile() == 0 and api.writes() == []


# -- unhealthy devices: nothing before the first health pass, timeAdded kept (issue 28.13) ------

def _health(built, profile):
    from driver.monitoring.health import HealthState, Prober

    node, result = built(profile)
    state = HealthState(DRIVER, lambda: result.inventory)
    return node, result, state, Prober(state, node.sysfs, node.dev, None)


def _taints_in_api(api) -> dict[str, list]:
    return {d["name"]: d["taints"] for s in api.slices() for d in s["spec"]["devices"] if d.get("taints")}


def test_nothing_is_published_before_the_first_health_pass(api, built, tmp_path):
    node, result, state, prober = _health(built, "sriov")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.taints, publisher.health_ready = state.taints, state.probed.is_set
    heard = []
    state.subscribe(lambda: heard.append(state.probed.is_set()))
    assert publisher.reconcile() == 0 and api.writes() == [] and not publisher.stats.published
    prober.probe()
    assert heard[-1] is True, "the end of the first pass is heard, even where nothing changed"
    writes = publisher.reconcile()
    assert writes == len(api.slices()) == 2 and all(v == "create" for v, _ in api.writes())
    assert len(_taints_in_api(api)) == 17, "the E810's PF and its 16 VFs: link down"
    assert publisher.stats.published


def test_a_healthy_node_is_published_after_its_first_pass_too(api, built, tmp_path):
    _, result, state, prober = _health(built, "mixed")
    publisher = make_publisher(api, tmp_path, Holder(result.inventory))
    publisher.health_ready = state.probed.is_set
    heard = []
    state.subscribe(lambda: heard.append(True))
    prober.probe()
    assert heard == [True], "no condition changed: the pass's end alone triggers the publisher"
    assert publisher.reconcile() == 3


def test_a_fresh_process_keeps_the_published_time_of_the_same_taint(api, built, tmp_path):
    _, result, state, prober = _health(built, "sriov")
    prober.probe()
    first = make_publisher(api, tmp_path, Holder(result.inventory))
    first.taints = state.taints
    first.reconcile()
    published = _taints_in_api(api)
    later = {device: [{**t, "timeAdded": "2031-01-01T00:00:00Z"} for t in found]
             for device, found in state.taints().items()}  # found again after a restart
    api.reset_writes()
    again = make_publisher(api, tmp_path, Holder(result.inventory))
    again.taints = lambda: later
    assert again.reconcile() == 0 and api.writes() == []
    assert again.reconcile() == 0 and _taints_in_api(api) == published
    # A taint that changed (another value) is a new one: its own time.
    changed = dict(later)
    device = sorted(changed)[0]
    changed[device] = [{**changed[device][0], "value": "other"}]
    again.taints = lambda: changed
    assert again.reconcile() == 1
    assert _taints_in_api(api)[device][0]["timeAdded"] == "2031-01-01T00:00:00Z"
    assert {d: t for d, t in _taints_in_api(api).items() if d != device} == \
        {d: t for d, t in published.items() if d != device}
