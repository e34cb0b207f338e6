"""Dynamic MIG at prepare (#14, part 3): partitions created through the fake NVML library
by the real driver code, rolled back on failure, destroyed when no claim holds them, and
cleaned up after a crash; the publisher's layout by server version and its fallback."""

from __future__ import annotations

import ctypes
import json
import time
import uuid

import pytest

from driver.devices import mock
from driver.devices.mock.profile import parse
from driver.devices.model import DeviceKind
from driver.state.checkpoint import ClaimRecord, PreparedDevice, State
from driver.prepare.mig import MigError, MigPartitions, MigRecord, MigRecords
from driver.state.instance import Instance
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.scheduling.k8s_limits import pool_counter_errors
from driver.sim.kubelet import Claim
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from driver.devices.discovery import discover
from tests.test_dynamic_mig import dynamic

H100_NODE = """
description: two H100 (MIG off, changed on demand), one holding a 3g.40gb someone else made
nvidia: {driverVersion: "550.54.15", cudaDriverVersion: 12040}
roots:
  - devices:
      - {type: gpu, model: h100-sxm5-80gb}
      - {type: gpu, model: h100-sxm5-80gb, mig: [3g.40gb]}
"""
GPU = "gpu-0000-11-00-0"
OTHER = "gpu-0000-12-00-0"


@pytest.fixture
def h100(tmp_path):
    built = mock.build(parse(H100_NODE, "h100.yaml"), tmp_path / "m")
    inventory = dynamic(built).inventory
    instance = Instance.register(tmp_path / "state", None)
    records = MigRecords(tmp_path / "state", instance)
    partitions = MigPartitions(records, built.nvml, built.sysfs, built.proc,
                               (built.proc / "sys/kernel/random/boot_id").read_text().strip(),
                               lambda: inventory)
    yield built, inventory, partitions
    instance.release()


def created(built) -> list[dict]:
    return [i for gpu in built.library.gpus for i in built.library.created(gpu)]


def test_each_partition_is_created_as_published_and_destroyed(h100):
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    first = nv.nvmlDeviceGetHandleByIndex(0)
    for device in (d for d in inventory.by_kind(DeviceKind.MIG) if d.name.startswith(GPU)):
        concrete = partitions.ensure("ns/c", device)
        assert nv.nvmlDeviceGetMigMode(first)[0] == 1, "enabled on demand (Hopper)"
        assert concrete.attributes["uuid"].startswith("MIG-")
        assert len(concrete.device_nodes) == 3 and concrete.device_nodes[0] == "/dev/nvidia0"
        assert all((built.dev / n.removeprefix("/dev/")).exists() for n in concrete.device_nodes)
        again = partitions.ensure("ns/c", device)  # a retried prepare: the same instance
        assert again.attributes["uuid"] == concrete.attributes["uuid"]
        assert partitions.release_unneeded([]) == []
        assert created(built) == [] and partitions.records.all() == []
        assert nv.nvmlDeviceGetMigMode(first)[0] == 0, "and off again with the last one"


def test_a_failure_between_gpu_and_compute_instance_rolls_back(h100):
    built, inventory, partitions = h100
    device = inventory.get(f"{GPU}-mig-3g-40gb-0")
    built.library.unsupported.add("nvmlGpuInstanceCreateComputeInstance")
    with pytest.raises(MigError, match="compute instance.*destroyed again"):
        partitions.ensure("ns/c", device)
    assert created(built) == [] and partitions.records.all() == []
    built.library.unsupported.clear()
    assert partitions.ensure("ns/c", device).attributes["profile"] == "3g.40gb"


def test_overlapping_placements_are_refused_by_name(h100):
    _, inventory, partitions = h100
    partitions.ensure("ns/a", inventory.get(f"{GPU}-mig-3g-40gb-0"))
    with pytest.raises(MigError) as err:
        partitions.ensure("ns/b", inventory.get(f"{GPU}-mig-2g-20gb-2"))
    assert "claim ns/b" in str(err.value) and "memory slices 2-3" in str(err.value)


def test_instances_of_others_are_never_touched(h100):
    built, inventory, partitions = h100
    assert not any(d.name.startswith(f"{OTHER}-mig-3g-40gb-0") for d in inventory.devices)
    partitions.ensure("ns/a", inventory.get(f"{OTHER}-mig-3g-40gb-4"))
    partitions.release_unneeded([])
    nv = built.nvml
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0), "the static 3g.40gb is still there"


# -- the driver process ---------------------------------------------------------------------------
def partition_claim(api, name: str, device: str) -> Claim:
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "mig", "driver": DRIVER, "pool": "node-a", "device": device}]))
    return Claim("default", name, uid)


@pytest.fixture
def driver(tmp_path):
    profile = tmp_path / "h100.yaml"
    profile.write_text(H100_NODE)
    dirs = DriverDirs.make()
    procs = []

    def start(api, extra=()):
        proc = DriverProcess(api, dirs, profile=str(profile),
                             extra=["--mig-mode", "dynamic", *extra]).start()
        procs.append(proc)
        return proc, proc.kubelet()

    yield dirs, start
    for proc in procs:
        proc.kill()
    dirs.cleanup()


def state_instances(dirs) -> list[dict]:
    found = []
    for path in (dirs.state / "mock" / "gpu-state").glob("*.json"):
        found += json.loads(path.read_text()).get("instances") or []
    return found


def test_prepare_creates_the_partition_and_unprepare_destroys_it(driver):
    dirs, start = driver
    with ApiServer() as api:
        api.add_node("node-a")
        proc, kubelet = start(api)
        assert api.wait_for(lambda: len(api.state.slices) >= 2)
        claim = partition_claim(api, "train", f"{GPU}-mig-3g-40gb-4")
        reply = kubelet.prepare([claim]).claims[claim.uid]
        assert reply.error == "", reply.error
        spec = json.loads((dirs.cdi / f"{DRIVER}-claim_{claim.uid}.json").read_text())
        nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        assert sum(n.startswith("/dev/nvidia-caps/") for n in nodes) == 2
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["DRA_GPU_0000_11_00_0_MIG_3G_40GB_4_UUID"].startswith("MIG-")
        assert [(i["start"], i["ci"]) for i in state_instances(dirs)] == [(4, 0)]
        # Still published as it was: the created instance is ours, counters keep it taken.
        time.sleep(1.0)
        assert pool_counter_errors(api.slices()) == []
        assert any(d["name"] == f"{GPU}-mig-3g-40gb-4" for s in api.slices()
                   for d in s["spec"].get("devices", []))
        assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert state_instances(dirs) == []


def test_a_crash_between_the_two_nvml_calls_leaves_no_orphan(driver, tmp_path):
    """What a SIGKILL after the GPU instance and before the compute instance leaves: a
    record naming the GPU instance, and the instance. The next start destroys it and the
    kubelet's retry prepares the claim anew."""
    dirs, start = driver
    profile = parse(H100_NODE, "h100.yaml")
    built = mock.build(profile, dirs.state / "mock")
    nv = built.nvml
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(handle, 1)
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, nv.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    placement = nv.c_nvmlGpuInstancePlacement_t(0, 4)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
    boot = (built.proc / "sys/kernel/random/boot_id").read_text().strip()
    instance = Instance.register(dirs.state, None)
    MigRecords(dirs.state, instance).put(MigRecord(
        f"{GPU}-mig-3g-40gb-0", built.library.gpus[0].uuid, 2, 0, 4, boot,
        gpu_instance=nv.nvmlGpuInstanceGetInfo(gi).id))
    instance.release()
    nv.nvmlShutdown()
    with ApiServer() as api:
        api.add_node("node-a")
        proc, kubelet = start(api)
        deadline = time.monotonic() + 20
        while state_instances(dirs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state_instances(dirs) == [], proc.log()[-2000:]
        claim = partition_claim(api, "retry", f"{GPU}-mig-3g-40gb-0")
        assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert state_instances(dirs) == [] and not list((dirs.state / "mig").glob("*.json"))


def test_sigkill_between_the_two_nvml_calls_leaves_no_orphan(driver):
    """The driver is killed while NVML creates the compute instance (the mock GPU is made
    slow there): the GPU instance exists and is recorded, nothing else. The next start
    destroys it; the kubelet's retry prepares the claim."""
    import threading

    dirs, start = driver
    with ApiServer() as api:
        api.add_node("node-a")
        proc, kubelet = start(api)
        (dirs.state / "mock" / "nvml-delays.json").write_text(
            json.dumps({"nvmlGpuInstanceCreateComputeInstance": 30}))
        claim = partition_claim(api, "killed", f"{GPU}-mig-4g-40gb-0")
        thread = threading.Thread(target=lambda: _quietly(kubelet.prepare, [claim], timeout=40))
        thread.start()
        record = dirs.state / "mig" / f"{GPU}-mig-4g-40gb-0.json"
        deadline = time.monotonic() + 20
        while not (record.exists() and json.loads(record.read_text())["gpu_instance"] is not None):
            assert time.monotonic() < deadline, proc.log()[-2000:]
            time.sleep(0.05)
        proc.kill()
        thread.join()
        assert [(i["start"], i["ci"]) for i in state_instances(dirs)] == [(0, None)], "half made"
        (dirs.state / "mock" / "nvml-delays.json").unlink()
        proc, kubelet = start(api)
        deadline = time.monotonic() + 20
        while state_instances(dirs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state_instances(dirs) == [], "the orphan GPU instance is destroyed"
        assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        assert [(i["start"], i["ci"]) for i in state_instances(dirs)] == [(0, 0)]
        assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert state_instances(dirs) == []


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception:
        pass


@pytest.mark.parametrize("server, counters_slices", [((1, 34), 0), ((1, 35), 1)])
def test_the_layout_follows_the_server_version(driver, server, counters_slices):
    dirs, start = driver
    with ApiServer(server_version=server) as api:
        api.add_node("node-a")
        start(api)
        assert api.wait_for(lambda: any("partitions" in n for n in api.state.slices))
        time.sleep(0.5)
        stored = api.slices()
        only_counters = [s for s in stored if s["spec"].get("sharedCounters") and not s["spec"].get("devices")]
        assert len(only_counters) == counters_slices
        assert pool_counter_errors(stored) == []


def test_without_shared_counters_the_node_publishes_static_mig(driver):
    dirs, start = driver
    with ApiServer(gates={"DRAPartitionableDevices": False}) as api:
        api.add_node("node-a")
        proc, _ = start(api)

        # Between the server dropping the counters and the rediscovery in static MIG mode
        # (debounced), the partitions are withdrawn before the MIG devices appear; the
        # watch now repairs at once, so the test waits for the end state.
        def static() -> bool:
            devices = {d["name"] for s in api.slices() for d in s["spec"].get("devices", [])}
            return "mig-0000-12-00-0-gi1-ci0" in devices and not any("-mig-" in d for d in devices)

        assert api.wait_for(static, timeout=20), proc.log()[-2000:]
        names = {d["name"] for s in api.slices() for d in s["spec"].get("devices", [])}
        assert GPU in names and "mig-0000-12-00-0-gi1-ci0" in names, names
        assert not any(s["spec"].get("sharedCounters") for s in api.slices())
        assert proc.log().count("partitionable_devices_unsupported") == 1


@pytest.mark.parametrize("model", ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h200"))
def test_every_partition_of_every_model_is_created_and_destroyed(model, tmp_path):
    from driver.devices.mock import catalog
    from tests.test_dynamic_mig import node

    built = node(tmp_path, model, mig_on=catalog.GPUS[model].mig_mode_needs_reset)
    inventory = dynamic(built).inventory
    instance = Instance.register(tmp_path / "state", None)
    try:
        partitions = MigPartitions(MigRecords(tmp_path / "state", instance), built.nvml, built.sysfs,
                                   built.proc, (built.proc / "sys/kernel/random/boot_id").read_text().strip(),
                                   lambda: inventory)
        devices = inventory.by_kind(DeviceKind.MIG)
        assert devices
        for device in devices:
            concrete = partitions.ensure("ns/c", device)
            after = {d.attributes.get("uuid"): d for d in discover(built.sources()).inventory.devices}
            created_device = after[concrete.attributes["uuid"]]  # as static discovery sees it
            assert created_device.capacity == device.capacity, device.name
            assert created_device.attributes["profile"] == device.attributes["profile"]
            assert partitions.release_unneeded([]) == []
        assert created(built) == []
    finally:
        instance.release()


def test_mig_mode_the_driver_turned_on_goes_off_with_the_last_partition(h100):
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    first = nv.nvmlDeviceGetHandleByIndex(0)
    a = partitions.ensure("ns/a", inventory.get(f"{GPU}-mig-1g-10gb-0"))
    b = partitions.ensure("ns/b", inventory.get(f"{GPU}-mig-1g-10gb-1"))
    assert a.attributes["uuid"] != b.attributes["uuid"]
    assert nv.nvmlDeviceGetMigMode(first)[0] == 1
    held = [ClaimRecord("u", "ns", "b", State.PREPARE_COMPLETED, "boot",
                        (PreparedDevice("mig", "node-a", f"{GPU}-mig-1g-10gb-1", ()),))]
    assert partitions.release_unneeded(held) == []
    assert nv.nvmlDeviceGetMigMode(first)[0] == 1, "one partition is still there"
    assert partitions.release_unneeded([]) == []
    assert nv.nvmlDeviceGetMigMode(first)[0] == 0
    assert inventory.get(GPU) is not None and dynamic(built).inventory.get(GPU) is not None, \
        "the whole GPU is offered again"
    # A GPU whose MIG mode an administrator turned on keeps it (the 3g.40gb's GPU).
    partitions.ensure("ns/c", inventory.get(f"{OTHER}-mig-1g-10gb-4"))
    partitions.release_unneeded([])
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(1))[0] == 1


def test_an_xid_in_a_created_partition_marks_that_partition_only(h100):
    from driver.monitoring.health import HealthState, XidWatcher

    built, inventory, partitions = h100
    device = inventory.get(f"{GPU}-mig-3g-40gb-4")
    partitions.ensure("ns/c", device)
    (record,) = partitions.records.all()
    state = HealthState("accel.dra.io", lambda: inventory)

    def holders(bus_id: str, gi: int) -> list[str]:
        return [r.device for r in partitions.records.all() if r.gpu_instance == gi
                and inventory.get(r.device).pci.bus_id == bus_id]

    watcher = XidWatcher(built.nvml, state, frozenset(), holders)
    watcher.start()
    try:
        assert watcher.ready.wait(10)
        built.library.inject_xid(0, 94, gpu_instance=record.gpu_instance, compute_instance=0)
        deadline = time.monotonic() + 10
        while not state.taints() and time.monotonic() < deadline:
            time.sleep(0.02)
        taints = state.taints()
        assert set(taints) == {device.name}, taints
    finally:
        watcher.stop()


# -- MIG mode changes: failures undone, markers reconciled, a rebind followed (issue 28.8) ------

def _marker(partitions, gpu_uuid: str):
    return partitions.records.directory / f"mig-mode-enabled-{gpu_uuid}"


def _whole_gpu_claim(uid: str, name: str) -> ClaimRecord:
    return ClaimRecord(uid, "team", name, State.PREPARE_COMPLETED, "boot",
                       (PreparedDevice("gpu", "node-a", GPU, ()),))


def test_mig_mode_in_use_names_the_users_and_leaves_nothing_behind(h100):
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    gpu = built.library.gpus[0]
    built.library.loads.set(gpu.uuid, processes=[(4242, 1 << 30)])
    partitions.claims = lambda: [_whole_gpu_claim("u1", "trainer")]
    with pytest.raises(MigError) as failed:
        partitions.ensure("ns/c", inventory.get(f"{GPU}-mig-1g-10gb-0"))
    message = str(failed.value)
    assert "in use" in message and "4242" in message and "team/trainer" in message, message
    assert "reset" not in message, message
    assert partitions.records.all() == [] and not _marker(partitions, gpu.uuid).exists()
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    # The GPU is free again and an administrator turns MIG on: that mode is theirs, and
    # stays on after our partition comes and goes (a marker left by the failure would
    # have turned it off).
    built.library.loads.set(gpu.uuid, processes=[])
    nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(0), nv.NVML_DEVICE_MIG_ENABLE)
    partitions.ensure("ns/c", inventory.get(f"{GPU}-mig-1g-10gb-0"))
    assert partitions.release_unneeded([]) == []
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0))[0] == 1


def test_a_pending_mig_mode_blames_the_reset_and_is_cancelled(h100):
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    gpu = built.library.gpus[0]
    gpu.mig_mode_needs_reset = True  # as an Ampere GPU: the change waits for a reset
    with pytest.raises(MigError, match="only after a GPU reset"):
        partitions.ensure("ns/c", inventory.get(f"{GPU}-mig-1g-10gb-0"))
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0)) == [0, 0], "pending enable cancelled"
    assert partitions.records.all() == [] and not _marker(partitions, gpu.uuid).exists()


@pytest.mark.parametrize("mode, instance", [(0, False), (1, False), (1, True)])
def test_a_marker_no_record_explains_is_reconciled(h100, mode, instance):
    """What a crash between the marker and the undo (or an older driver) leaves: a marker
    without a record. MIG off: the marker goes; on with nothing on it: turned off; on with
    an instance someone made: left as it is, marker and all."""
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    gpu = built.library.gpus[0]
    marker = _marker(partitions, gpu.uuid)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_bytes(b"enabled\n")
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    if mode:
        nv.nvmlDeviceSetMigMode(handle, nv.NVML_DEVICE_MIG_ENABLE)
    if instance:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, 0)
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(
            nv.c_nvmlGpuInstancePlacement_t(0, 1)))
    assert partitions.recorded(), "the preparer asks for a release where only a marker is left"
    assert partitions.release_unneeded([]) == []
    assert marker.exists() == instance
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0))[0] == (1 if instance else 0)


def test_a_rebind_at_the_mode_change_is_followed(h100):
    built, inventory, partitions = h100
    nv = built.nvml
    nv.nvmlInit()
    gpu = built.library.gpus[0]
    old_minor = gpu.minor
    built.library.rebind_at_mig_mode_change.add(gpu.uuid)
    asked = []
    partitions.rediscover = lambda: asked.append(True)
    concrete = partitions.ensure("ns/c", inventory.get(f"{GPU}-mig-3g-40gb-0"))
    assert gpu.minor != old_minor, "the fake rebound the GPU"
    assert concrete.attributes["parentMinor"] == gpu.minor
    assert concrete.device_nodes[0] == f"/dev/nvidia{gpu.minor}"
    assert all((built.dev / n.removeprefix("/dev/")).exists() for n in concrete.device_nodes)
    assert asked, "the node is rediscovered, so the slices publish the new minor"
    republished = dynamic(built).inventory
    assert {d.attributes["parentMinor"] for d in republished.by_kind(DeviceKind.MIG)
            if d.name.startswith(GPU)} == {gpu.minor}
    # The partition goes, MIG mode with it (through a fresh handle, after another rebind).
    built.library.rebind_at_mig_mode_change.add(gpu.uuid)
    assert partitions.release_unneeded([]) == []
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByUUID(gpu.uuid))[0] == 0
