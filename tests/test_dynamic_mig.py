"""Dynamic MIG publishing (#14, part 2): every partition a GPU could hold, as partitionable
devices with shared counters, in the slice layout of each API server version."""

from __future__ import annotations

import ctypes
import itertools

import kubernetes_validate
import pytest

from driver.kube import quantity

from driver.publish import slices
from driver.devices import mock
from driver.devices.discovery import discover
from driver.devices.mock import catalog
from driver.devices.mock.profile import parse
from driver.devices.model import DeviceKind
from driver.devices.net import NicFilter
from driver.kube.client import Kube, api_client
from driver.sim.apiserver import ApiServer
from driver.scheduling.k8s_limits import pool_counter_errors, slice_errors

MODELS = ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h200")
POOL = slices.PoolIdentity("accel.dra.io", "node-a", "uid-1")
LAYOUTS = {"1.34.0": slices.COMBINED, "1.35.0": slices.SPLIT, "1.36.0": slices.SPLIT,
           "1.37.0": slices.SPLIT}


def node(tmp_path, model: str, count: int = 1, mig: list[str] | None = None, mig_on: bool = False):
    spec = f"{{type: gpu, model: {model}" + (f", mig: [{', '.join(mig)}]" if mig else "") + "}"
    profile = parse('nvidia: {driverVersion: "550.54.15", cudaDriverVersion: 12040}\n'
                    f"roots: [{{devices: [{', '.join([spec] * count)}]}}]\n", f"{model}.yaml")
    built = mock.build(profile, tmp_path / model)
    if mig_on:  # an administrator enabled MIG mode (and reset the GPU where that is needed)
        for gpu in built.library.gpus:
            built.library.state.update(gpu.uuid, mig_mode=1)
    return built


def dynamic(built, profiles: frozenset[str] = frozenset(), owned=set):
    sources = built.sources(NicFilter())
    return discover(type(sources)(sources.sysfs, sources.proc, sources.nvml, sources.nic_filter,
                                  sources.pci_ids, "dynamic", owned, sources.away_netdevs, profiles))


def expected_partitions(model: str) -> int:
    return sum(len(p.starts) for p in catalog.GPUS[model].gi_profiles)


@pytest.mark.parametrize("model", MODELS)
def test_every_placement_is_a_device_and_the_slices_validate_in_both_layouts(model, tmp_path):
    mig_on = catalog.GPUS[model].mig_mode_needs_reset  # Ampere: partitions need MIG on
    result = dynamic(node(tmp_path, model, count=8, mig_on=mig_on))
    inventory = result.inventory
    migs = inventory.by_kind(DeviceKind.MIG)
    assert len(migs) == 8 * expected_partitions(model)
    # The whole GPU is offered beside its partitions only where MIG mode is off (Hopper).
    assert len(inventory.by_kind(DeviceKind.GPU)) == (0 if mig_on else 8)
    assert len(inventory.counter_sets) == 8
    for version, layout in LAYOUTS.items():
        objects = slices.build(inventory, POOL, 1, "v1", layout=layout)
        server = tuple(int(x) for x in version.split(".")[:2])
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)
            assert slice_errors(obj, server=server) == [], (version, obj["metadata"]["name"])
        assert pool_counter_errors(objects) == []
        assert {o["spec"]["pool"]["resourceSliceCount"] for o in objects} == {len(objects)}
        published = [d for o in objects for d in o["spec"].get("devices", [])]
        assert len(published) == len(inventory.devices), "nothing lost to the layout"
        if layout == slices.SPLIT:
            assert all(len(o["spec"].get("sharedCounters", [])) <= 8 for o in objects)
            assert all(not (o["spec"].get("sharedCounters") and o["spec"].get("devices"))
                       for o in objects)


def test_name_order_puts_whole_gpus_ahead_of_every_placement(tmp_path):
    """Upstream's allocator walks a pool's slices in name order and evaluates the selectors
    on every device it passes: a whole-GPU claim must meet the whole GPUs before any of
    the hundreds of placements, and a NIC or FPGA claim before them too."""
    mixed = mock.load("mixed")
    built = node(tmp_path, "h100-sxm5-80gb", count=8)
    result = dynamic(built)
    others = discover(mock.build(mixed, tmp_path / "mixed").sources()).inventory
    nics_fpgas = tuple(d for d in others.devices if d.kind in (DeviceKind.NIC, DeviceKind.FPGA))
    inventory = type(result.inventory)(result.inventory.devices + nics_fpgas, result.inventory.counter_sets)
    objects = slices.build(inventory, POOL, 1, "v1", layout=slices.SPLIT)
    walk = [(d["attributes"]["type"]["string"], "consumesCounters" in d)
            for o in sorted(objects, key=lambda o: o["metadata"]["name"]) for d in o["spec"].get("devices", [])]
    kinds = [k for k, _ in walk]
    first_mig = kinds.index("mig")
    assert kinds[:8] == ["gpu"] * 8 and all(counters for _, counters in walk[:8])
    assert set(kinds[first_mig:]) == {"mig"}, "nothing but placements after the first placement"
    assert kinds.index("nic") < first_mig and kinds.index("fpga") < first_mig


def test_name_order_is_gpus_then_nics_then_fpgas(tmp_path):
    inventory = discover(mock.build(mock.load("mixed"), tmp_path / "mixed").sources()).inventory
    objects = slices.build(inventory, POOL, 1, "v1")
    kinds = [d["attributes"]["type"]["string"]
             for o in sorted(objects, key=lambda o: o["metadata"]["name"]) for d in o["spec"].get("devices", [])]
    assert kinds == sorted(kinds, key=["gpu", "nic", "fpga"].index) and set(kinds) == {"gpu", "nic", "fpga"}


def test_counters_forbid_exactly_the_overlapping_pairs(tmp_path):
    inventory = dynamic(node(tmp_path, "h100-sxm5-80gb")).inventory
    (set_name, total), = inventory.counter_sets.items()
    devices = [d for d in inventory.devices if d.consumes]

    def fits(*chosen) -> bool:
        for counter, value in total.items():
            used = sum(quantity.value(d.consumes[set_name].get(counter, "0")) for d in chosen)
            if used > quantity.value(value):
                return False
        return True

    for a, b in itertools.combinations(devices, 2):
        if DeviceKind.GPU in (a.kind, b.kind):
            assert not fits(a, b), "the whole GPU excludes every partition"
            continue
        span = lambda d: set(range(d.attributes["placementStart"],  # noqa: E731
                                   d.attributes["placementStart"] + d.attributes["placementSize"]))
        compute = sum(int(d.consumes[set_name]["compute-slices"]) for d in (a, b))
        # The GPU has one set of the media engines a +me profile takes (its OFA).
        media = all(d.attributes["profile"].endswith("+me") for d in (a, b))
        assert fits(a, b) == (not span(a) & span(b) and compute <= 7 and not media), (a.name, b.name)
    # The densest packings NVIDIA documents fit: seven 1g.10gb; 3g.40gb + 4 x 1g.10gb.
    ones = [d for d in devices if d.attributes.get("profile") == "1g.10gb"]
    assert len(ones) == 7 and fits(*ones)
    three = next(d for d in devices if d.name.endswith("mig-3g-40gb-0"))
    assert fits(three, *[d for d in ones if d.attributes["placementStart"] >= 4])


@pytest.mark.parametrize("model", MODELS)
def test_published_capacity_is_what_the_created_instance_has(model, tmp_path):
    built = node(tmp_path, model, mig_on=True)
    inventory = dynamic(built).inventory
    nv = built.nvml
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    by_name = {p.name: p for p in catalog.GPUS[model].gi_profiles}
    for device in inventory.by_kind(DeviceKind.MIG):
        profile = by_name[device.attributes["profile"]]
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile.index)
        placement = nv.c_nvmlGpuInstancePlacement_t(device.attributes["placementStart"],
                                                    device.attributes["placementSize"])
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
        ci_index = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[info.sliceCount]
        ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, ci_index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
        mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        attrs = nv.nvmlDeviceGetAttributes(mig)
        assert quantity.value(device.capacity["memory"]) == attrs.memorySizeMB << 20, device.name
        assert int(device.capacity["multiprocessors"]) == attrs.multiprocessorCount, device.name
        assert int(device.capacity["copyEngines"]) == attrs.sharedCopyEngineCount
        nv.nvmlComputeInstanceDestroy(ci)
        nv.nvmlGpuInstanceDestroy(gi)


def test_instances_made_by_someone_else_are_left_alone_and_not_offered(tmp_path):
    inventory = dynamic(node(tmp_path, "h100-sxm5-80gb", mig=["3g.40gb"])).inventory
    starts = {d.attributes["placementStart"] for d in inventory.by_kind(DeviceKind.MIG)}
    assert starts and min(starts) >= 4, "memory slices 0-3 hold the other instance"
    assert inventory.by_kind(DeviceKind.GPU) == (), "nor the whole GPU"


def test_mig_profiles_offers_those_profiles_and_the_whole_gpu_with_all_its_counters(tmp_path):
    built = node(tmp_path, "h100-sxm5-80gb", count=2)
    every = dynamic(built).inventory
    chosen = dynamic(built, frozenset({"1g.10gb", "7g.80gb"})).inventory
    migs = chosen.by_kind(DeviceKind.MIG)
    assert {d.attributes["profile"] for d in migs} == {"1g.10gb", "7g.80gb"}
    starts = {p.name: len(p.starts) for p in catalog.GPUS["h100-sxm5-80gb"].gi_profiles}
    assert len(migs) == 2 * (starts["1g.10gb"] + starts["7g.80gb"]) < len(every.by_kind(DeviceKind.MIG))
    assert len(chosen.by_kind(DeviceKind.GPU)) == 2
    # What is offered consumes exactly what it did, from counter sets that are the GPU's
    # whole: leaving profiles out changes no arithmetic of the scheduler.
    assert chosen.counter_sets == every.counter_sets
    consumed = {d.name: d.consumes for d in every.devices}
    assert all(d.consumes == consumed[d.name] for d in chosen.devices)


def test_a_profile_the_gpu_lacks_is_named_in_a_problem(tmp_path):
    result = dynamic(node(tmp_path, "h100-sxm5-80gb"), frozenset({"1g.10gb", "2g.24gb"}))
    assert {d.attributes["profile"] for d in result.inventory.by_kind(DeviceKind.MIG)} == {"1g.10gb"}
    (problem,) = [p for p in result.problems if "--mig-profiles" in p.message]
    assert "2g.24gb" in problem.message and "3g.40gb" in problem.message  # what it has instead


def test_an_instance_this_driver_created_stays_published_when_its_profile_is_not_offered(tmp_path):
    """A claim holds it: unpublished, its counters would be free to the scheduler and an
    overlapping placement could be handed out."""
    built = node(tmp_path, "h100-sxm5-80gb", mig=["3g.40gb"])
    nv = built.nvml
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    uuid = nv.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, nv.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    array, count = (nv.c_nvmlGpuInstance_t * 8)(), ctypes.c_uint(8)
    nv.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
    ours = {(uuid, nv.nvmlGpuInstanceGetInfo(array[0]).id)}
    inventory = dynamic(built, frozenset({"1g.10gb"}), owned=lambda: ours).inventory
    profiles = {(d.attributes["profile"], d.attributes["placementStart"]) for d in inventory.by_kind(DeviceKind.MIG)}
    assert ("3g.40gb", 0) in profiles
    assert {p for p, _ in profiles} == {"1g.10gb", "3g.40gb"} and ("3g.40gb", 4) not in profiles


def test_ampere_with_mig_off_is_offered_whole_and_says_why(tmp_path):
    result = dynamic(node(tmp_path, "a100-sxm4-40gb"))
    assert [d.kind for d in result.inventory.devices] == [DeviceKind.GPU]
    assert not result.inventory.devices[0].consumes
    assert any("only with a reset" in p.message for p in result.problems)


def test_the_emulator_enforces_each_versions_layout(tmp_path):
    inventory = dynamic(node(tmp_path, "h100-sxm5-80gb", count=2)).inventory
    combined = slices.build(inventory, POOL, 1, "v1", layout=slices.COMBINED)
    split = slices.build(inventory, POOL, 1, "v1", layout=slices.SPLIT)
    assert any("only one of devices and sharedCounters" in e
               for o in combined for e in slice_errors(o, server=(1, 35)))
    assert any("is not a counter set of this slice" in e
               for o in split for e in slice_errors(o, server=(1, 34)))
    with ApiServer(server_version=(1, 36), gates={"DRAPartitionableDevices": False}) as api:
        kube = Kube(api_client(api.kubeconfig(tmp_path)))
        for obj in split:
            kube.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body=obj)
        stored = api.slices()
        assert not any(o["spec"].get("sharedCounters") for o in stored), "gate off: dropped"
        assert not any(d.get("consumesCounters") for o in stored for d in o["spec"].get("devices", []))
        assert kube.request("GET", "/version")["minor"] == "36"
