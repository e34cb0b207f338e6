"""Dynamic MIG: every MIG partition a GPU could hold, as partitionable devices (KEP-4815).

For a MIG-capable GPU NVML lists each GPU instance profile and its possible placements in
the GPU's eight memory slices. Each (profile, placement) becomes a device named
`gpu-<pci>-mig-<profile>-<start>`, with the attributes and capacities of a static MIG
device of that profile, consuming from the GPU's counter set: the memory slices it covers,
its compute slices and its engines. The whole GPU consumes all of it, so the scheduler
never hands out overlapping partitions, or a partition and the whole GPU.

What can be offered depends on the MIG mode: with MIG on, partitions only (CUDA cannot use
a whole GPU in MIG mode); with MIG off, the whole GPU, plus the partitions where the GPU
changes MIG mode without a reset (Hopper and newer). Instances that already exist and
were not created by this driver are someone else's: the placements they cover, and the
whole GPU, are not offered.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Iterator

from driver.kube import names
from driver.devices.model import AttributeSet, Device, DeviceKind, PciLocation
from driver.devices.problems import Problems

MEMORY_SLICES = 8
COMPUTE = "compute-slices"
ENGINES = (("copy-engines", "copyEngineCount"), ("decoders", "decoderCount"),
           ("encoders", "encoderCount"), ("jpegs", "jpegCount"), ("ofas", "ofaCount"))
AMPERE = 7  # NVML_DEVICE_ARCH_AMPERE: MIG mode changes need a GPU reset


@dataclass(frozen=True)
class Partition:
    profile: str  # "3g.40gb"
    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_*
    profile_id: int
    start: int
    size: int  # memory slices
    compute_slices: int
    memory_mib: int
    engines: dict[str, int]
    multiprocessors: int


def memory_slice(i: int) -> str:
    return f"memory-slice-{i}"


def device_name(gpu: str, profile: str, start: int) -> str:
    return f"{gpu}-mig-{profile.replace('.', '-').replace('+', '-')}-{start}"


def counter_set_name(gpu: str) -> str:
    return gpu  # one set per GPU, named like the GPU (a DNS label)


def profile_infos(nv: Any, handle: Any) -> Iterator[tuple[int, Any, str]]:
    """(NVML_GPU_INSTANCE_PROFILE_* index, profile info, name such as "3g.40gb") of every
    GPU instance profile the GPU has."""
    for index in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
            continue
        name = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        yield index, info, name.split()[-1]  # "MIG 3g.40gb"


def profiles(nv: Any, handle: Any) -> list[Partition]:
    """Every (profile, placement) NVML reports for the GPU."""
    found = []
    for index, info, profile in profile_infos(nv, handle):
        count = ctypes.c_uint(0)
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, ctypes.byref(count))
        array = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, array, ctypes.byref(count))
        for placement in array[:count.value]:
            found.append(Partition(profile, index, info.id, placement.start, placement.size,
                                   info.sliceCount, info.memorySizeMB,
                                   {counter: getattr(info, field) for counter, field in ENGINES},
                                   info.multiprocessorCount))
    return found


def counters(partitions: list[Partition]) -> dict[str, str]:
    """The GPU's counter set: what its largest partition (the 7g profile) uses is all
    there is of each engine and of compute."""
    largest = max(partitions, key=lambda p: (p.compute_slices, p.size))
    values = {memory_slice(i): "1" for i in range(MEMORY_SLICES)}
    values[COMPUTE] = str(largest.compute_slices)
    values.update({k: str(v) for k, v in largest.engines.items() if v})
    return values


def consumption(partition: Partition) -> dict[str, str]:
    used = {memory_slice(i): "1" for i in range(partition.start, partition.start + partition.size)}
    used[COMPUTE] = str(partition.compute_slices)
    used.update({k: str(v) for k, v in partition.engines.items() if v})
    return used


def partition_devices(
    partitions: list[Partition], gpu: Device, minor: int, location: PciLocation,
    occupied: set[int], problems: Problems, mig_enabled: bool, architecture: int | None,
    offered: frozenset[str] = frozenset(), created: frozenset[tuple[int, int]] = frozenset(),
) -> tuple[list[Device], dict[str, dict[str, str]]] | None:
    """The GPU's offer in dynamic mode, or None where it can only be offered whole (Ampere
    with MIG off: enabling MIG needs a reset). `partitions`: what profiles() reports;
    `occupied`: memory slices of instances this driver did not create. `offered`: the
    profiles to publish (--mig-profiles; empty: all); `created`: (profile id, start) of the
    instances this driver created, published whatever `offered` says, because a claim holds
    each and the scheduler counts its counters only while the device is published. The
    counter set is always the whole GPU's."""
    if not mig_enabled and architecture is not None and architecture <= AMPERE:
        problems.note(gpu.name, "MIG mode is off and this GPU changes it only with a reset: "
                                "offered whole; enable MIG mode (nvidia-smi -mig 1, then a GPU "
                                "reset) to offer its partitions")
        return None
    if not partitions:
        return None
    set_name = counter_set_name(gpu.name)
    devices: list[Device] = []
    if offered:
        unknown = sorted(offered - {p.profile for p in partitions})
        if unknown:
            problems.note(gpu.name, f"--mig-profiles {', '.join(unknown)}: not a profile of this GPU "
                                    f"(it has {', '.join(sorted({p.profile for p in partitions}))})")
    for partition in partitions:
        if offered and partition.profile not in offered and (partition.profile_id, partition.start) not in created:
            continue
        covered = set(range(partition.start, partition.start + partition.size))
        if covered & occupied:
            continue
        name = device_name(gpu.name, partition.profile, partition.start)
        if not names.is_dns_label(name):
            problems.note(gpu.name, f"MIG profile {partition.profile!r} gives no valid device name")
            continue
        attrs = AttributeSet(name)
        attrs.set("type", "mig")
        attrs.set("profile", partition.profile)
        attrs.set("parentUUID", gpu.attributes.get("uuid"))
        for key in ("productName", "brand", "architecture", "cudaComputeCapability",
                    "driverVersion", "cudaDriverVersion", "pciVendorID", "pciDeviceID"):
            if key in gpu.attributes:
                attrs.set(key, gpu.attributes[key])
        attrs.set("parentIndex", gpu.attributes.get("index"))
        attrs.set("parentMinor", minor)
        attrs.set("placementStart", partition.start)
        attrs.set("placementSize", partition.size)
        attrs.pci(location)
        devices.append(Device(
            name=name, kind=DeviceKind.MIG, attributes=attrs.values,
            capacity={"memory": f"{partition.memory_mib}Mi",
                      "multiprocessors": str(partition.multiprocessors),
                      "copyEngines": str(partition.engines["copy-engines"]),
                      "decoders": str(partition.engines["decoders"]),
                      "encoders": str(partition.engines["encoders"])},
            device_nodes=(f"/dev/nvidia{minor}",),  # the capability nodes exist once created
            pci=location,
            model=f"{gpu.model} MIG {partition.profile} @{partition.start}",
            consumes={set_name: consumption(partition)},
        ))
    sets = {set_name: counters(partitions)}
    if not occupied and not mig_enabled:
        # The whole GPU, while nothing is carved out of it: it takes every counter.
        devices.append(Device(gpu.name, gpu.kind, gpu.attributes, gpu.capacity, gpu.device_nodes,
                              pci=gpu.pci, model=gpu.model, consumes={set_name: sets[set_name]}))
    elif occupied:
        problems.note(gpu.name, f"MIG instances not created by this driver hold memory slices "
                                f"{sorted(occupied)}: they are left alone, their placements not offered")
    return devices, sets
