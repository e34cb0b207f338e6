"""What a prepared claim asks of a GPU beyond access: time-slicing or an MPS server.

A setup belongs to a physical device (a whole GPU, or a MIG device for MPS) and all the
claims prepared on that device must ask for the same one: the time-slice interval and the
compute mode are per GPU, and one MPS control daemon serves every claim and share of its
GPU with one set of server defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from driver.prepare import opaque
from driver.prepare.claims import ClaimError
from driver.devices.model import Device, DeviceKind
from driver.prepare.shares import ShareLimits


@dataclass(frozen=True)
class Setup:
    strategy: str  # opaque.TIME_SLICING or opaque.MPS
    interval: str = "Default"  # time-slicing
    active_threads: int | None = None  # MPS server default (percent)
    pinned_memory: str | None = None  # MPS server default (quantity)
    # The control daemon runs with -M: one root server for the clients of every UID. A
    # daemon is started one way or the other, so claims on one GPU must agree on it.
    multi_user: bool = False

    @property
    def mps(self) -> bool:
        return self.strategy == opaque.MPS

    def describe(self) -> str:
        if not self.mps:
            return f"TimeSlicing (interval {self.interval})"
        defaults = [f"{k}={v}" for k, v in (("defaultActiveThreadPercentage", self.active_threads),
                                            ("defaultPinnedDeviceMemoryLimit", self.pinned_memory),
                                            ("multiUser", "true" if self.multi_user else None))
                    if v is not None]
        return "MPS" + (f" ({', '.join(defaults)})" if defaults else " (server defaults)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Setup":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def for_device(claim: str, device: Device, config: opaque.DeviceConfig,
               share: ShareLimits | None, admin_access: bool = False) -> Setup | None:
    """The setup one prepared device needs, or None (plain exclusive access)."""
    sharing = config.sharing if isinstance(config, opaque.GpuConfig) else None
    if admin_access:
        if sharing is not None:
            raise ClaimError(f"claim {claim}: device {device.name} is allocated with admin access "
                             "(monitoring beside other claims); it cannot change how the GPU is "
                             "shared, drop sharing from its config")
        return None
    if sharing is None:
        # A share runs under MPS even when the claim did not ask for it: its limits are MPS
        # client settings (per process, accounted rather than enforced: docs/sharing.md).
        return Setup(opaque.MPS) if share is not None and not share.whole(device) else None
    if sharing.strategy == opaque.TIME_SLICING:
        if device.kind is DeviceKind.MIG:
            raise ClaimError(f"claim {claim}: {device.name} is a MIG device; time-slicing applies "
                             "to whole GPUs only (use strategy MPS, or no sharing config)")
        if share is not None and not share.whole(device):
            raise ClaimError(f"claim {claim}: its share of {device.name} ({share.memory_mib}Mi, "
                             f"{share.compute_percent}%) is set up through MPS; TimeSlicing "
                             "cannot limit a share's memory or compute (use strategy MPS)")
        interval = sharing.timeSlicingConfig.interval if sharing.timeSlicingConfig else "Default"
        return Setup(opaque.TIME_SLICING, interval=interval)
    mps = sharing.mpsConfig or opaque.MpsConfig()
    if mps.multiUser:
        check_multi_user(claim, device)
    return Setup(opaque.MPS, active_threads=mps.defaultActiveThreadPercentage,
                 pinned_memory=mps.defaultPinnedDeviceMemoryLimit, multi_user=mps.multiUser)


# MPS's multi-user mode needs Volta (compute capability 7.0) or newer. An older GPU's
# control daemon still accepts -M, but its non-root clients then fail in cuInit
# (CUDA_ERROR_NOT_PERMITTED): refuse the claim at prepare instead, naming the GPU.
MULTI_USER_MIN_CAPABILITY = (7, 0)


def check_multi_user(claim: str, device: Device) -> None:
    raw = str(device.attributes.get("cudaComputeCapability", ""))
    try:
        capability = tuple(int(part) for part in raw.split(".")[:2])
    except ValueError:
        capability = ()
    if len(capability) != 2:
        raise ClaimError(f"claim {claim}: mpsConfig.multiUser needs a Volta or newer GPU, and "
                         f"the compute capability of {device.name} is not known")
    if capability < MULTI_USER_MIN_CAPABILITY:
        raise ClaimError(f"claim {claim}: mpsConfig.multiUser needs a Volta or newer GPU "
                         f"(compute capability 7.0); {device.name} has "
                         f"{capability[0]}.{capability[1]}")


def check_compatible(claim: str, device: Device, mine: Setup,
                     others: list[tuple[str, Setup]]) -> None:
    """All claims on one device ask for the same setup; the message names the other claim."""
    for other_claim, theirs in others:
        if theirs != mine:
            raise ClaimError(
                f"claim {claim}: asks for {mine.describe()} on {device.name}, but claim "
                f"{other_claim} is prepared there with {theirs.describe()}; a GPU has one "
                "sharing setup at a time (it changes after that claim is unprepared)")
