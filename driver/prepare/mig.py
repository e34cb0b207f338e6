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

MIG mode is turned on the same way: a marker (mig-mode-enabled-<GPU UUID>) is written
before nvmlDeviceSetMigMode, so that the mode goes back to off once no partition is left.
A change that fails (IN_USE: processes or instances on the GPU) or only becomes pending
(a reset is needed) is undone at once, and the marker with it; whatever a crash or a
failed undo left is reconciled with the other records: a marker whose GPU has no record is
undone (a pending enable cancelled, MIG mode turned off again where no instance is left)
or, where the mode is off, dropped. NVML may rebind a GPU at a mode change (another handle,
perhaps another minor number): handles are asked for again after each change, the minor
the container gets is NVML's of now, and a changed minor makes the node rediscover, so that
the published `parentMinor` follows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import structlog

from driver.state import atomic
from driver.state.checkpoint import ClaimRecord, State
from driver.devices.model import Device, DeviceKind, Inventory
from driver.devices import migdynamic
from driver.devices.nvml import NvmlDiscovery, mig_handles
from driver.state.instance import Instance
from driver.prepare.records import RecordStore

FORMAT_VERSION = 1
_MARKER = "mig-mode-enabled-"  # + GPU UUID: this driver turned the GPU's MIG mode on


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
                 inventory: Callable[[], Inventory],
                 claims: Callable[[], Iterable[ClaimRecord]] = lambda: (),
                 rediscover: Callable[[], None] = lambda: None) -> None:
        self.records = records
        self.nvml = nvml
        self.discovery = NvmlDiscovery(nvml, sysfs, proc)  # for the capability nodes
        self.boot_id = boot_id
        self.inventory = inventory
        # The prepared claims (to name those holding a GPU whose MIG mode cannot change).
        self.claims = claims
        # Called when a GPU's minor number changed (a rebind at a MIG mode change) or its
        # MIG mode did: the published devices must follow.
        self.rediscover = rediscover
        self.log = structlog.get_logger(component="mig")

    def recorded(self) -> bool:
        """Whether any partition has a record, or a GPU a MIG mode marker (a listing)."""
        return bool(self.records.devices()) or bool(self._markers())

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
        parent = self._enable_mig(nv, parent, claim, device)
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

    def _enable_mig(self, nv: Any, parent: Any, claim: str, device: Device) -> Any:
        """MIG mode on, where it is off: the GPU's handle afterwards (NVML may rebind the
        device at a mode change, and the old handle is then no longer valid)."""
        uuid = str(device.attributes["parentUUID"])
        current, _ = nv.nvmlDeviceGetMigMode(parent)
        if current == nv.NVML_DEVICE_MIG_ENABLE:
            return parent
        # Recorded first: the MIG mode goes back to off once no partition is left, and a
        # crash before the undo below leaves something to reconcile.
        atomic.write(self._enabled_marker(uuid), b"enabled\n",
                     mode=0o600, owner=self.records.instance.token)
        where = f"claim {claim}: MIG partition {device.name}: cannot enable MIG mode on GPU {uuid}"
        try:
            status = nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_ENABLE)
        except nv.NVMLError as err:
            self.records.remove(device.name)
            undo = self._undo_mode_change(nv, uuid, changed=False)
            if isinstance(err, nv.NVMLError_InUse):
                raise MigError(f"{where}: NVML says the GPU is in use ({self._users(nv, parent, uuid)})"
                               f"{undo}") from err
            raise MigError(f"{where}: NVML: {err}{undo}") from err
        parent = self._parent(nv, uuid)  # asked again: the old handle may be gone
        current, pending = nv.nvmlDeviceGetMigMode(parent)
        if status != nv.NVML_SUCCESS or current != nv.NVML_DEVICE_MIG_ENABLE:
            self.records.remove(device.name)
            undo = self._undo_mode_change(nv, uuid, changed=True)
            said = nv.nvmlErrorString(status) if status != nv.NVML_SUCCESS else "MIG mode pending"
            if isinstance(said, bytes):
                said = said.decode(errors="replace")
            raise MigError(f"{where}: the change takes effect only after a GPU reset (NVML: {said}); "
                           f"enable MIG mode beforehand (nvidia-smi -i {uuid} -mig 1, then reset the GPU)"
                           f"{undo}")
        self.log.info("mig_mode_enabled", gpu=uuid, claim=claim)
        self._minor_changed(nv, parent, device)
        return parent

    def _users(self, nv: Any, parent: Any, uuid: str) -> str:
        """Who uses a GPU, as far as NVML and our claim records tell."""
        found = []
        try:
            pids = sorted({p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(parent)})
        except nv.NVMLError:
            pids = None
        if pids:
            found.append(f"processes {', '.join(map(str, pids))}")
        claims = self._claims_on(uuid)
        if claims:
            found.append(f"prepared claims {', '.join(claims)}")
        if any(True for _ in mig_handles(nv, parent)):
            found.append("MIG instances")
        if not found:
            found.append("no process or claim known to this driver" if pids is not None
                         else "its processes cannot be listed")
        return "; ".join(found)

    def _claims_on(self, uuid: str) -> list[str]:
        """Prepared claims holding the GPU or anything on it."""
        names = {d.name for d in self.inventory().devices
                 if uuid in (d.attributes.get("uuid"), d.attributes.get("parentUUID"))}
        return sorted({f"{r.namespace}/{r.name}" for r in self.claims()
                       if r.state is State.PREPARE_COMPLETED and any(d.device in names for d in r.devices)})

    def _undo_mode_change(self, nv: Any, uuid: str, changed: bool) -> str:
        """After a failed enable: MIG mode as it was, and the marker gone with it. A call
        NVML refused changed nothing; one that left the enable pending is cancelled. Only
        what this call did is undone: a mode someone else set meanwhile stays. An undo that
        fails leaves the marker, for the reconcile; the text says so."""
        try:
            if changed:
                parent = self._parent(nv, uuid)
                current, pending = nv.nvmlDeviceGetMigMode(parent)
                if pending == nv.NVML_DEVICE_MIG_ENABLE and current != nv.NVML_DEVICE_MIG_ENABLE:
                    nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_DISABLE)
                    self.log.info("mig_mode_pending_enable_cancelled", gpu=uuid)
            atomic.remove(self._enabled_marker(uuid))
        except nv.NVMLError as err:
            self.log.warning("mig_mode_undo_failed", gpu=uuid, error=str(err))
            return f"; undoing it failed ({err}), the periodic reconcile tries again"
        return ""

    def _minor_changed(self, nv: Any, parent: Any, device: Device) -> None:
        minor = nv.nvmlDeviceGetMinorNumber(parent)
        published = device.attributes.get("parentMinor")
        if published is not None and int(published) != minor:
            self.log.info("gpu_rebound", gpu=device.attributes.get("parentUUID"),
                          minor=minor, published_minor=published)
        self.rediscover()  # the mode changed (and perhaps the minor): publish what is now

    def _enabled_marker(self, gpu_uuid: str) -> Path:
        """Marks a GPU whose MIG mode this driver turned on (not a *.json record)."""
        return self.records.directory / f"{_MARKER}{gpu_uuid}"

    def _markers(self) -> set[str]:
        """GPU UUIDs with a MIG mode marker."""
        try:
            return {p.name.removeprefix(_MARKER) for p in self.records.directory.glob(f"{_MARKER}*")}
        except OSError:
            return set()

    def _restore_mig_mode(self, nv: Any, gpu_uuid: str) -> None:
        """Turn MIG off again where we turned it on and no instance is left, so that the
        whole GPU is offered again."""
        if self._enabled_marker(gpu_uuid).exists():
            self._reconcile_marker(nv, gpu_uuid)

    def _reconcile_marker(self, nv: Any, gpu_uuid: str) -> None:
        """What a marker says we changed, undone where nothing needs it: a pending enable
        cancelled, an enabled mode turned off where no instance (ours or anyone's) is left;
        a mode that is off needs nothing, and the marker goes."""
        marker = self._enabled_marker(gpu_uuid)
        try:
            parent = self._parent(nv, gpu_uuid)
        except nv.NVMLError_NotFound:
            atomic.remove(marker)  # the GPU is gone from the node: nothing to restore
            self.log.info("mig_mode_marker_dropped", gpu=gpu_uuid, reason="GPU not found")
            return
        current, pending = nv.nvmlDeviceGetMigMode(parent)
        if current == nv.NVML_DEVICE_MIG_ENABLE:
            if any(True for _ in mig_handles(nv, parent)):
                return  # an instance (ours or anyone's) is still there
            try:
                nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_DISABLE)
            except nv.NVMLError_InUse:
                return  # a GPU instance without a MIG device yet, or a process: later
            atomic.remove(marker)
            self.log.info("mig_mode_disabled", gpu=gpu_uuid)
            parent = self._parent(nv, gpu_uuid)  # the change may have rebound the GPU
            self.rediscover()
            return
        if pending == nv.NVML_DEVICE_MIG_ENABLE:
            nv.nvmlDeviceSetMigMode(parent, nv.NVML_DEVICE_MIG_DISABLE)  # cancels the pending enable
            self.log.info("mig_mode_pending_enable_cancelled", gpu=gpu_uuid)
        atomic.remove(marker)

    def _find(self, nv: Any, record: MigRecord) -> Any | None:
        """The MIG device handle of the record's instance, if it exists."""
        parent = self._parent(nv, record.gpu_uuid)
        for _, handle in mig_handles(nv, parent):
            if nv.nvmlDeviceGetGpuInstanceId(handle) == record.gpu_instance:
                return handle
        return None

    def _concrete(self, nv: Any, device: Device, record: MigRecord, handle: Any) -> Device:
        # The GPU's minor number now: a rebind at a MIG mode change may have changed the
        # one published (rediscovery then publishes the new one).
        minor = nv.nvmlDeviceGetMinorNumber(self._parent(nv, record.gpu_uuid))
        ci = nv.nvmlDeviceGetComputeInstanceId(handle)
        caps = self.discovery._mig_caps(minor, record.gpu_instance, ci)
        uuid = nv.nvmlDeviceGetUUID(handle)
        attributes = {**device.attributes, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                      "gpuInstanceID": record.gpu_instance, "computeInstanceID": ci,
                      "parentMinor": minor}
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
        """Destroy every recorded partition no prepared claim holds, and undo MIG mode
        changes no record explains (a failed enable, a crash before its undo); the errors."""
        recorded = self.records.all()
        markers = self._markers()
        held = {d.device for r in records if r.state is State.PREPARE_COMPLETED for d in r.devices}
        errors = []
        unneeded = [r for r in recorded if r.device not in held]
        # A marker whose GPU has a record belongs to that record (a prepare writes the
        # record first, then the marker): its GPU is looked at when the record goes.
        orphaned = markers - {r.gpu_uuid for r in recorded}
        if not unneeded and not orphaned:
            return []
        try:
            nv = self._session()
        except MigError as err:
            what = ", ".join([r.device for r in unneeded] + [f"MIG mode of GPU {u}" for u in sorted(orphaned)])
            return [f"{what}: cannot undo: {err}"]
        try:
            for record in unneeded:
                try:
                    self._destroy(nv, record)
                except nv.NVMLError as err:
                    errors.append(f"MIG partition {record.device}: cannot destroy it: {err}")
            for gpu_uuid in sorted({r.gpu_uuid for r in unneeded} | orphaned):
                try:
                    self._restore_mig_mode(nv, gpu_uuid)
                except nv.NVMLError as err:
                    errors.append(f"GPU {gpu_uuid}: cannot turn MIG mode off again: {err}")
        finally:
            nv.nvmlShutdown()
        return errors
