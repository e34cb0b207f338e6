"""MIG management in the fake NVML library: GPU and compute instance profiles, placements,
creation and destruction, MIG mode changes (dynamic MIG).

A mixin of FakeNvmlLibrary. The instances created through it are kept in the GPU's state
(driver/devices/mock/gpustate.py), so that they outlive the driver process as on a real
GPU and are gone after a reboot; instances of the mock profile (static MIG) come first and
count as created by someone else. Each created compute instance is a MIG device, found by
nvmlDeviceGetMigDeviceHandleByIndex like a static one.

Return codes follow NVML's documentation: a placement that is not one of the profile's is
INVALID_ARGUMENT, one that overlaps an instance INSUFFICIENT_RESOURCES, destroying a GPU
instance that still has compute instances IN_USE, MIG operations on a GPU whose MIG mode
is off INVALID_STATE (NOT_SUPPORTED where the GPU has no MIG), a MIG mode change with
instances present, or with processes running on the GPU, IN_USE; on a GPU that changes MIG
mode only with a reset (Ampere) the new mode stays pending and the activation status is
RESET_REQUIRED. A test can make a GPU rebind at its next MIG mode change (`rebind_at_mig_
mode_change`), as the NVIDIA driver may: its handles change (old ones are refused) and it
gets a new minor number, with its /dev/nvidia<minor> node.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import time
import uuid
from ctypes import c_uint, c_void_p
from typing import Any

from driver.devices.mock.catalog import MIB, GiProfile
from driver.devices.mock.model import FakeGpu, FakeMig, export

_GI_BASE, _CI_BASE, _GPU_SPAN = 0x7F5C_0000_0000, 0x7F5D_0000_0000, 0x1_0000
# Compute instance profiles: NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices.
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
_UUID_NS = uuid.UUID("0c5d3c1e-8f0a-4a55-b5a4-6f3e2d1c0b9a")


class MigManagement:
    """Expects the library's `nv`, `gpus`, `state`, `_resolve`, `_fail`, `_put`,
    `_initialized` and `_lock`."""

    nv: Any
    gpus: list[FakeGpu]
    bindings: dict[int, int]
    # GPU UUIDs that rebind at their next MIG mode change (tests).
    rebind_at_mig_mode_change: set[str]

    # -- the model ---------------------------------------------------------------------------
    def mig_modes(self, gpu: FakeGpu) -> tuple[int, int]:
        state = self.state.get(gpu.uuid)
        current = state.mig_mode if state.mig_mode is not None else (1 if gpu.migs else 0)
        pending = state.pending_mig_mode if state.pending_mig_mode is not None else current
        return current, pending

    def created(self, gpu: FakeGpu) -> list[dict]:
        return [dict(i) for i in self.state.get(gpu.uuid).instances]

    def instances(self, gpu: FakeGpu) -> list[dict]:
        """Every GPU instance: the profile's static ones (fixed in the mock: NO_PERMISSION
        to destroy them), then the created ones."""
        static = [{"gi": m.gi, "profile": m.gi_profile, "start": m.start, "ci": m.ci,
                   "ci_profile": None, "static": True}
                  for m in gpu.migs if m.gi_profile is not None]
        return static + self.created(gpu)

    def migs(self, gpu: FakeGpu) -> list[FakeMig]:
        """Static MIG devices, then one per created compute instance."""
        found = list(gpu.migs)
        for instance in self.created(gpu):
            if instance.get("ci") is None:
                continue
            profile = self._gi_profile(gpu, instance["profile"])
            slices = CI_SLICES[instance["ci_profile"]]
            key = f"{gpu.uuid}/{instance['gi']}/{instance['ci']}"
            found.append(FakeMig(
                uuid=f"MIG-{uuid.uuid5(_UUID_NS, key)}",
                profile=profile.name if slices == profile.compute_slices
                else f"{slices}c.{profile.name}",
                gi=instance["gi"], ci=instance["ci"], memory_bytes=profile.memory_mib * MIB,
                slices=slices,
                multiprocessors=profile.multiprocessors * slices // profile.compute_slices,
                copy_engines=profile.copy_engines, decoders=profile.decoders,
                encoders=profile.encoders, start=instance["start"],
                memory_slices=profile.memory_slices, gi_profile=profile.index))
        return found

    def _gi_profile(self, gpu: FakeGpu, index: int) -> GiProfile:
        for profile in gpu.gi_profiles:
            if profile.index == index:
                return profile
        raise self._fail("NVML_ERROR_NOT_SUPPORTED")

    def _occupied(self, gpu: FakeGpu) -> list[tuple[int, set[int]]]:
        """(GPU instance id, memory slices) of every GPU instance, static ones included."""
        used = [(m.gi, set(range(m.start, m.start + m.memory_slices))) for m in gpu.migs]
        for instance in self.created(gpu):
            profile = self._gi_profile(gpu, instance["profile"])
            used.append((instance["gi"], set(range(instance["start"],
                                                    instance["start"] + profile.memory_slices))))
        return used

    def _mig_gpu(self, handle: int) -> FakeGpu:
        gpu, mig = self._resolve(handle)
        if mig is not None or not gpu.gi_profiles:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        return gpu

    def _enabled(self, gpu: FakeGpu) -> None:
        if self.mig_modes(gpu)[0] != self.nv.NVML_DEVICE_MIG_ENABLE:
            raise self._fail("NVML_ERROR_INVALID_STATE")

    # -- handles ---------------------------------------------------------------------------
    @staticmethod
    def gi_handle(gpu: FakeGpu, gi: int) -> int:
        return _GI_BASE + gpu.index * _GPU_SPAN + gi * 0x10

    @staticmethod
    def ci_handle(gpu: FakeGpu, gi: int, ci: int) -> int:
        return _CI_BASE + gpu.index * _GPU_SPAN + gi * 0x10 + ci + 1

    def _gpu_by_index(self, index: int) -> FakeGpu:
        for gpu in self.gpus:
            if gpu.index == index:
                if gpu.lost:
                    raise self._fail("NVML_ERROR_GPU_IS_LOST")
                return gpu
        raise self._fail("NVML_ERROR_INVALID_ARGUMENT")

    def _gi(self, handle: int | None) -> tuple[FakeGpu, dict]:
        """A created GPU instance (static ones are not managed through this library)."""
        self._initialized()
        offset = (handle or 0) - _GI_BASE
        index, rest = divmod(offset, _GPU_SPAN)
        if offset < 0 or rest % 0x10 or index >= 1 << 16:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        gpu = self._gpu_by_index(index)
        for instance in self.instances(gpu):
            if instance["gi"] == rest // 0x10:
                return gpu, instance
        raise self._fail("NVML_ERROR_INVALID_ARGUMENT")

    def _ci(self, handle: int | None) -> tuple[FakeGpu, dict]:
        self._initialized()
        offset = (handle or 0) - _CI_BASE
        index, rest = divmod(offset, _GPU_SPAN)
        if offset < 0 or index >= 1 << 16:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        gpu = self._gpu_by_index(index)
        gi, ci = divmod(rest - 1, 0x10)
        for instance in self.created(gpu):
            if instance["gi"] == gi and instance.get("ci") == ci:
                return gpu, instance
        raise self._fail("NVML_ERROR_INVALID_ARGUMENT")

    def _slow(self, call: str) -> None:
        """A GPU that takes its time: <mock root>/nvml-delays.json maps a C function to
        seconds, so that a test can SIGKILL the driver while it waits in that call."""
        root = getattr(self.state, "root", None)
        if root is None:
            return
        try:
            delays = json.loads((root / "nvml-delays.json").read_text())
        except (OSError, ValueError):
            return
        seconds = delays.get(call) if isinstance(delays, dict) else None
        if isinstance(seconds, (int, float)) and seconds > 0:
            time.sleep(seconds)

    def _save(self, gpu: FakeGpu, instances: list[dict]) -> None:
        self.state.update(gpu.uuid, instances=tuple(instances))

    def _capability(self, gpu: FakeGpu, gi: int, ci: int | None, present: bool) -> None:
        """What the GPU driver does on a real node: /proc/driver/nvidia/capabilities/.../access
        for each GPU and compute instance, and the /dev/nvidia-caps node it names."""
        root = getattr(self.state, "root", None)
        if root is None:
            return
        base = root / "proc" / "driver" / "nvidia" / "capabilities" / f"gpu{gpu.minor}" / "mig" / f"gi{gi}"
        access = base / "access" if ci is None else base / f"ci{ci}" / "access"
        minor = 4096 + gpu.minor * 256 + gi * 16 + (0 if ci is None else ci + 1)
        node = root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}"
        if present:
            access.parent.mkdir(parents=True, exist_ok=True)
            access.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
            node.parent.mkdir(parents=True, exist_ok=True)
            try:  # a character device, as tree.py makes them, so a runtime can inject it
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            except FileExistsError:
                pass
            except OSError:
                node.touch()
        else:
            access.unlink(missing_ok=True)
            node.unlink(missing_ok=True)
            if access.parent != base:
                shutil.rmtree(access.parent, ignore_errors=True)
            elif ci is None:
                shutil.rmtree(base, ignore_errors=True)

    # -- MIG mode ---------------------------------------------------------------------------
    @export(c_void_p, c_uint, c_void_p)
    def _nvmlDeviceSetMigMode(self, handle: int, mode: int, activation: int) -> None:
        gpu = self._mig_gpu(handle)
        if mode not in (self.nv.NVML_DEVICE_MIG_DISABLE, self.nv.NVML_DEVICE_MIG_ENABLE):
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            current, _ = self.mig_modes(gpu)
            if mode != current and (gpu.migs or self.created(gpu) or self.loads.get(gpu.uuid).processes):
                raise self._fail("NVML_ERROR_IN_USE")
            if mode != current and gpu.mig_mode_needs_reset:
                self.state.update(gpu.uuid, pending_mig_mode=mode)
                self._put(c_uint, activation, self.nv.NVML_ERROR_RESET_REQUIRED)
                return
            self.state.update(gpu.uuid, mig_mode=mode, pending_mig_mode=None)
            if mode != current and gpu.uuid in self.rebind_at_mig_mode_change:
                self.rebind_at_mig_mode_change.discard(gpu.uuid)
                self.rebind(gpu)
            self._put(c_uint, activation, self.nv.NVML_SUCCESS)

    def rebind(self, gpu: FakeGpu) -> None:
        """What the NVIDIA driver may do at a MIG mode change: the GPU is bound anew, so
        its handles change and it may get another minor number (the next free one)."""
        self.bindings[gpu.index] = self.bindings.get(gpu.index, 0) + 1
        gpu.minor = 1 + max(g.minor for g in self.gpus)
        root = getattr(self.state, "root", None)
        if root is not None:
            node = root / "dev" / f"nvidia{gpu.minor}"
            node.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, gpu.minor))
            except FileExistsError:
                pass
            except OSError:
                node.touch()

    # -- GPU instances ---------------------------------------------------------------------------
    @export(c_void_p, c_uint, c_void_p)
    def _nvmlDeviceGetGpuInstanceProfileInfoV(self, handle: int, index: int, out: int) -> None:
        info = self.nv.c_nvmlGpuInstanceProfileInfo_v2_t.from_address(out)
        if info.version != self.nv.nvmlGpuInstanceProfileInfo_v2:
            raise self._fail("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        profile = self._gi_info(handle, index, info)
        info.name = f"MIG {profile.name}".encode()

    @export(c_void_p, c_uint, c_void_p)
    def _nvmlDeviceGetGpuInstanceProfileInfo(self, handle: int, index: int, out: int) -> None:
        """The v1 struct (older drivers): no version, no name."""
        self._gi_info(handle, index, self.nv.c_nvmlGpuInstanceProfileInfo_t.from_address(out))

    def _gi_info(self, handle: int, index: int, info: Any) -> GiProfile:
        gpu = self._mig_gpu(handle)
        profile = self._gi_profile(gpu, index)
        info.id = profile.id
        info.isP2pSupported = 0
        info.sliceCount = profile.compute_slices
        info.instanceCount = profile.max_instances
        info.multiprocessorCount = profile.multiprocessors
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpegs
        info.ofaCount = profile.ofas
        info.memorySizeMB = profile.memory_mib
        return profile

    def _profile_by_id(self, gpu: FakeGpu, profile_id: int) -> GiProfile:
        for profile in gpu.gi_profiles:
            if profile.id == profile_id:
                return profile
        raise self._fail("NVML_ERROR_INVALID_ARGUMENT")

    @export(c_void_p, c_uint, c_void_p, c_void_p)
    def _nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle: int, profile_id: int,
                                                       placements: int | None, count: int) -> None:
        gpu = self._mig_gpu(handle)
        profile = self._profile_by_id(gpu, profile_id)
        if not placements:  # NULL: the caller asks how many
            self._put(c_uint, count, len(profile.starts))
            return
        room = c_uint.from_address(count).value
        if room < len(profile.starts):
            self._put(c_uint, count, len(profile.starts))
            raise self._fail("NVML_ERROR_INSUFFICIENT_SIZE")
        size = ctypes.sizeof(self.nv.c_nvmlGpuInstancePlacement_t)
        for i, start in enumerate(profile.starts):
            placement = self.nv.c_nvmlGpuInstancePlacement_t.from_address(placements + i * size)
            placement.start, placement.size = start, profile.memory_slices
        self._put(c_uint, count, len(profile.starts))

    @export(c_void_p, c_uint, c_void_p, c_void_p)
    def _nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: int, profile_id: int,
                                                  placement: int | None, out: int) -> None:
        gpu = self._mig_gpu(handle)
        self._enabled(gpu)
        profile = self._profile_by_id(gpu, profile_id)
        if not placement:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        wanted = self.nv.c_nvmlGpuInstancePlacement_t.from_address(placement)
        if wanted.start not in profile.starts or wanted.size != profile.memory_slices:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        slices = set(range(wanted.start, wanted.start + wanted.size))
        with self._lock:
            used = self._occupied(gpu)
            if any(slices & taken for _, taken in used):
                raise self._fail("NVML_ERROR_INSUFFICIENT_RESOURCES")
            # A +me profile has seven placements but one set of media engines to give.
            same = sum(1 for i in self.instances(gpu) if i["profile"] == profile.index)
            if same >= profile.max_instances:
                raise self._fail("NVML_ERROR_INSUFFICIENT_RESOURCES")
            gi = 1 + max((g for g, _ in used), default=0)
            instances = self.created(gpu)
            instances.append({"gi": gi, "profile": profile.index, "start": wanted.start,
                              "ci": None, "ci_profile": None})
            self._save(gpu, instances)
            self._capability(gpu, gi, None, True)
        self._put(c_void_p, out, self.gi_handle(gpu, gi))

    @export(c_void_p)
    def _nvmlGpuInstanceDestroy(self, handle: int) -> None:
        gpu, instance = self._gi(handle)
        if instance.get("static"):
            raise self._fail("NVML_ERROR_NO_PERMISSION")
        with self._lock:
            if instance.get("ci") is not None:
                raise self._fail("NVML_ERROR_IN_USE")
            self._save(gpu, [i for i in self.created(gpu) if i["gi"] != instance["gi"]])
            self._capability(gpu, instance["gi"], None, False)

    @export(c_void_p, c_uint, c_void_p, c_void_p)
    def _nvmlDeviceGetGpuInstances(self, handle: int, profile_id: int, out: int, count: int) -> None:
        gpu = self._mig_gpu(handle)
        self._enabled(gpu)
        profile = self._profile_by_id(gpu, profile_id)
        found = [i["gi"] for i in self.instances(gpu) if i["profile"] == profile.index]
        room = c_uint.from_address(count).value
        if room < len(found):
            self._put(c_uint, count, len(found))
            raise self._fail("NVML_ERROR_INSUFFICIENT_SIZE")
        size = ctypes.sizeof(c_void_p)
        for k, gi in enumerate(found):
            self._put(c_void_p, out + k * size, self.gi_handle(gpu, gi))
        self._put(c_uint, count, len(found))

    @export(c_void_p, c_uint, c_void_p)
    def _nvmlDeviceGetGpuInstanceById(self, handle: int, gi: int, out: int) -> None:
        gpu = self._mig_gpu(handle)
        self._enabled(gpu)
        if not any(i["gi"] == gi for i in self.instances(gpu)):
            raise self._fail("NVML_ERROR_NOT_FOUND")
        self._put(c_void_p, out, self.gi_handle(gpu, gi))

    @export(c_void_p, c_void_p)
    def _nvmlGpuInstanceGetInfo(self, handle: int, out: int) -> None:
        gpu, instance = self._gi(handle)
        info = self.nv.c_nvmlGpuInstanceInfo_t.from_address(out)
        profile = self._gi_profile(gpu, instance["profile"])
        c_void_p.from_address(ctypes.addressof(info)).value = self._handle_address(gpu.index)
        info.id = instance["gi"]
        info.profileId = profile.id
        info.placement.start, info.placement.size = instance["start"], profile.memory_slices

    # -- compute instances -----------------------------------------------------------------------
    def _ci_profiles(self, gpu: FakeGpu, instance: dict) -> dict[int, int]:
        """CI profile index -> compute slices, the ones this GPU instance can hold."""
        slices = self._gi_profile(gpu, instance["profile"]).compute_slices
        return {index: n for index, n in CI_SLICES.items() if n <= slices}

    @export(c_void_p, c_uint, c_uint, c_void_p)
    def _nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, handle: int, index: int,
                                                       engines: int, out: int) -> None:
        info = self.nv.c_nvmlComputeInstanceProfileInfo_v2_t.from_address(out)
        if info.version != self.nv.nvmlComputeInstanceProfileInfo_v2:
            raise self._fail("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        slices, gi_profile = self._ci_info(handle, index, engines, info)
        info.name = f"MIG {slices}c.{gi_profile.name}".encode()

    @export(c_void_p, c_uint, c_uint, c_void_p)
    def _nvmlGpuInstanceGetComputeInstanceProfileInfo(self, handle: int, index: int,
                                                      engines: int, out: int) -> None:
        self._ci_info(handle, index, engines,
                      self.nv.c_nvmlComputeInstanceProfileInfo_t.from_address(out))

    def _ci_info(self, handle: int, index: int, engines: int, info: Any) -> tuple[int, GiProfile]:
        gpu, instance = self._gi(handle)
        profiles = self._ci_profiles(gpu, instance)
        if index not in profiles or engines != self.nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        gi_profile = self._gi_profile(gpu, instance["profile"])
        slices = profiles[index]
        info.id = index
        info.sliceCount = slices
        info.instanceCount = gi_profile.compute_slices // slices
        info.multiprocessorCount = gi_profile.multiprocessors * slices // gi_profile.compute_slices
        info.sharedCopyEngineCount = gi_profile.copy_engines
        info.sharedDecoderCount = gi_profile.decoders
        info.sharedEncoderCount = gi_profile.encoders
        info.sharedJpegCount = gi_profile.jpegs
        info.sharedOfaCount = gi_profile.ofas
        return slices, gi_profile

    @export(c_void_p, c_uint, c_void_p)
    def _nvmlGpuInstanceCreateComputeInstance(self, handle: int, profile_id: int, out: int) -> None:
        self._slow("nvmlGpuInstanceCreateComputeInstance")
        gpu, instance = self._gi(handle)
        if instance.get("static"):
            raise self._fail("NVML_ERROR_INSUFFICIENT_RESOURCES")  # its compute instance exists
        if profile_id not in self._ci_profiles(gpu, instance):
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            # One compute instance per GPU instance is all the driver creates; a second
            # finds the slices taken, as NVML reports when they are.
            if instance.get("ci") is not None:
                raise self._fail("NVML_ERROR_INSUFFICIENT_RESOURCES")
            instances = self.created(gpu)
            for i in instances:
                if i["gi"] == instance["gi"]:
                    i["ci"], i["ci_profile"] = 0, profile_id
            self._save(gpu, instances)
            self._capability(gpu, instance["gi"], 0, True)
        self._put(c_void_p, out, self.ci_handle(gpu, instance["gi"], 0))

    @export(c_void_p)
    def _nvmlComputeInstanceDestroy(self, handle: int) -> None:
        gpu, instance = self._ci(handle)
        with self._lock:
            instances = self.created(gpu)
            for i in instances:
                if i["gi"] == instance["gi"]:
                    i["ci"], i["ci_profile"] = None, None
            self._save(gpu, instances)
            self._capability(gpu, instance["gi"], instance["ci"], False)

    @export(c_void_p, c_uint, c_void_p, c_void_p)
    def _nvmlGpuInstanceGetComputeInstances(self, handle: int, profile_id: int, out: int,
                                            count: int) -> None:
        gpu, instance = self._gi(handle)
        found = [instance["ci"]] if instance.get("ci") is not None and \
            instance["ci_profile"] == profile_id else []
        room = c_uint.from_address(count).value
        if room < len(found):
            self._put(c_uint, count, len(found))
            raise self._fail("NVML_ERROR_INSUFFICIENT_SIZE")
        for k, ci in enumerate(found):
            self._put(c_void_p, out + k * ctypes.sizeof(c_void_p), self.ci_handle(gpu, instance["gi"], ci))
        self._put(c_uint, count, len(found))
