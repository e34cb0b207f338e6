"""Shares of a GPU allocated through consumable capacity (KEP-5075).

The scheduler only counts: each allocation result of a multi-allocatable device carries a
`shareID` and `consumedCapacity` (memory, compute). Prepare re-checks that arithmetic
against the claims already prepared on the device, so that a stale or misbehaving
scheduler cannot overcommit a GPU silently; that part is enforced. The share's own limits
reach its containers as MPS client settings in their environment: MPS applies them to
each client process separately, and a process can unset or raise them, so they are
accounted, not enforced (docs/sharing.md, "What is enforced, and what is only
accounted"). The only caps a container cannot lift are the server defaults of the GPU's
`mpsConfig`, which apply to every share alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Iterable, Mapping

from driver.kube import quantity
from driver.prepare.claims import ClaimError
from driver.devices.model import Device, DeviceKind
from driver.publish.slices import COMPUTE

MEMORY = "memory"
WHOLE_COMPUTE = 100
MIB = 1 << 20


@dataclass(frozen=True)
class ShareLimits:
    memory_bytes: int  # of the GPU's memory this share may pin
    # of the GPU's SMs (MPS active thread percentage); 0: none reserved, none capped (a
    # share that asked only for memory)
    compute_percent: int

    def whole(self, device: Device) -> bool:
        """The share covers the device: what is left cannot be requested (< 1 GiB of
        memory, and no cap on the compute asked for)."""
        return (self.compute_percent in (0, WHOLE_COMPUTE)
                and device_memory(device) - self.memory_bytes < (1 << 30))

    @property
    def memory_mib(self) -> int:
        return max(1, self.memory_bytes // MIB)  # MPS takes whole MiB; never 0 (= no limit)


def device_memory(device: Device) -> int:
    return int(quantity.value(device.capacity.get(MEMORY, "0")))


def limits(claim: str, device: Device, consumed: Mapping[str, str]) -> ShareLimits:
    """The limits of one share, from its allocation result's consumedCapacity."""
    if device.kind is not DeviceKind.GPU:
        raise ClaimError(f"claim {claim}: device {device.name} is a {device.kind.value}; only "
                         "whole GPUs are shared through consumable capacity")
    unknown = sorted(set(consumed) - {MEMORY, COMPUTE})
    if unknown:
        raise ClaimError(f"claim {claim}: share of {device.name} consumes unknown capacity "
                         f"{', '.join(unknown)}; this driver publishes {MEMORY} and {COMPUTE}")
    total = device_memory(device)
    try:
        memory = quantity.value(consumed.get(MEMORY, str(total)))
        compute = quantity.value(consumed.get(COMPUTE, str(WHOLE_COMPUTE)))
    except quantity.QuantityError as err:
        raise ClaimError(f"claim {claim}: share of {device.name}: {err}") from err
    if not 0 < memory <= total:
        raise ClaimError(f"claim {claim}: share of {device.name} consumes {consumed.get(MEMORY)} "
                         f"memory; the GPU has {device.capacity.get(MEMORY)}")
    if compute != compute.to_integral_value() or not 0 <= compute <= WHOLE_COMPUTE:
        raise ClaimError(f"claim {claim}: share of {device.name} consumes {consumed.get(COMPUTE)} "
                         f"{COMPUTE}; it must be a whole percentage from 0 to {WHOLE_COMPUTE}")
    return ShareLimits(int(memory.to_integral_value(rounding="ROUND_CEILING")), int(compute))


def check_fits(claim: str, device: Device, mine: ShareLimits,
               others: Iterable[tuple[str, ShareLimits]]) -> None:
    """The shares already prepared on the device plus this one fit into the device."""
    others = list(others)
    memory = mine.memory_bytes + sum(s.memory_bytes for _, s in others)
    compute = mine.compute_percent + sum(s.compute_percent for _, s in others)
    total = device_memory(device)
    if memory <= total and compute <= WHOLE_COMPUTE:
        return
    held = ", ".join(f"{name} ({_gib(s.memory_bytes)}, {s.compute_percent}%)" for name, s in others)
    raise ClaimError(f"claim {claim}: its share of {device.name} ({_gib(mine.memory_bytes)}, "
                     f"{mine.compute_percent}%) does not fit beside the shares already prepared "
                     f"there: {held}; the GPU has {device.capacity.get(MEMORY)} and 100% compute "
                     "(the allocation overcommits the device)")


def _gib(size: int) -> str:
    return f"{Decimal(size) / (1 << 30):.4g}Gi"


def env(prefix: str, share: ShareLimits) -> list[str]:
    """The share's MPS client settings, and what it was given, for the workload to read.
    Per process and liftable by the container (not enforced); they can only lower what the
    server allows (docs/sharing.md)."""
    env = [
        f"{prefix}_MEMORY_LIMIT={share.memory_mib}Mi",
        f"{prefix}_COMPUTE_PERCENT={share.compute_percent}",
    ]
    if share.compute_percent > 0:  # 0: no SMs reserved, so none capped either
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share.compute_percent}")
    # Ordinal 0: the MPS server of this GPU is started with only this GPU visible.
    env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={share.memory_mib}M")
    return env
