"""NodePrepareResources / NodeUnprepareResources: allocated claim -> CDI devices.

Per claim, in order:
  GET the claim (outside every lock: the API server is the slow part), check its UID and
  allocation, pick this driver's results for this node's pool, resolve the devices and
  decode the configs. Then, holding the claim's lock and the cross-process lock (the
  other driver pod of an upgrade shares our directories), change local state only:
    checkpoint has the same allocation, same boot, spec present -> same answer, no write
    same allocation but rebooted or spec gone                   -> spec rebuilt
    no record, or the claim was reallocated under the same UID  -> exclusivity check
                                                                   against other claims,
                                                                   spec, PrepareCompleted
Claims that share a GPU (time-slicing, MPS, consumable shares) or take a dynamic MIG
partition also get their device set up, before the spec that relies on it is written
(driver/prepare/sharing.py, driver/prepare/mig.py), on a pool thread; all other claims
make their local change on one committer thread, in groups whose records are made
durable together (driver/prepare/committer.py, docs/crash-safety.md).
A record alone is never trusted: a claim can be deallocated and allocated anew (other
devices) while keeping its UID, and the kubelet would then get yesterday's devices.
The spec's file name is derived from the claim UID, so a crash between the two writes
leaves a spec that the retried Prepare overwrites or Unprepare removes without needing a
record; a record only ever describes a spec that was fully written. (An earlier design
wrote a PrepareStarted record first: it cost two fsyncs per prepare and bought nothing
the deterministic name does not; such records are still read as "not prepared".)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

from driver.prepare import cdi, edits, opaque

from driver.kube import quantity
from driver.prepare.cdi import CdiDevice, CdiWriter
from driver.state.checkpoint import Checkpoint, CheckpointError, ClaimRecord, PreparedDevice, State
from driver.prepare.claimstatus import DeviceStatus, StatusWriter
from driver.prepare.claims import Allocation, ClaimError, ClaimReader, ClaimRef, allocation_for
from driver.devices.model import Device, Inventory
from driver.state.locks import KeyedLocks, ProcessLock
from driver.prepare import status as claim_status
from driver.prepare.committer import GroupCommitter
from driver.prepare.metadata import MetadataFiles, discard, pod_claim_name
from driver.prepare.fpgaprogram import FpgaProgramError, FpgaPrograms
from driver.prepare.mig import MigError, MigPartitions, is_partition
from driver.prepare.mps import MpsError, MpsStarting
from driver.prepare.mpsusers import MpsUsers
from driver.prepare.sharing import DeviceSharing, Use, use_of


@dataclass(frozen=True)
class PrepareOutcome:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    # What the claim's status.devices says of them (driver/prepare/status.py).
    status: tuple[DeviceStatus, ...] = ()


def cdi_name(claim_uid: str, device: str, share_id: str | None) -> str:
    """Unique per claim, device and share: one claim may hold two shares of one GPU."""
    return f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")


def base_request(request: str) -> str:
    """`gpu/h100` (a firstAvailable subrequest) -> `gpu`: what the pod's containers name."""
    return request.split("/", 1)[0]


class Preparer:
    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        inventory: Callable[[], Inventory],
        claims: ClaimReader,
        cdi_writer: CdiWriter,
        checkpoint: Checkpoint,
        boot_id: str,
        dev_root: Path,
        process_lock: ProcessLock,
        driver_mounts: Callable[[], tuple[cdi.Mount, ...]] = lambda: (),
        sharing: DeviceSharing | None = None,
        mig: MigPartitions | None = None,
        fpga: FpgaPrograms | None = None,  # FpgaConfig.function: programmed at prepare
        status: StatusWriter | None = None,
        addresses: claim_status.Addresses = claim_status.no_addresses,
        metadata: MetadataFiles | None = None,
        cdi_net_devices: bool = True,  # False: the NRI plugin moves NICs (driver/nri/)
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.inventory = inventory
        self.claims = claims
        self.cdi = cdi_writer
        self.checkpoint = checkpoint
        self.boot_id = boot_id
        self.dev_root = dev_root
        self.cdi_net_devices = cdi_net_devices
        self.process_lock = process_lock
        self.driver_mounts = driver_mounts
        self.sharing = sharing
        self.mig = mig
        self.fpga = fpga
        self.status = status
        self.addresses = addresses
        self.metadata = metadata
        self._sharing_lock = threading.RLock()
        self.locks = KeyedLocks()
        self.committer = GroupCommitter(checkpoint)
        self.log = structlog.get_logger(component="prepare")

    # -- entry points --------------------------------------------------------------------
    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareOutcome]:
        return await self._each(refs, self._prepare_one, PrepareOutcome)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        return await self._each(refs, self._unprepare_one, lambda error="": error)

    async def _each(self, refs, operation, failed):
        counts: dict[str, int] = {}
        for ref in refs:
            counts[ref.uid] = counts.get(ref.uid, 0) + 1
        results = {}
        tasks = {}
        for ref in refs:
            if counts[ref.uid] > 1:
                results[ref.uid] = failed(error=f"claim {ref} (UID {ref.uid}) appears "
                                                f"{counts[ref.uid]} times in one request")
            elif ref.uid not in tasks:
                tasks[ref.uid] = asyncio.create_task(self._guarded(ref, operation, failed))
        for uid, task in tasks.items():
            results[uid] = await task
        return results

    async def _guarded(self, ref: ClaimRef, operation, failed):
        log = self.log.bind(claim_uid=ref.uid, claim_namespace=ref.namespace, claim_name=ref.name)
        try:
            ref.check()
            if self.status is None:
                return await operation(ref, log)
            with self.status.in_hand():  # its status write waits for the burst to end
                return await operation(ref, log)
        except (ClaimError, CheckpointError, cdi.CdiError, edits.EditsError) as err:
            log.warning("claim_failed", operation=operation.__name__.strip("_").removesuffix("_one"),
                        error=str(err))
            return failed(error=str(err))
        except OSError as err:
            log.error("claim_io_error", error=str(err))
            return failed(error=f"claim {ref}: {err}")
        except Exception as err:  # a bug must fail this claim, not the whole request
            log.exception("claim_internal_error")
            return failed(error=f"claim {ref}: internal error: {err!r}")

    async def _local(self, ref: ClaimRef, change, *args, grouped: bool = False):
        """Run a local state change of one claim under its lock and the cross-process
        lock: `grouped`, on the committer's thread with other claims' changes (one
        commit for all; driver/prepare/committer.py), else on a pool thread."""
        async with self.locks.hold(ref.uid):
            async with self.process_lock.hold():
                if grouped:
                    return await self.committer.run(change, ref, *args)
                return await asyncio.to_thread(change, ref, *args)

    def _shared(self, uses: list[Use]) -> bool:
        """Whether preparing the claim may change a device (sharing, MIG) or meet another
        claim that does. Such claims are checked against each other and change the device,
        so they go one at a time, on a pool thread: an MPS daemon start must not hold up the
        committer's group. Exclusive claims on clean devices need neither."""
        if any(u.setup is not None or u.share is not None or is_partition(u.device) for u in uses):
            return True
        return self.sharing is not None and bool(self.sharing.recorded() & {u.device.name for u in uses})

    # -- prepare -------------------------------------------------------------------------
    async def _prepare_one(self, ref: ClaimRef, log) -> PrepareOutcome:
        claim = await self.claims.read(ref)
        allocation = allocation_for(claim, ref, self.driver)
        try:
            prepared = self._resolve(ref, allocation)
            uses = self._uses(ref, prepared)
            # Programming an FPGA takes seconds: on a pool thread, never in the committer's group.
            shared = self._shared(uses) or any(_function_of(p) for p in prepared)
            users = ClaimUsers.of(claim)
            self._check_moved_nics(ref, prepared, users)
            if any(u.setup is not None and u.setup.mps for u in uses):
                users = dataclasses.replace(users, mps=await self._mps_users(ref, users))
            outcome = await self._prepare_waiting(ref, prepared, uses, shared, log, users)
        except (ClaimError, CheckpointError, cdi.CdiError, edits.EditsError) as err:
            if self.status is not None:  # the claim shows why, not only the kubelet's event
                self.status.publish(ref, claim_status.failed(allocation, self.pool, str(err)))
            raise
        if self.status is not None:
            self.status.publish(ref, list(outcome.status))
        return outcome

    async def _mps_users(self, ref: ClaimRef, users: "ClaimUsers") -> MpsUsers:
        """The UIDs and containers of the claim's pods: an MPS daemon serves one UID at a
        time, and a container reaches one daemon (driver/prepare/mpsusers.py)."""
        pods = await asyncio.gather(*(self.claims.read_pod(ref.namespace, name)
                                      for name in users.pods[:MAX_POD_READS]))
        return MpsUsers.of_pods(p for p in pods if p is not None)

    async def _prepare_waiting(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...],
                               uses: list[Use], shared: bool, log, users: "ClaimUsers") -> PrepareOutcome:
        """The local prepare; when it meets an MPS daemon that is still starting, wait for
        it with no lock held (other claims, and the other instance of an upgrade, go on),
        then prepare again: everything before the daemon is recorded, so the second pass
        only finds it answering. The wait is bounded well inside the kubelet's 45 s; past
        it the claim fails with the pod's state, and the kubelet's retry finds the daemon."""
        waited = False
        while True:
            try:
                return await self._local(ref, self._prepare_locally, prepared, uses, shared, log,
                                         users, grouped=not shared)
            except MpsStarting as starting:
                if waited or self.sharing is None or self.sharing.mps is None:
                    raise ClaimError(f"claim {ref}: {starting}; it did not answer in time, "
                                     "the kubelet retries the prepare") from starting
                log.info("mps_daemon_wait", device=starting.device, pod=starting.pod)
                try:
                    await asyncio.to_thread(self.sharing.mps.wait_ready, starting.device,
                                            starting.pod)
                except MpsError as err:
                    raise ClaimError(f"claim {ref}: {err}") from err
                waited = True

    def _prepare_locally(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...],
                         uses: list[Use], shared: bool, log, users: "ClaimUsers") -> PrepareOutcome:
        with self._sharing_lock if shared else contextlib.nullcontext():
            return self._prepare_checked(ref, prepared, uses, shared, log, users)

    def _prepare_checked(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...],
                         uses: list[Use], shared: bool, log, users: "ClaimUsers") -> PrepareOutcome:
        record = self._record(ref, log)
        reason = "prepared"
        if record is not None and record.state is State.PREPARE_COMPLETED:
            if record.devices == prepared:
                if record.boot_id == self.boot_id and self.cdi.path(ref.uid).exists():
                    log.debug("claim_already_prepared")
                    if users.pods and users.pods != record.pods:  # another pod of the claim
                        self.checkpoint.put(dataclasses.replace(record, pods=users.pods))
                    return PrepareOutcome(record.devices, status=self._status(record.devices, uses))
                # Rebooted (tmpfs /var/run/cdi is empty, minors may differ, the GPU lost
                # its settings) or spec deleted: rebuild from the allocation and today's
                # hardware.
                if shared:
                    self._set_up(ref, uses, users)
                uses = self._program(ref, prepared, self._partitions(ref, uses))
                self._write(ref, prepared, uses, log, "restored", users)
                if shared and self.sharing is not None:
                    self.sharing.settle(u.device.name for u in uses if u.setup is not None)
                return PrepareOutcome(prepared, status=self._status(prepared, uses))
            log.info("claim_reallocated", was=[d.device for d in record.devices],
                     now=[d.device for d in prepared])
            reason = "reprepared"
        self._check_exclusive(ref, prepared)
        if shared:
            self._set_up(ref, uses, users)
        uses = self._program(ref, prepared, self._partitions(ref, uses))
        self._write(ref, prepared, uses, log, reason, users)
        if shared and self.sharing is not None:
            self.sharing.settle(u.device.name for u in uses if u.setup is not None)
        return PrepareOutcome(prepared, status=self._status(prepared, uses))

    def _status(self, prepared: tuple[PreparedDevice, ...], uses: list[Use]) -> tuple[DeviceStatus, ...]:
        if self.status is None:
            return ()
        return tuple(claim_status.prepared(prepared, [u.device for u in uses], self.addresses))

    def _uses(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...]) -> list[Use]:
        inventory = self.inventory()
        uses = []
        for p in prepared:
            device = inventory.get(p.device)
            if device is None:
                raise ClaimError(f"claim {ref}: device {p.device} is no longer on this node")
            uses.append(use_of(str(ref), p, device))
        return uses

    def _partitions(self, ref: ClaimRef, uses: list[Use]) -> list[Use]:
        """Dynamic MIG: create the allocated partitions; the container gets the created
        MIG devices (their UUIDs and capability nodes), not the published placeholders."""
        if not any(is_partition(u.device) for u in uses):
            return uses
        if self.mig is None:
            raise ClaimError(f"claim {ref}: dynamic MIG partitions cannot be created by this "
                             "driver instance")
        try:
            return [dataclasses.replace(u, device=self.mig.ensure(str(ref), u.device))
                    if is_partition(u.device) else u for u in uses]
        except MigError as err:
            raise ClaimError(str(err)) from err

    def _program(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...], uses: list[Use]) -> list[Use]:
        """FpgaConfig.function: load it into the allocated FPGA before the spec exists
        (driver/prepare/fpgaprogram.py); the container gets the device as it is then."""
        if not any(_function_of(p) for p in prepared):
            return uses
        if self.fpga is None:
            raise ClaimError(f"claim {ref}: FpgaConfig.function asks for programming, which this "
                             "driver instance cannot do")
        result = []
        for p, use in zip(prepared, uses):
            if _function_of(p):
                holders = [f"{r.namespace}/{r.name}" for r in self.checkpoint.records()
                           if r.uid != ref.uid and r.state is State.PREPARE_COMPLETED
                           and any(d.device == p.device for d in r.devices)]
                config = opaque.from_dict(p.config)
                assert isinstance(config, opaque.FpgaConfig)
                try:
                    use = dataclasses.replace(use, device=self.fpga.ensure(str(ref), use.device,
                                                                           config, holders))
                except FpgaProgramError as err:
                    raise ClaimError(str(err)) from err
            result.append(use)
        return result

    def _set_up(self, ref: ClaimRef, uses: list[Use], users: "ClaimUsers | None" = None) -> None:
        """Check the claim's sharing against the other claims and set the devices up
        (time-slice, compute mode, MPS daemon) before the spec that relies on it exists.
        Only for claims that share a device or touch one with a recorded setup: exclusive
        claims on clean devices skip it (no per-claim cost for them)."""
        if self.sharing is None:
            if any(u.setup is not None for u in uses):
                raise ClaimError(f"claim {ref}: asks for GPU sharing, which this driver instance "
                                 "cannot set up")
            return
        records = list(self.checkpoint.records())
        plan = self.sharing.plan(str(ref), ref.uid, uses, records)
        if users is not None and users.mps is not None:
            self.sharing.check_mps_users(ref.namespace, ref.name, ref.uid, plan, users.mps, records)
        self.sharing.clear_leftovers(str(ref), ref.uid, [u.device.name for u in uses
                                                         if u.device.name not in plan], records)
        self.sharing.apply(str(ref), plan)

    @staticmethod
    def _check_moved_nics(ref: ClaimRef, prepared: tuple[PreparedDevice, ...],
                          users: "ClaimUsers") -> None:
        """An interface moved into a pod's network namespace (NicConfig moveInterface, by
        the NRI plugin or by the runtime from CDI netDevices) is in one pod at a time: for
        a claim reserved for two pods, the second pod's sandbox would fail on every retry,
        with a message about the first. Refused here, where the reason can be named."""
        if len(users.pods) < 2:
            return
        for p in prepared:
            config = opaque.from_dict(p.config) if p.config else None
            if isinstance(config, opaque.NicConfig) and config.moveInterface:
                raise ClaimError(
                    f"claim {ref}: device {p.device} has NicConfig moveInterface: true, so its "
                    f"interface goes into one pod's network namespace, but the claim is "
                    f"reserved for {len(users.pods)} pods ({', '.join(users.pods)}); give "
                    "each pod its own claim (a ResourceClaimTemplate)")

    def _check_exclusive(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...]) -> None:
        """A device prepared for one claim is not handed to another, unless one of the two
        has admin access (monitoring beside a workload) or both were allocated as shares
        (shareID: a device that allows multiple allocations)."""
        wanted = {p.device: p for p in prepared if not p.admin_access}
        if not wanted:
            return
        for other in self.checkpoint.records():
            if other.uid == ref.uid or other.state is not State.PREPARE_COMPLETED:
                continue
            for held in other.devices:
                mine = wanted.get(held.device)
                if mine is None or held.admin_access:
                    continue
                if mine.share_id is None or held.share_id is None:
                    how = "is not shared" if held.share_id is None else "is shared, and this claim asks for it whole"
                    raise ClaimError(
                        f"claim {ref}: device {held.device} is already prepared for claim "
                        f"{other.namespace}/{other.name} (UID {other.uid}) and {how}; "
                        "it is prepared again only after that claim is unprepared")

    def _record(self, ref: ClaimRef, log) -> ClaimRecord | None:
        try:
            return self.checkpoint.get(ref.uid)
        except CheckpointError as err:
            moved = self.checkpoint.quarantine(ref.uid)
            log.error("checkpoint_record_corrupt", error=str(err), moved_to=str(moved))
            return None

    def _resolve(self, ref: ClaimRef, allocation: Allocation) -> tuple[PreparedDevice, ...]:
        inventory = self.inventory()
        prepared = []
        for result in allocation.devices:
            if result.pool != self.pool:
                raise ClaimError(f"claim {ref}: device {result.device} is allocated from pool "
                                 f"{result.pool!r}, this node's pool is {self.pool!r}")
            device = inventory.get(result.device)
            if device is None:
                raise ClaimError(f"claim {ref}: device {result.device!r} does not exist on "
                                 f"node {self.pool}")
            config = self._config_for(ref, device, result.request, allocation)
            consumed = {}
            for name, value in sorted(result.consumed.items()):
                try:
                    consumed[name] = quantity.canonical(value)
                except quantity.QuantityError as err:
                    raise ClaimError(f"claim {ref}: consumedCapacity {name} of device "
                                     f"{device.name}: {err}") from err
            prepared.append(PreparedDevice(
                request=result.request, pool=result.pool, device=device.name,
                cdi_ids=(cdi.qualified_id(self.cdi.vendor, cdi_name(ref.uid, device.name,
                                                                    result.share_id)),),
                config=opaque.to_dict(config), share_id=result.share_id,
                admin_access=result.admin_access, consumed=consumed,
            ))
        keys = [(p.device, p.share_id) for p in prepared]
        if len(set(keys)) != len(keys):
            names = sorted(p.device for p in prepared)
            raise ClaimError(f"claim {ref}: a device is allocated twice: {names}")
        return tuple(prepared)

    def _config_for(self, ref: ClaimRef, device: Device, request: str,
                    allocation: Allocation) -> opaque.DeviceConfig:
        chosen = opaque.default_for(device.kind)
        for entry in allocation.configs:
            requests = entry.requests
            if requests and request not in requests and base_request(request) not in requests:
                continue
            try:
                config = opaque.decode(entry.parameters)
            except opaque.ConfigDecodeError as err:
                raise ClaimError(f"claim {ref}: invalid opaque config ({entry.source or 'unknown source'}"
                                 f" for {self.driver}): {err}") from err
            if device.kind not in opaque.APPLIES_TO[type(config)]:
                if entry.aimed:  # the claim named this request for it: a mistake worth reporting
                    raise ClaimError(f"claim {ref}: {type(config).__name__} cannot configure "
                                     f"{device.kind.value} device {device.name}")
                continue  # a claim-wide config for another kind of device
            chosen = config
        return chosen

    def _write(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...], uses: list[Use], log,
               reason: str, users: "ClaimUsers | None" = None) -> None:
        users = users or ClaimUsers()
        driver_mounts = self.driver_mounts()
        # KEP-5304: the metadata files first, then the spec that mounts them; each
        # request's file goes with the first of its devices (a container gets all of them).
        metadata_mounts: dict[str, cdi.Mount] = {}
        if self.metadata is not None:
            metadata_mounts = self.metadata.write(ref, users.pod_claim, [
                (p, u.device, claim_status.network_of(u.device, p, self.addresses))
                for p, u in zip(devices, uses)])
        cdi_devices = []
        for prepared, use in zip(devices, uses):
            device = use.device
            config = opaque.from_dict(prepared.config) if prepared.config else opaque.default_for(device.kind)
            container_edits = edits.build(device, config, claim=str(ref),
                                          request=base_request(prepared.request),
                                          dev_root=self.dev_root, driver_mounts=driver_mounts,
                                          admin_access=prepared.admin_access,
                                          cdi_net_devices=self.cdi_net_devices)
            if self.sharing is not None:
                env, mounts = self.sharing.container_edits(use, edits.env_prefix(device.name))
                container_edits = dataclasses.replace(
                    container_edits, env=container_edits.env + tuple(env),
                    mounts=container_edits.mounts + tuple(mounts))
            mount = metadata_mounts.pop(base_request(prepared.request), None)
            if mount is not None:
                container_edits = dataclasses.replace(container_edits,
                                                      mounts=container_edits.mounts + (mount,))
            cdi_devices.append(CdiDevice(cdi_name(ref.uid, device.name, prepared.share_id),
                                         container_edits))
        spec = cdi.build_spec(self.cdi.vendor, cdi_devices, where=f"claim {ref}")
        self.cdi.write(ref.uid, spec)
        self.checkpoint.put(ClaimRecord(ref.uid, ref.namespace, ref.name,
                                        State.PREPARE_COMPLETED, self.boot_id, devices,
                                        users.pods, users.mps.run_as if users.mps else ()))
        log.info("claim_" + reason, devices=[d.device for d in devices],
                 cdi_version=spec["cdiVersion"])

    # -- unprepare -----------------------------------------------------------------------
    async def _unprepare_one(self, ref: ClaimRef, log) -> str:
        # Never the API server: the claim may be gone already (checkpoint data only).
        async with self.locks.hold(ref.uid):
            async with self.process_lock.hold():
                # The claim's files, in a group with other claims' changes; then, on a pool
                # thread (it may stop an MPS daemon), what no prepared claim needs any more.
                device_work = await self.committer.run(self._unprepare_locally, ref, log)
                if not device_work:
                    return ""
                return await asyncio.to_thread(self._release_unneeded, ref, log)

    def _unprepare_locally(self, ref: ClaimRef, log) -> bool:
        """Remove the claim's spec, metadata and record; whether any device has a
        setup or partition that may now be unneeded."""
        # The spec goes first: once the record is gone nothing remembers the spec, while a
        # record without a spec is harmless and removed by the retry.
        removed_spec = self.cdi.remove(ref.uid)
        if self.metadata is not None:  # after the spec that mounts it
            self.metadata.remove(ref.uid, self._requests_of(ref.uid))
        removed_record = self.checkpoint.remove(ref.uid)
        if self.status is not None:
            self.status.publish(ref, [])  # our entries leave the claim (if it is still there)
        if removed_spec or removed_record:
            log.info("claim_unprepared")
        else:
            log.debug("claim_unprepare_unknown")
        return ((self.sharing is not None and bool(self.sharing.recorded()))
                or (self.mig is not None and self.mig.recorded()))

    def _release_unneeded(self, ref: ClaimRef, log) -> str:
        """Undo what no prepared claim needs any more (this claim's MPS daemon, time
        slice, compute mode, MIG partition): a failure is returned, so the kubelet
        retries, and each retry (and the periodic reconcile) tries again, with or without
        a record."""
        with self._sharing_lock:
            records = list(self.checkpoint.records())
            errors = ((self.sharing.release_unneeded(records) if self.sharing is not None else [])
                      + self._release_partitions(records))
        if errors:
            log.warning("device_setup_undo_failed", errors=errors)
            return f"claim {ref}: unprepared, but " + "; ".join(errors)
        return ""

    def _requests_of(self, uid: str) -> set[str] | None:
        """The top-level requests of a claim's record; None without a readable record."""
        try:
            record = self.checkpoint.get(uid)
        except CheckpointError:
            return None
        return {base_request(d.request) for d in record.devices} if record is not None else None

    async def reconcile_sharing(self) -> list[str]:
        """After a start and periodically: device setups match the prepared claims, and
        no metadata files outlive their claims."""
        async with self.process_lock.hold():
            return await asyncio.to_thread(self._reconcile_sharing)

    def _reconcile_sharing(self) -> list[str]:
        self._sweep_metadata()
        if self.fpga is not None:  # records of an earlier boot go, a crashed programming's
            # tool still running is stopped; nothing on a card is undone
            self.fpga.reconcile(self.checkpoint.records(fresh=True))
        if self.sharing is None:
            return []
        with self._sharing_lock:
            # From the disk, not the cache: the safety net must not share a cache's mistake.
            records = list(self.checkpoint.records(fresh=True))
            # Also partitions a crash left behind (prepared, then the claim record never
            # written; or unprepared before the destroy).
            return self.sharing.reconcile(records) + self._release_partitions(records)

    def _sweep_metadata(self) -> None:
        """Metadata of claims with neither a record nor a spec: a prepare that crashed
        before its spec, whose claim never came back. Under the process lock, so no
        prepare of either instance is between its writes."""
        if self.metadata is None:
            return
        known = set(self.checkpoint.uids())
        for uid, paths in self.metadata.files().items():
            if uid not in known and not self.cdi.path(uid).exists():
                discard(paths)
                self.log.info("claim_metadata_swept", claim_uid=uid)

    def _release_partitions(self, records: list[ClaimRecord]) -> list[str]:
        """Destroy the MIG partitions no prepared claim holds; the errors."""
        return self.mig.release_unneeded(records) if self.mig is not None else []

    def prepared_claims(self) -> list[str]:
        return self.checkpoint.uids()


def _function_of(prepared: PreparedDevice) -> str | None:
    """The FPGA function a prepared device's config asks to load."""
    return (prepared.config or {}).get("function") if (prepared.config or {}).get("kind") == "FpgaConfig" else None


@dataclass(frozen=True)
class ClaimUsers:
    """Who uses a claim, as its object says at prepare: the pod's claim name of a
    template-generated claim (KEP-5304 file paths), and the pods it is reserved for
    (kept in the record for `dra-driver status`)."""

    pod_claim: str | None = None
    pods: tuple[str, ...] = ()
    mps: MpsUsers | None = None  # read only for claims that use MPS

    @classmethod
    def of(cls, claim: dict) -> "ClaimUsers":
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        pods = tuple(sorted({str(r["name"]) for r in reserved if isinstance(r, dict)
                             and r.get("resource") == "pods" and r.get("name")}))[:MAX_PODS]
        return cls(pod_claim_name(claim), pods)


MAX_PODS = 32  # reservedFor holds up to 256; the record keeps the first few
MAX_POD_READS = 8  # pods read for an MPS claim's users (a claim shared by more is rare)
