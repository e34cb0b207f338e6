"""The fake NVML library's MIG management (the ground dynamic MIG stands on), exercised
through the real nvidia-ml-py: every profile and placement of each model, overlaps,
rollback-relevant errors, MIG mode changes, persistence across a driver restart and loss
at a reboot, and static discovery seeing what was created."""

from __future__ import annotations

import ctypes

import pytest

from driver.devices import mock
from driver.devices.discovery import discover
from driver.devices.mock import catalog
from driver.devices.mock.profile import parse

MODELS = ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h200")


def node_of(model: str, root, mig: list[str] | None = None):
    spec = f"{{type: gpu, model: {model}" + (f", mig: [{', '.join(mig)}]" if mig else "") + "}"
    profile = parse(f'nvidia: {{driverVersion: "550.54.15", cudaDriverVersion: 12040}}\n'
                    f"roots: [{{devices: [{spec}]}}]\n", f"{model}.yaml")
    return mock.build(profile, root), profile


class Gpu:
    def __init__(self, node):
        self.nv = node.nvml
        self.nv.nvmlInit()
        self.handle = self.nv.nvmlDeviceGetHandleByIndex(0)

    def enable_mig(self) -> None:
        self.nv.nvmlDeviceSetMigMode(self.handle, self.nv.NVML_DEVICE_MIG_ENABLE)

    def placements(self, profile_id: int) -> list:
        count = ctypes.c_uint(0)
        self.nv.nvmlDeviceGetGpuInstancePossiblePlacements(self.handle, profile_id, None, ctypes.byref(count))
        array = (self.nv.c_nvmlGpuInstancePlacement_t * count.value)()
        self.nv.nvmlDeviceGetGpuInstancePossiblePlacements(self.handle, profile_id, array, ctypes.byref(count))
        return list(array)

    def create(self, profile: catalog.GiProfile, placement):
        nv = self.nv
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(self.handle, profile.index)
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(self.handle, info.id, ctypes.byref(placement))
        # The compute instance profile whose slice count matches the GPU instance's.
        ci_index = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[info.sliceCount]
        ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, ci_index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
        return info, gi, ci

    def migs(self) -> list:
        found = []
        for i in range(self.nv.nvmlDeviceGetMaxMigDeviceCount(self.handle)):
            try:
                found.append(self.nv.nvmlDeviceGetMigDeviceHandleByIndex(self.handle, i))
            except self.nv.NVMLError_NotFound:
                break
        return found


@pytest.mark.parametrize("model", MODELS)
def test_every_profile_and_placement_creates_what_was_advertised(model, tmp_path):
    node, _ = node_of(model, tmp_path / "m")
    gpu = Gpu(node)
    nv = gpu.nv
    with pytest.raises(nv.NVMLError_InvalidState):  # MIG mode off: nothing can be created
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, catalog.GPUS[model].gi_profiles[0].index)
        gpu.create(catalog.GPUS[model].gi_profiles[0], gpu.placements(info.id)[0])
    gpu.enable_mig()
    if catalog.GPUS[model].mig_mode_needs_reset:
        assert nv.nvmlDeviceGetMigMode(gpu.handle) == [0, 1], "Ampere: pending until a reset"
        node.library.state.update(node.library.gpus[0].uuid, mig_mode=1, pending_mig_mode=None)
    assert nv.nvmlDeviceGetMigMode(gpu.handle) == [1, 1]
    for profile in catalog.GPUS[model].gi_profiles:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, profile.index)
        assert (info.sliceCount, info.memorySizeMB, info.multiprocessorCount) == \
            (profile.compute_slices, profile.memory_mib, profile.multiprocessors)
        placements = gpu.placements(info.id)
        assert [(p.start, p.size) for p in placements] == [(s, profile.memory_slices) for s in profile.starts]
        for placement in placements:
            _, gi, ci = gpu.create(profile, placement)
            (mig,) = gpu.migs()
            attrs = nv.nvmlDeviceGetAttributes(mig)
            assert attrs.memorySizeMB == profile.memory_mib
            assert attrs.multiprocessorCount == profile.multiprocessors
            assert nv.nvmlGpuInstanceGetInfo(gi).placement.start == placement.start
            with pytest.raises(nv.NVMLError_InUse):  # compute instance first
                nv.nvmlGpuInstanceDestroy(gi)
            nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)
            assert gpu.migs() == []
    assert node.library.errors == []


def test_overlapping_placements_are_refused_and_free_ones_fit(tmp_path):
    node, _ = node_of("h100-sxm5-80gb", tmp_path / "m")
    gpu = Gpu(node)
    nv = gpu.nv
    gpu.enable_mig()
    assert nv.nvmlDeviceGetMigMode(gpu.handle) == [1, 1], "Hopper: on demand"
    profiles = {p.name: p for p in catalog.GPUS["h100-sxm5-80gb"].gi_profiles}
    three = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, profiles["3g.40gb"].index)
    gpu.create(profiles["3g.40gb"], gpu.placements(three.id)[0])  # memory slices 0-3
    one = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, profiles["1g.10gb"].index)
    placements = gpu.placements(one.id)
    with pytest.raises(nv.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(gpu.handle, one.id, ctypes.byref(placements[2]))
    for placement in placements[4:]:  # slices 4, 5, 6 are free
        gpu.create(profiles["1g.10gb"], placement)
    assert len(gpu.migs()) == 4
    bad = nv.c_nvmlGpuInstancePlacement_t(3, 4)  # not one of 3g.40gb's placements
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(gpu.handle, three.id, ctypes.byref(bad))
    with pytest.raises(nv.NVMLError_InUse):  # MIG mode stays while instances exist
        nv.nvmlDeviceSetMigMode(gpu.handle, nv.NVML_DEVICE_MIG_DISABLE)


def test_static_instances_are_occupied_and_created_ones_outlive_a_restart(tmp_path):
    node, profile = node_of("a100-sxm4-40gb", tmp_path / "m", ["3g.20gb"])
    gpu = Gpu(node)
    nv = gpu.nv
    profiles = {p.name: p for p in catalog.GPUS["a100-sxm4-40gb"].gi_profiles}
    three = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, profiles["3g.20gb"].index)
    first, second = gpu.placements(three.id)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # the profile's own instance
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(gpu.handle, three.id, ctypes.byref(first))
    gpu.create(profiles["3g.20gb"], second)
    assert len(gpu.migs()) == 2
    # Discovery (static MIG) sees the created instance with its capability device nodes.
    found = discover(node.sources())
    migs = [d for d in found.inventory.devices if d.kind.value == "mig"]
    assert len(migs) == 2 and all(len(d.device_nodes) == 3 for d in migs), found.problems
    # A driver restart (the tree rebuilt, a new library) keeps what the GPU holds...
    again = mock.build(profile, node.root)
    assert len(Gpu(again).migs()) == 2
    # ...a reboot does not.
    (node.root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text("next-boot\n")
    assert len(Gpu(mock.build(profile, node.root)).migs()) == 1


# NVIDIA's MIG User Guide, "Supported MIG Profiles": per profile the memory (eighths), the
# compute slices (sevenths), the number of instances, NVDEC / JPEG / OFA and copy engines.
# A100 1g.10gb: the guide's table says 1/8 of the memory, its `-lgipp` example places the
# profile (id 15) at {0,2,4,6}:2, i.e. two eighths, as on every other model.
_HOPPER = ((1, 1, 7, (1, 1, 0), 1), (1, 1, 1, (1, 1, 1), 1), (2, 1, 4, (1, 1, 0), 1),
           (2, 2, 3, (2, 2, 0), 2), (4, 3, 2, (3, 3, 0), 3), (4, 4, 1, (4, 4, 0), 4),
           (8, 7, 1, (7, 7, 1), 8))
_AMPERE = ((1, 1, 7, (0, 0, 0), 1), (1, 1, 1, (1, 1, 1), 1), (2, 1, 4, (1, 0, 0), 1),
           (2, 2, 3, (1, 0, 0), 2), (4, 3, 2, (2, 0, 0), 3), (4, 4, 1, (2, 0, 0), 4),
           (8, 7, 1, (5, 1, 1), 7))
GUIDE = {
    "a100-sxm4-40gb": (("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"), _AMPERE),
    "a100-sxm4-80gb": (("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), _AMPERE),
    "h100-sxm5-80gb": (("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), _HOPPER),
    "h200": (("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), _HOPPER),
}


@pytest.mark.parametrize("model", MODELS)
def test_profiles_are_the_mig_user_guides_table(model, tmp_path):
    node, _ = node_of(model, tmp_path / "m")
    gpu = Gpu(node)
    nv = gpu.nv
    names, rows = GUIDE[model]
    seen = {}
    for profile in catalog.GPUS[model].gi_profiles:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfoV(gpu.handle, profile.index)
        name = str(info.name).split()[-1]
        sizes = {p.size for p in gpu.placements(info.id)}
        seen[name] = (sizes.pop() if len(sizes) == 1 else sizes, info.sliceCount, info.instanceCount,
                      (info.decoderCount, info.jpegCount, info.ofaCount), info.copyEngineCount)
    assert seen == dict(zip(names, rows))
    if model == "h100-sxm5-80gb":  # nvidia-smi mig -lgip on an H100 80GB: 1g.20gb has 26 SMs
        sms = {p.name: p.multiprocessors for p in catalog.GPUS[model].gi_profiles}
        assert (sms["1g.10gb"], sms["1g.10gb+me"], sms["1g.20gb"], sms["2g.20gb"]) == (16, 16, 26, 32)


@pytest.mark.parametrize("model", MODELS)
def test_one_media_extension_instance_at_a_time(model, tmp_path):
    node, _ = node_of(model, tmp_path / "m")
    node.library.state.update(node.library.gpus[0].uuid, mig_mode=1)
    gpu = Gpu(node)
    nv = gpu.nv
    (me,) = [p for p in catalog.GPUS[model].gi_profiles if p.name.endswith("+me")]
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, me.index)
    first, second = gpu.placements(info.id)[:2]
    gpu.create(me, first)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # free memory slice, no engines
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(gpu.handle, info.id, ctypes.byref(second))
    plain = next(p for p in catalog.GPUS[model].gi_profiles if p.index == 0)
    gpu.create(plain, gpu.placements(
        nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, plain.index).id)[1])
    assert len(gpu.migs()) == 2
