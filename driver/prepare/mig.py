"""Dynamic MIG at prepare: create the allocated partition, destroy it when no claim holds it.

The published device (driver/devices/migdynamic.py) names a GPU, a GPU instance profile
and a placement. Prepare creates, through NVML, the GPU instance at that placement and then
the compute instance whose slice count matches it (the full-size one: asking for a compute
instance profile by the GPU instance's profile id is the mistake NVIDIA's driver made for
7g.40gb), enabling MIG mode first where the GPU allows it without a reset. The container
gets the created MIG device: its UUID and its /dev/nvidia-caps nodes.

Records in <state-dir>/mig/<device>.json are written before each NVML call that creates
something and updated after it, so a crash at any point leaves a record that names what may
exist; a failure between the two calls destroys the GPU instance again. Who needs which
partition comes from the claim records; what no claim holds is destroyed (at unprepare,
and at start and periodically for what a crash left). Instances without a record are not
ours and are never touched.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import structlog

from driver import atomic
from driver.checkpoint import ClaimRecord, State
from driver.devices.model import Device, DeviceKind, Inventory
from driver.devices import migdynamic
from driver.devices.nvml import NvmlDiscovery, mig_handles
from driver.instance import Instance
from driver.prepare.records import RecordStore

FORMAT_VERSION = 1


class MigError(Exception):
    """A partition could not be created or destroyed; the message names it and the call."""


@dataclass(frozen=True)
class MigRecord:
    device: str  # the published partition, gpu-<pci>-mig-<profile>-<start>
    gpu_uuid: str
    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_*
    start: int
    size: int
    boot_id: str
    gpu_instance: int | None = None  # set once created
    compute_instance: int | None = None

    def to_json(self) -> bytes:
        return json.dumps({"version": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: Path) -> "MigRecord":
        try:
            data = json.loads(raw)
            if data.pop("version", None) != FORMAT_VERSION:
                raise MigError(f"{source}: unknown format")
            return cls(**data)
        except MigError:
            raise
        except (ValueError, TypeError) as err:
            raise MigError(f"{source}: corrupt MIG record: {err}") from err


class MigRecords(RecordStore[MigRecord]):
    """<state-dir>/mig: the partitions this driver created or is creating."""

    def __init__(self, state_dir: Path, instance: Instance) -> None:
        super().__init__(state_dir / "mig", instance, MigRecord.from_json, MigError)

    def all(self) -> list[MigRecord]:
        # An unreadable record is kept for a human; its instance is left alone.
        return [r for r in self.all_or_errors() if isinstance(r, MigRecord)]

    def owned(self) -> set[tuple[str, int]]:
        """(GPU UUID, GPU instance id) of the instances this driver created."""
        return {(r.gpu_uuid, r.gpu_instance) for r in self.all() if r.gpu_instance is not None}


def is_partition(device: Device) -> bool:
    return device.kind is DeviceKind.MIG and bool(device.consumes)


class MigPartitions:
    def __init__(self, records: MigRecords, nvml: Any, sysfs: Path, proc: Path, boot_id: str,
                 inventory: Callable[[], Inventory]) -> None:
        self.records = records
        self.nvml = nvml
        self.discovery = NvmlDiscovery(nvml, sysfs, proc)  # for the capability nodes
        self.boot_id = boot_id
        self.inventory = inventory
        self.log = structlog.get_logger(component="mig")

    def recorded(self) -> bool:
        """Whether any partition has a record (a directory listing)."""
        return bool(self.records.devices())

    # -- NVML plumbing ------------------------------------------------------------------------
    def _session(self):
        nv = self.nvml
        if nv is None:
            raise MigError("NVML is not available on this node")
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            raise MigError(f"NVML cannot be initialized: {err}") from err
        return nv

    def _parent(self, nv: Any, uuid: str) -> Any:
        return nv.nvmlDeviceGetHandleByUUID(uuid)

    # -- create ---------------------------------------------------------------------------------
    def ensure(self, claim: str, device: Device) -> Device:
        """The partition exists (created now, or by an earlier prepare of this claim):
        the device as the container gets it."""
        record = self.records.get(device.name)
        if record is not None and record.boot_id != self.boot_id:
            self.records.remove(device.name)  # a reboot destroyed it
            record = None
        nv = self._session()
        try:
            if record is not None and record.compute_instance is not None:
                found = self._find(nv, record)
                if found is not None:
                    return self._concrete(nv, device, record, found)
            if record is not None:  # half made before a crash: start over
                self._destroy(nv, record)
            return self._create(nv, claim, device)
        except nv.NVMLError as err:
            raise MigError(f"claim {claim}: MIG partition {device.name}: {err}") from err
        finally:
            nv.nvmlShutdown()

    def _create(self, nv: Any, claim: str, device: Device) -> Device:
        attrs = device.attributes
        uuid = str(attrs["parentUUID"])
        profile_name = str(attrs["profile"])
        parent = self._parent(nv, uuid)
        found = [(i, info) for i, info, name in migdynamic.profile_infos(nv, parent)
                 if name == profile_name]
        if not found:
            raise MigError(f"claim {claim}: MIG partition {device.name}: its GPU has no MIG "
                           f"profile {profile_name!r}")
        (index, info), = found
        record = MigRecord(device.name, uuid, index, int(attrs["placementStart"]),
                           int(attrs["placementSize"]), self.boot_id)
        self.records.put(record)  # before anything exists: a crash leaves a record to clean
        self._enable_mig(nv, parent, claim, device)
        placement = nv.c_nvmlGpuInstancePlacement_t(record.start, record.size)
        try:
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(parent, info.id, ctypes.byref(placement))
        except nv.NVMLError_InsufficientResources as err:
            self.records.remove(device.name)
            raise MigError(f"claim {claim}: MIG partition {device.name}: memory slices "
                           f"{record.start}-{record.start + record.size - 1} of GPU {uuid} are "
                           f"taken (by an instance this driver did not create?): {err}") from err
        except nv.NVMLError:
            self.records.remove(device.name)
            raise
        gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
        record = dataclasses.replace(record, gpu_instance=gi_id)
        self.records.put(record)
        try:
            ci_profile = self._full_ci_profile(nv, gi, info.sliceCount)
            nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
        except nv.NVMLError as err:
            # Roll back: a GPU instance without its compute instance is of no use to anyone.
            nv.nvmlGpuInstanceDestroy(gi)
            self.records.remove(device.name)
            raise MigError(f"claim {claim}: MIG partition {device.name}: compute instance: "
                           f"{err}; the GPU instance was destroyed again") from err
        found = self._find(nv, dataclasses.replace(record, compute_instance=0))
        if found is None:
            raise MigError(f"claim {claim}: MIG partition {device.name}: created, but NVML "
                           "does not list it as a MIG device")
        record = dataclasses.replace(record, compute_instance=nv.nvmlDeviceGetComputeInstanceId(found))
        self.records.put(record)
        self.log.info("mig_partition_created", device=device.name, claim=claim,
                      gpu_instance=gi_id, compute_instance=record.compute_instance)
        return self._concrete(nv, device, record, found)

    def _full_ci_profile(self, nv: Any, gi: Any, slices: int) -> int:
        """The compute instance profile that spans the whole GPU instance."""
        for index in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue
            if info.sliceCount == slices:
                return info.id
        raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)

    def _enable_mig(self, nv: Any, parent: Any, claim: str, device: Device) -> None:
        current, _ = nv.nvmlDeviceGetMigMode(parent)
        if current == nv.NVML_DEVICE_MIG_ENABLE:
            return
        # Recorded first: the MIG mode goes back to off once no partition is left.
        atomic.write(self._enabled_marker(str(device.attributes["parentUUID"])), b"enabled\n",
                     mode=0o600, owner=self.records.instance.token)
        status = nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_ENABLE)
        if status != nv.NVML_SUCCESS or nv.nvmlDeviceGetMigMode(parent)[0] != nv.NVML_DEVICE_MIG_ENABLE:
            self.records.remove(device.name)
            raise MigError(f"claim {claim}: MIG partition {device.name}: enabling MIG mode on "
                           "its GPU needs a GPU reset; enable it beforehand (nvidia-smi -mig 1)")
        self.log.info("mig_mode_enabled", gpu=device.attributes.get("parentUUID"))

    def _enabled_marker(self, gpu_uuid: str) -> Path:
        """Marks a GPU whose MIG mode this driver turned on (not a *.json record)."""
        return self.records.directory / f"mig-mode-enabled-{gpu_uuid}"

    def _restore_mig_mode(self, nv: Any, gpu_uuid: str) -> None:
        """Turn MIG off again where we turned it on and no instance is left, so that the
        whole GPU is offered again."""
        marker = self._enabled_marker(gpu_uuid)
        if not marker.exists():
            return
        parent = self._parent(nv, gpu_uuid)
        if any(True for _ in mig_handles(nv, parent)):
            return  # an instance (ours or anyone's) is still there
        nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_DISABLE)
        atomic.remove(marker)
        self.log.info("mig_mode_disabled", gpu=gpu_uuid)

    def _find(self, nv: Any, record: MigRecord) -> Any | None:
        """The MIG device handle of the record's instance, if it exists."""
        parent = self._parent(nv, record.gpu_uuid)
        for _, handle in mig_handles(nv, parent):
            if nv.nvmlDeviceGetGpuInstanceId(handle) == record.gpu_instance:
                return handle
        return None

    def _concrete(self, nv: Any, device: Device, record: MigRecord, handle: Any) -> Device:
        minor = int(device.attributes["parentMinor"])
        ci = nv.nvmlDeviceGetComputeInstanceId(handle)
        caps = self.discovery._mig_caps(minor, record.gpu_instance, ci)
        uuid = nv.nvmlDeviceGetUUID(handle)
        attributes = {**device.attributes, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                      "gpuInstanceID": record.gpu_instance, "computeInstanceID": ci}
        return dataclasses.replace(device, attributes=attributes,
                                   device_nodes=(f"/dev/nvidia{minor}", *caps))

    # -- destroy --------------------------------------------------------------------------------
    def _destroy(self, nv: Any, record: MigRecord) -> None:
        if record.gpu_instance is not None and record.boot_id == self.boot_id:
            parent = self._parent(nv, record.gpu_uuid)
            try:
                gi = nv.nvmlDeviceGetGpuInstanceById(parent, record.gpu_instance)
            except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument, nv.NVMLError_InvalidState):
                gi = None
            if gi is not None:
                for index in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                    array = (nv.c_nvmlComputeInstance_t * 8)()
                    count = ctypes.c_uint(8)
                    try:
                        nv.nvmlGpuInstanceGetComputeInstances(gi, index, array, ctypes.byref(count))
                    except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                        continue
                    for k in range(count.value):
                        nv.nvmlComputeInstanceDestroy(array[k])
                nv.nvmlGpuInstanceDestroy(gi)
        self.records.remove(record.device)
        self.log.info("mig_partition_destroyed", device=record.device, gpu_instance=record.gpu_instance)

    def release_unneeded(self, records: Iterable[ClaimRecord]) -> list[str]:
        """Destroy every recorded partition no prepared claim holds; the errors."""
        recorded = self.records.all()
        if not recorded:
            return []
        held = {d.device for r in records if r.state is State.PREPARE_COMPLETED for d in r.devices}
        errors = []
        unneeded = [r for r in recorded if r.device not in held]
        if not unneeded:
            return []
        try:
            nv = self._session()
        except MigError as err:
            return [f"MIG partitions {', '.join(r.device for r in unneeded)}: cannot destroy "
                    f"them: {err}"]
        try:
            for record in unneeded:
                try:
                    self._destroy(nv, record)
                except nv.NVMLError as err:
                    errors.append(f"MIG partition {record.device}: cannot destroy it: {err}")
            for gpu_uuid in sorted({r.gpu_uuid for r in unneeded}):
                try:
                    self._restore_mig_mode(nv, gpu_uuid)
                except nv.NVMLError as err:
                    errors.append(f"GPU {gpu_uuid}: cannot turn MIG mode off again: {err}")
        finally:
            nv.nvmlShutdown()
        return errors
