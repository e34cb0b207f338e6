"""Device setups for shared GPUs: planned at prepare, applied before the CDI spec is
written, undone when the last claim that needs them is gone, reconciled after a restart.

Who needs what is derived from the claim records alone (each records its decoded config
and its share), so there is no reference count to get wrong: a device's setup is needed
while some prepared claim's device asks for it. What was changed is in DeviceStates,
written before each change. Together they answer every crash: a state nobody needs is
undone; a needed one whose daemon died, or that a reboot cleared, is applied again.
All of it runs under the cross-process prepare lock.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import structlog

from driver.prepare import opaque
from driver.prepare.cdi import Mount
from driver.state.checkpoint import ClaimRecord, PreparedDevice, State
from driver.prepare.claims import ClaimError
from driver.devices.model import Device, DeviceKind, Inventory
from driver.prepare import mpsusers
from driver.prepare import setup as setups
from driver.prepare import shares
from driver.prepare.devicestate import DeviceState, DeviceStateError, DeviceStates
from driver.prepare.gpucontrol import GpuControl, GpuControlError
from driver.prepare.mps import (CONTAINER_PIPE_DIR, KUBELET_PREPARE_SECONDS, MpsDaemons, MpsError,
                                MpsStarting)
from driver.prepare.mpsusers import MpsUsers
from driver.prepare.setup import Setup
from driver.prepare.shares import ShareLimits

SHARE_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
# How long a new setup is kept for the prepare that made it before any claim record needs
# it: the prepare's wait for its daemon and the kubelet's retry after a failed wait.
RESERVE_SECONDS = 2 * KUBELET_PREPARE_SECONDS


class SetupError(ClaimError):
    """A device could not be set up for a claim (the message names both)."""


@dataclass(frozen=True)
class Use:
    """One prepared device of one claim, as sharing sees it."""

    claim: str  # "namespace/name"
    device: Device
    setup: Setup | None
    share: ShareLimits | None
    share_id: str | None


def use_of(claim: str, prepared: PreparedDevice, device: Device) -> Use:
    if not prepared.share_id and not prepared.config.get("sharing"):
        return Use(claim, device, None, None, None)  # exclusive: nothing to decode or check
    config = opaque.from_dict(prepared.config) if prepared.config else opaque.default_for(device.kind)
    # Only GPUs have capacity to account; a share of another device (published shareable
    # by some other means) is access beside other claims, nothing more.
    share = (shares.limits(claim, device, prepared.consumed)
             if prepared.share_id and device.kind is DeviceKind.GPU else None)
    return Use(claim, device, setups.for_device(claim, device, config, share, prepared.admin_access),
               share, prepared.share_id)


class DeviceSharing:
    def __init__(self, states: DeviceStates, control: GpuControl, mps: MpsDaemons | None,
                 boot_id: str, inventory: Callable[[], Inventory]) -> None:
        self.states = states
        self.control = control
        self.mps = mps
        self.boot_id = boot_id
        self.inventory = inventory
        self.log = structlog.get_logger(component="sharing")
        self._restoring: set[str] = set()  # daemons re-created by reconcile, not answering yet

    # -- who needs what ------------------------------------------------------------------
    def uses(self, records: Iterable[ClaimRecord], skip_uid: str | None = None,
             only: set[str] | None = None) -> list[Use]:
        """The shared uses of devices (those with a share or a sharing config; of the
        devices in `only`, if given) by the prepared claims."""
        inventory = self.inventory()
        found = []
        for record in records:
            if record.uid == skip_uid or record.state is not State.PREPARE_COMPLETED:
                continue
            claim = f"{record.namespace}/{record.name}"
            for prepared in record.devices:
                if only is not None and prepared.device not in only:
                    continue
                if not prepared.share_id and not prepared.config.get("sharing"):
                    continue  # exclusive use: nothing to share, no config to decode
                device = inventory.get(prepared.device)
                if device is None:
                    continue  # gone from the node: nothing to set up on it
                try:
                    found.append(use_of(claim, prepared, device))
                except ClaimError as err:  # recorded by an older version with other rules
                    self.log.warning("claim_record_setup_invalid", claim=claim,
                                     device=prepared.device, error=str(err))
        return found

    def needed(self, records: Iterable[ClaimRecord], only: set[str] | None = None) -> dict[str, Setup]:
        return {u.device.name: u.setup for u in self.uses(records, only=only) if u.setup is not None}

    def recorded(self) -> set[str]:
        """Devices with a setup record."""
        return self.states.devices()

    # -- prepare -------------------------------------------------------------------------
    def plan(self, claim: str, uid: str, mine: list[Use], records: Iterable[ClaimRecord]) -> dict[str, Setup]:
        """Check the claim's devices against the claims already prepared; what to set up."""
        others = self.uses(records, skip_uid=uid, only={u.device.name for u in mine})
        plan: dict[str, Setup] = {}
        for position, use in enumerate(mine):
            same = [o for o in others if o.device.name == use.device.name]
            if use.setup is not None:  # first: the more telling message of the two
                setups.check_compatible(claim, use.device, use.setup,
                                        [(o.claim, o.setup) for o in same if o.setup is not None])
            if use.share is not None:
                # With this claim's own earlier shares: two requests may take two shares of
                # one GPU.
                own = [m for m in mine[:position] if m.device.name == use.device.name]
                shares.check_fits(claim, use.device, use.share,
                                  [(o.claim, o.share) for o in same + own if o.share is not None])
            if use.setup is not None:
                if use.device.name in plan and plan[use.device.name] != use.setup:
                    raise ClaimError(f"claim {claim}: two of its requests ask for different "
                                     f"sharing setups on {use.device.name}")
                plan[use.device.name] = use.setup
        daemons = sorted(name for name, s in plan.items() if s.mps)
        if len(daemons) > 1:
            raise ClaimError(f"claim {claim}: puts {', '.join(daemons)} under MPS; a container "
                             "talks to one MPS control daemon (CUDA_MPS_PIPE_DIRECTORY), so ask "
                             "for MPS-shared GPUs in separate claims")
        return plan

    def check_mps_users(self, namespace: str, name: str, uid: str, plan: dict[str, Setup],
                        users: MpsUsers, records: Iterable[ClaimRecord]) -> None:
        """Refuse, naming both claims, what MPS would turn into a hang or a silent loss:
        a share running as another UID than the shares on the GPU, and a container that
        would need two GPUs' MPS daemons (driver/prepare/mpsusers.py)."""
        claim = f"{namespace}/{name}"
        daemons = sorted(d for d, s in plan.items() if s.mps)
        if not daemons:
            return
        records = [r for r in records if r.uid != uid and r.state is State.PREPARE_COMPLETED]
        run_as = {f"{r.namespace}/{r.name}": r.run_as for r in records}
        for device in daemons:
            if plan[device].multi_user:
                continue  # one root server for every UID (-M): no UID waits for another
            others = sorted({(u.claim, run_as.get(u.claim, ()))
                             for u in self.uses(records, only={device})
                             if u.setup is not None and u.setup.mps})
            problem = mpsusers.uid_conflict(claim, users.run_as, device, others)
            if problem:
                raise ClaimError(problem)
        if not users.containers:
            return
        mps_devices = {f"{u.claim}": u.device.name for u in self.uses(records)
                       if u.setup is not None and u.setup.mps}
        for container, claims in sorted(users.containers.items()):
            if name not in claims:
                continue
            for other in claims:
                device = mps_devices.get(f"{namespace}/{other}")
                if other != name and device is not None and device not in daemons:
                    raise ClaimError(
                        f"claim {claim}: container {container} also references claim "
                        f"{namespace}/{other}, whose MPS daemon is on {device}, while this "
                        f"claim's is on {daemons[0]}; a container talks to one MPS control "
                        "daemon (one CUDA_MPS_PIPE_DIRECTORY), so give the two claims to "
                        "different containers or ask for both GPUs in one claim without MPS")

    def clear_leftovers(self, claim: str, uid: str, devices: Iterable[str],
                        records: Iterable[ClaimRecord]) -> None:
        """Before a device is handed out unshared: undo a setup a crash left on it (an MPS
        server holding a GPU in EXCLUSIVE_PROCESS would lock the new claim out), unless
        another prepared claim needs it (an admin-access claim beside an MPS-shared GPU)."""
        devices = set(devices) & self.recorded()
        if not devices:
            return
        in_use = {u.device.name for u in self.uses(records, skip_uid=uid, only=devices)
                  if u.setup is not None}
        for name in sorted(devices - in_use):
            state = self.states.get(name)
            if state is None:
                continue
            if state.reserved(time.time(), self.states.instance.alive):
                raise SetupError(f"claim {claim}: device {name} is being set up for "
                                 f"{state.setup.describe()} by another claim's prepare")
            try:
                self.undo(state)
            except (GpuControlError, MpsError) as err:
                raise SetupError(f"claim {claim}: device {name} still has the setup "
                                 f"{state.setup.describe()} of an earlier claim, which cannot "
                                 f"be undone: {err}") from err

    def apply(self, claim: str, plan: dict[str, Setup]) -> None:
        inventory = self.inventory()
        for name, setup in sorted(plan.items()):
            device = inventory.get(name)
            if device is None:
                raise SetupError(f"claim {claim}: device {name} is no longer on this node")
            try:
                self.ensure(device, setup)
            except (GpuControlError, MpsError, DeviceStateError) as err:
                raise SetupError(f"claim {claim}: cannot set up {name} for "
                                 f"{setup.describe()}: {err}") from err

    def settle(self, devices: Iterable[str]) -> None:
        """A claim record now needs these devices' setups: their reservations end, so
        that the last claim to leave undoes them at once."""
        for name in devices:
            state = self.states.get(name)
            if state is not None and state.reserved_until is not None:
                self.states.put(dataclasses.replace(state, reserved_until=None, reserved_by=None))

    def ensure(self, device: Device, setup: Setup) -> DeviceState:
        """Make `device` run `setup`, recording first what is about to change."""
        uuid = str(device.attributes.get("uuid", ""))
        state = self.states.get(device.name)
        if state is not None and (state.setup != setup or state.uuid != uuid):
            self.undo(state)  # left over from a claim that is gone: start clean
            state = None
        if state is not None and state.boot_id != self.boot_id:
            state = None  # a reboot cleared the GPU settings: record them anew
        if state is None:
            before = None
            if device.kind is DeviceKind.GPU:
                before = self.control.compute_mode(uuid)
            state = DeviceState(device.name, uuid, setup, self.boot_id, before,
                                self.mps.pod_name(device.name) if setup.mps and self.mps else None,
                                reserved_until=time.time() + RESERVE_SECONDS,
                                reserved_by=self.states.instance.token)
            self.states.put(state)  # durable before the first change
            self.log.info("device_setup_recorded", device=device.name, setup=setup.describe(),
                          compute_mode_before=before)
        nv = self.control.nvml
        if setup.mps:
            if self.mps is None:
                raise MpsError("MPS is not available: the driver runs without an API server client")
            if device.kind is DeviceKind.GPU:
                self.control.set_compute_mode(uuid, nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
            self.mps.start(device.name, uuid, setup)
        else:
            if self.control.compute_mode(uuid) != nv.NVML_COMPUTEMODE_DEFAULT:
                self.control.set_compute_mode(uuid, nv.NVML_COMPUTEMODE_DEFAULT)
            self.control.set_timeslice(uuid, opaque.INTERVALS[setup.interval])
        return state

    # -- undo ----------------------------------------------------------------------------
    def undo(self, state: DeviceState) -> None:
        """Stop the daemon, restore the GPU's settings, then forget the record."""
        device = self.inventory().get(state.device)
        same_boot = state.boot_id == self.boot_id
        if state.setup.mps and self.mps is not None:
            self.mps.stop(state.device, state.daemon)
        if device is not None and same_boot:
            if not state.setup.mps:
                try:
                    self.control.set_timeslice(state.uuid, opaque.INTERVALS["Default"])
                except GpuControlError as err:
                    self.log.warning("timeslice_reset_failed", device=state.device, error=str(err))
            if state.compute_mode_before is not None:
                self.control.set_compute_mode(state.uuid, state.compute_mode_before)
        elif device is None:
            self.log.warning("device_setup_dropped_device_gone", device=state.device,
                             setup=state.setup.describe())
        self.states.remove(state.device)
        self.log.info("device_setup_undone", device=state.device, setup=state.setup.describe())

    def release_unneeded(self, records: Iterable[ClaimRecord]) -> list[str]:
        """Undo every recorded setup no prepared claim needs; the errors, for the caller."""
        recorded = self.recorded()
        if not recorded:
            return []
        needed = self.needed(records, only=recorded)
        errors = []
        now = time.time()
        for state in self.states.all():
            if isinstance(state, DeviceStateError):
                continue
            if needed.get(state.device) == state.setup:
                continue
            if state.reserved(now, self.states.instance.alive) and state.device not in needed:
                continue  # a prepare is waiting for it (or its retry will come)
            try:
                self.undo(state)
            except (GpuControlError, MpsError) as err:
                errors.append(f"device {state.device}: cannot undo {state.setup.describe()}: {err}")
        return errors

    # -- after a restart, and periodically ------------------------------------------------
    def reconcile(self, records: list[ClaimRecord]) -> list[str]:
        """Undo what nobody needs, re-apply what a reboot or a crash lost, stop orphan
        daemon pods. Returns the problems left (retried next time)."""
        problems = []
        for state in self.states.all():
            if isinstance(state, DeviceStateError):
                self.log.error("device_state_record_corrupt", error=str(state))
                problems.append(str(state))
        problems += self.release_unneeded(records)
        inventory = self.inventory()
        for name, setup in sorted(self.needed(records).items()):
            state = self.states.get(name)
            healthy = (state is not None and state.boot_id == self.boot_id
                       and (not setup.mps or self.mps is None or self.mps.alive(name)))
            if healthy:
                if name in self._restoring:
                    self._restoring.discard(name)
                    self.log.info("device_setup_restored", device=name, setup=setup.describe())
                continue
            device = inventory.get(name)
            try:
                self.ensure(device, setup)
                self._restoring.discard(name)
                self.log.info("device_setup_restored", device=name, setup=setup.describe())
            except MpsStarting as starting:  # its pod is (re)starting: looked at next pass
                self._restoring.add(name)
                self.log.info("device_setup_restoring", device=name, pod=starting.pod)
            except (GpuControlError, MpsError, DeviceStateError) as err:
                problems.append(f"device {name}: {err}")
        if self.mps is not None:
            problems += self._stop_orphan_daemons()
        for problem in problems:
            self.log.warning("sharing_reconcile_problem", problem=problem)
        return problems

    def _stop_orphan_daemons(self) -> list[str]:
        known = {s.daemon for s in self.states.all() if isinstance(s, DeviceState) and s.daemon}
        problems = []
        try:
            pods = self.mps.pods()
        except Exception as err:  # the API server is down: try again next time
            return [f"cannot list MPS daemon pods: {err}"]
        for pod in pods:
            meta = pod.get("metadata") or {}
            name = meta.get("name", "")
            if name in known or meta.get("deletionTimestamp"):
                continue
            device = (meta.get("labels") or {}).get(f"{self.mps.driver}/device", "")
            try:
                self.mps.stop(device, name)
                self.log.warning("mps_orphan_daemon_stopped", pod=name, device=device)
            except MpsError as err:
                problems.append(str(err))
        return problems

    # -- what the container gets ---------------------------------------------------------
    def container_edits(self, use: Use, prefix: str) -> tuple[list[str], list[Mount]]:
        env: list[str] = []
        mounts: list[Mount] = []
        if use.share_id:
            env.append(f"{prefix}_SHARE_ID={use.share_id}")
        if use.setup is None:
            return env, mounts
        env.append(f"{prefix}_SHARING={use.setup.strategy}")
        if use.setup.mps and self.mps is not None:
            paths = self.mps.paths(use.device.name)
            env.append(f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")
            # A share that covers the whole GPU (a claim that asked for no capacity) gets
            # no client limits: they would override the server defaults of its mpsConfig.
            if use.share is not None and not use.share.whole(use.device):
                env += shares.env(prefix, use.share)
            mounts += [Mount(str(paths.pipe), CONTAINER_PIPE_DIR, SHARE_MOUNT_OPTIONS),
                       Mount(str(paths.shm), "/dev/shm", SHARE_MOUNT_OPTIONS)]
        return env, mounts
