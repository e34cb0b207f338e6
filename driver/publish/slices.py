"""Inventory -> ResourceSlice bodies, for each resource.k8s.io version we publish with.

Devices are grouped by kind and cut into chunks in name order, and each slice has a fixed
name (node, driver, rank, kind, chunk). A change to one NIC therefore touches the NIC slices
and leaves the GPU slices byte-identical, which is what keeps the publisher's writes minimal.

The rank is there for the scheduler. Upstream's allocator sorts a pool's slices by name and
walks their devices in that order, evaluating the class and request selectors on each until
one fits, and every evaluation converts all of the device's attributes for CEL. So the name
order is the order in which our devices cost the scheduler time: small groups that most
claims ask for come first (whole GPUs, static MIG, NICs, FPGAs), the hundreds of dynamic MIG
placements last, where only MIG requests walk them (bench/alloccost.py measures it).

Within a kind, devices that come and go together stay in one slice: an SR-IOV PF and its
VFs (the kernel adds and removes VFs when the PF's sriov_numvfs changes). A VF added or
removed then changes only its PF's slice, which the publisher writes alone, in place (see
driver/publish/publisher.py), instead of moving every later device into the next slice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from driver.kube import names, quantity
from driver.kube.client import API_GROUP, API_VERSIONS
from driver.devices.model import AttributeValue, Device, DeviceKind, Inventory, Version

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64  # from 1.35, when any device of the slice has taints

# --gpu-sharing: how whole GPUs are published.
EXCLUSIVE, CONSUMABLE = "exclusive", "consumable"
GPU_SHARING_MODES = (EXCLUSIVE, CONSUMABLE)
COMPUTE = "compute"  # consumable capacity: percent of the GPU's SMs (100 = all of it)

# Partitionable devices (KEP-4815): where their counters go, by API server version.
COMBINED, SPLIT = "combined", "split"  # 1.34: counters beside devices; 1.35+: own slices
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_DEVICES_WITH_COUNTERS = 64
MEMORY_STEP = 1 << 30  # shares of GPU memory come in whole GiB


@dataclass(frozen=True)
class PoolIdentity:
    driver: str
    node_name: str
    node_uid: str | None = None  # owner reference, so slices go when the Node goes


def attribute_value(value: AttributeValue) -> dict:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.value}
    return {"string": value}


def consumable(device: Device, api_version: str) -> bool:
    """Whether `device` is published for several allocations (KEP-5075): whole GPUs in
    consumable mode, with a server that has the fields (v1beta1 of 1.32/1.33 does not)."""
    return device.kind is DeviceKind.GPU and api_version != "v1beta1" and "memory" in device.capacity


def consumable_capacity(device: Device) -> dict:
    """memory and compute, each with a request policy. A claim that asks for nothing gets
    all the memory, so the GPU stays its own. A claim that asks only for memory reserves
    no compute (default 0): with the whole GPU's compute as the default, a memory-only
    share took all 100 and nothing else fitted beside it. Such a share is not capped in SMs
    either; it competes for them as any MPS client does (docs/sharing.md)."""
    memory = int(quantity.value(device.capacity["memory"]))
    # The default must be min + n*step: the largest whole GiB. What is left below one GiB
    # cannot be requested by anyone (the minimum is 1Gi), so the GPU stays unshared.
    default_memory = max(MEMORY_STEP, memory - memory % MEMORY_STEP)
    capacity = {key: {"value": q} for key, q in device.capacity.items()}
    capacity["memory"]["requestPolicy"] = {
        "default": _binary(default_memory),
        "validRange": {"min": "1Gi", "step": "1Gi"},
    }
    capacity[COMPUTE] = {"value": "100", "requestPolicy": {
        "default": "0", "validRange": {"min": "0", "step": "1"}}}
    return dict(sorted(capacity.items()))


def _binary(size: int) -> str:
    return quantity.canonical(f"{size >> 20}Mi") if size % (1 << 20) == 0 else str(size)


def device_body(device: Device, api_version: str, taints: Sequence[dict] = (),
                sharing: str = EXCLUSIVE) -> dict:
    attributes = {key: attribute_value(v) for key, v in sorted(device.attributes.items())}
    shared = sharing == CONSUMABLE and consumable(device, api_version)
    if shared:
        capacity = consumable_capacity(device)
    else:
        capacity = {key: {"value": q} for key, q in sorted(device.capacity.items())}
    fields: dict = {}
    if attributes:
        fields["attributes"] = attributes
    if capacity:
        fields["capacity"] = capacity
    if shared:
        fields["allowMultipleAllocations"] = True
    if device.consumes:
        fields["consumesCounters"] = [
            {"counterSet": name, "counters": {k: {"value": v} for k, v in sorted(used.items())}}
            for name, used in sorted(device.consumes.items())]
    if taints:
        fields["taints"] = [dict(t) for t in taints]
    if api_version == "v1beta1":
        return {"name": device.name, "basic": fields}
    return {"name": device.name, **fields}


# The order of a pool's slices (see the module's docstring): whole GPUs; whole GPUs that
# share counters with their dynamic MIG placements ("parents"); static MIG; NICs; FPGAs; the
# placements; counter sets (no devices).
SLICE_RANKS = {DeviceKind.GPU.value: 0, "parents": 1, DeviceKind.MIG.value: 2, DeviceKind.NIC.value: 3,
               DeviceKind.FPGA.value: 4, "partitions": 5, "counters": 6}


def slice_name(pool: PoolIdentity, kind: DeviceKind | str, index: int) -> str:
    """A DNS subdomain: `<node>-<driver>-<rank>-<kind>-<n>`, hashed down when it would not
    fit; names sort in SLICE_RANKS order within a pool either way."""
    kind = kind.value if isinstance(kind, DeviceKind) else kind
    label = f"{SLICE_RANKS[kind]}-{kind}-{index}"
    name = f"{pool.node_name}-{pool.driver}-{label}".lower()
    if names.is_dns_subdomain(name):
        return name
    digest = hashlib.sha256(f"{pool.node_name}/{pool.driver}".encode()).hexdigest()[:16]
    name = f"{digest}-{label}"
    assert names.is_dns_subdomain(name)
    return name


def build(
    inventory: Inventory,
    pool: PoolIdentity,
    generation: int,
    api_version: str = "v1",
    taints: Mapping[str, Sequence[dict]] | None = None,
    sharing: str = EXCLUSIVE,
    layout: str | None = SPLIT,
    body: Callable[[Device, str, Sequence[dict], str], dict] | None = None,
) -> list[dict]:
    """The complete set of slices for the node's pool at one generation. `layout`: where
    partitionable devices' counters go (COMBINED for 1.34 servers, SPLIT from 1.35); None
    where the server has no shared counters: such devices are left out. `body`: what
    makes a device's entry (device_body; the publisher passes one that remembers)."""
    body = body or device_body
    if api_version not in API_VERSIONS:
        raise ValueError(f"unsupported resource.k8s.io version {api_version!r}")
    taints = taints or {}
    chunks: list[tuple[str, int, tuple[Device, ...], tuple[str, ...]]] = []
    for kind in DeviceKind:
        devices = tuple(d for d in inventory.by_kind(kind) if not d.consumes)
        limit = MAX_DEVICES_WITH_TAINTS if any(taints.get(d.name) for d in devices) else MAX_DEVICES
        for index, chunk in enumerate(_pack(devices, limit)):
            chunks.append((kind.value, index, chunk, ()))
    if layout is not None:
        chunks += _partitionable(inventory, layout)
    # Nothing to publish: no slice at all (an empty one only adds an object per node for
    # every scheduler and controller to watch); the publisher deletes what was there.
    owner = []
    if pool.node_uid:
        owner = [{"apiVersion": "v1", "kind": "Node", "name": pool.node_name,
                  "uid": pool.node_uid, "controller": True}]
    slices = []
    for kind, index, devices, counter_sets in chunks:
        # No labels: the field selectors spec.nodeName and spec.driver find our slices.
        metadata: dict = {"name": slice_name(pool, kind, index)}
        if owner:
            metadata["ownerReferences"] = owner
        spec: dict = {
            "driver": pool.driver,
            "nodeName": pool.node_name,
            "pool": {"name": pool.node_name, "generation": generation,
                     "resourceSliceCount": len(chunks)},
        }
        if counter_sets:
            spec["sharedCounters"] = [
                {"name": name, "counters": {k: {"value": v} for k, v in sorted(
                    inventory.counter_sets[name].items())}} for name in counter_sets]
        if devices or not counter_sets:
            spec["devices"] = [body(d, api_version, taints.get(d.name, ()), sharing) for d in devices]
        slices.append({"apiVersion": f"{API_GROUP}/{api_version}", "kind": "ResourceSlice",
                       "metadata": metadata, "spec": spec})
    return slices


def family(device: Device) -> str:
    """What a device comes and goes with: a VF with its PF (both keyed by the PF's PCI
    address); any other device is a family of its own."""
    if device.kind is DeviceKind.NIC:
        pf = device.attributes.get("pfPciBusID")
        if isinstance(pf, str):
            return f"pci:{pf}"
        if device.pci is not None:
            return f"pci:{device.pci.bus_id}"
    return f"name:{device.name}"


def _pack(devices: Sequence[Device], limit: int) -> list[tuple[Device, ...]]:
    """Chunks of at most `limit` devices, in name order, that do not split a family unless
    it alone is larger than a slice. A family is placed where its first device (by name)
    falls; with families of one device this is plain name order."""
    families: dict[str, list[Device]] = {}
    for device in devices:
        families.setdefault(family(device), []).append(device)
    chunks: list[tuple[Device, ...]] = []
    current: list[Device] = []
    for members in families.values():
        if len(current) + len(members) > limit and current:
            chunks.append(tuple(current))
            current = []
        while len(members) > limit:  # larger than a slice: whole slices of its own first
            chunks.append(tuple(members[:limit]))
            members = members[limit:]
        current += members
    if current:
        chunks.append(tuple(current))
    return chunks


def _partitionable(inventory: Inventory, layout: str) -> list[tuple[str, int, tuple[Device, ...], tuple[str, ...]]]:
    """Slices of partitionable devices: per counter set one slice with its devices (1.34),
    or counters-only slices of <= 8 sets plus device slices of <= 64 devices (1.35+)."""
    devices = tuple(d for d in inventory.devices if d.consumes)
    sets = sorted(inventory.counter_sets)
    if not devices:
        return []
    if layout == COMBINED:
        return [("partitions", i, tuple(d for d in devices if name in d.consumes), (name,))
                for i, name in enumerate(sets)]
    chunks = [("counters", i, (), tuple(sets[start:start + MAX_COUNTER_SETS_PER_SLICE]))
              for i, start in enumerate(range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE))]
    # Device slices follow the counter sets' order, so that one GPU's partitions stay together
    # (first fit then fills one GPU before the next). The whole GPUs go in slices of their own
    # ranked ahead of the placements: a claim for a whole GPU finds one after at most the
    # other whole GPUs, instead of after every placement of each GPU before it.
    ordered = sorted(devices, key=lambda d: (sorted(d.consumes), d.name))
    for label, group in (("parents", [d for d in ordered if d.kind is DeviceKind.GPU]),
                         ("partitions", [d for d in ordered if d.kind is not DeviceKind.GPU])):
        chunks += [(label, i, tuple(group[start:start + MAX_DEVICES_WITH_COUNTERS]), ())
                   for i, start in enumerate(range(0, len(group), MAX_DEVICES_WITH_COUNTERS))]
    return chunks
