"""`dra-driver capacity`: per node, the largest request of each kind that still fits, and
for the cluster how much free capacity the largest request cannot use (fragmentation).

Every "fits" here is the engine's answer (explain's allocation model, held to the real
allocator by tests/differential.py) for a claim built for that size: a request is sized
up until the engine refuses it, never computed from free counts, so the answer cannot
disagree with the scheduler where explain does not. Each finding keeps the claims of its
largest size and of the next size up, which the engine refused: tools (and the oracle
test) can replay both.

Kinds (a probe each; the label names the variant):
- `gpu`: whole GPUs of the chart's gpu class, by count;
- `gpu-aligned`: the same, all on one PCIe root (`matchAttribute` resource.kubernetes.io/pcieRoot);
- `gpu-nic`: GPU+NIC pairs, each pair on one PCIe root (a pod of n such claims, allocated together);
- `mig`: per MIG profile, by count (static MIG: the free devices; dynamic MIG: whether one
  more fits under the shared counters, so only 1);
- `share-memory` / `share-compute`: per GPU model, the largest share of one shareable GPU
  (consumable capacity), on the device's own request grid (validRange / validValues);
- `fpga`: per FPGA shell (interface ID where a board has no shell attribute), by count.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable

from driver.explain import engine
from driver.explain import world as w
from driver.kube import quantity as quantities
from driver.scheduling.allocator import _canonical

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
MAX_COUNT = engine.MAX_RESULTS  # a claim holds at most 32 results: no count probe goes further


@dataclass(frozen=True)
class Probe:
    """One kind of request on one node: `claims(size)` are the claim specs of that size
    (several: a pod's claims, allocated together); the sizes are `sizes`, else 1, 2, 3..."""

    kind: str
    label: str
    device_class: str
    claims: Callable[[object], list[dict]]
    sizes: tuple | None = None  # the candidate sizes, ascending; None: a count
    unit: str = ""
    # Claims that any allocation of `claims(size)` contains (n GPUs within n GPU+NIC pairs):
    # where the engine refuses one of them, the probe is refused without its own search,
    # whose backtracking across a pod's identical claims is factorial when it fails.
    within: Callable[[object], list[list[dict]]] | None = None
    # The same request pinned to each device (label: the device): what each one holds free
    parts: tuple["Probe", ...] = ()


@dataclass
class Finding:
    kind: str
    label: str
    largest: object | None  # None: not even the smallest size fits
    next_size: object | None  # the next size up (refused by the engine); None: no larger size exists
    device_class: str
    unit: str = ""
    request: list[dict] = field(default_factory=list)  # the claim specs of `largest`
    next_request: list[dict] = field(default_factory=list)  # those of `next_size`
    devices: list[str] = field(default_factory=list)  # what the largest would get (device names)
    parts: dict[str, object] = field(default_factory=dict)  # device -> its own largest (shares)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.label

    def text(self, size=None) -> str:
        size = self.largest if size is None else size
        return "-" if size is None else f"{size}{self.unit}"


@dataclass
class NodeCapacity:
    node: str
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)


@dataclass
class ClusterLine:
    """For one kind: the largest request that fits anywhere, where, and the free capacity it
    cannot use: `free` units in all (what the nodes hold of size-1 requests), `unusable` of
    them not in reach of the largest request."""

    kind: str
    label: str
    largest: object | None
    nodes: list[str]
    free: str
    unusable: str
    unit: str = ""


@dataclass
class Capacity:
    nodes: list[NodeCapacity]
    cluster: list[ClusterLine]
    notes: list[str] = field(default_factory=list)


# -- the engine -------------------------------------------------------------------------------------------
@dataclass
class NodeModel:
    """One node as the engine sees it: its view, devices and what other claims hold."""

    node: str
    world: w.World
    devices: list[w.PoolDevice]
    ledger: object

    @classmethod
    def of(cls, world: w.World, node: str) -> "NodeModel":
        view = world.view(node)
        devices = [w.RememberedDevice.of(d) for d in view.on_node(node)]
        return cls(node, view, devices, engine._ledger(view, devices, None))

    def allocate(self, specs: list[dict]) -> list[dict] | None:
        """The results the engine allocates for these claims together (a pod's claims), or None."""
        claims = [engine.PodClaim(f"capacity/probe-{i}", spec, "default") for i, spec in enumerate(specs)]
        reports = engine._together(claims, self.node, self.world, self.devices, self.ledger)
        if reports is None:
            return None
        return [r for report in reports for r in report.allocation]


# -- probes -----------------------------------------------------------------------------------------------
def _claim(requests: list[dict], constraints: list[dict] | None = None) -> dict:
    devices: dict = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def _exactly(name: str, device_class: str, count: int = 1, selectors: list[str] = (),
             capacity: dict | None = None) -> dict:
    # allocationMode as the API server defaults it: the claims are what a user would apply
    exactly: dict = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": exactly}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _type(device: w.PoolDevice) -> str | None:
    value = device.attribute("type")
    return value if isinstance(value, str) else None


_PROFILE = re.compile(r"^(\d+)g\.(\d+)gb")


def profile_order(profile: str) -> tuple:
    """MIG profiles by size: compute slices, then memory ("3g.40gb" < "4g.40gb" < "7g.80gb"),
    a `+me` variant after its plain profile."""
    match = _PROFILE.match(profile)
    return (int(match.group(1)), int(match.group(2)), profile) if match else (99, 0, profile)


def probes(devices: list[w.PoolDevice], driver: str, classes: dict,
           only_class: str | None = None) -> list[Probe]:
    """The probes that matter for these devices: a kind only where a device of it is
    published, under the chart's class for it (which must exist)."""
    ref = f'device.attributes["{driver}"]'
    gpu, mig, nic, fpga = (f"{kind}.{driver}" for kind in ("gpu", "mig", "nic", "fpga"))
    mine = [d for d in devices if d.driver == driver]
    by_type: dict[str, list[w.PoolDevice]] = {}
    for device in mine:
        by_type.setdefault(_type(device) or "", []).append(device)
    out: list[Probe] = []
    gpus = by_type.get("gpu", [])
    if gpus and gpu in classes:
        out.append(Probe("gpu", "whole GPUs", gpu, lambda n: [_claim([_exactly("gpu", gpu, n)])]))
        if any(d.attribute(PCIE_ROOT) is not None for d in gpus):
            out.append(Probe("gpu-aligned", "whole GPUs on one PCIe root", gpu,
                             lambda n: [_claim([_exactly("gpu", gpu, n)], [{"matchAttribute": PCIE_ROOT}])]))
        nics = by_type.get("nic", [])
        if nics and nic in classes and any(d.attribute(PCIE_ROOT) is not None for d in gpus) and \
                any(d.attribute(PCIE_ROOT) is not None for d in nics):
            def pairs(n: int) -> list[dict]:  # each its own object: YAML output has no aliases
                return [_claim([_exactly("gpu", gpu), _exactly("nic", nic)], [{"matchAttribute": PCIE_ROOT}])
                        for _ in range(n)]
            out.append(Probe("gpu-nic", "GPU+NIC pairs, each on one PCIe root", gpu, pairs,
                             within=lambda n: [[_claim([_exactly("gpu", gpu, n)])],
                                               [_claim([_exactly("nic", nic, n)])]]))
        models = {m for d in gpus if d.multiple and d.capacity and isinstance(m := d.attribute("productName"), str)}
        for model in sorted(models):
            shareable = [d for d in gpus if d.multiple and d.attribute("productName") == model]
            out += _share_probes(shareable, gpu, [f'"productName" in {ref} && {ref}.productName == {_quote(model)}'],
                                 model, ref)
    migs = by_type.get("mig", [])
    if migs and mig in classes:
        for profile in sorted({p for d in migs if isinstance(p := d.attribute("profile"), str)}, key=profile_order):
            chosen = [d for d in migs if d.attribute("profile") == profile]
            selector = f"{ref}.profile == {_quote(profile)}"
            dynamic = any(d.consumes for d in chosen)
            # Dynamic MIG: one instance each, the node's answer is the largest profile (_collapse).
            out.append(Probe("mig-dynamic" if dynamic else "mig", profile, mig,
                             lambda n, s=selector: [_claim([_exactly("mig", mig, n, [s])])],
                             sizes=(1,) if dynamic else None))
    fpgas = by_type.get("fpga", [])
    if fpgas and fpga in classes:
        for attribute, guard in (("shell", ""), ("interfaceID", f'!("shell" in {ref}) && ')):
            shells = sorted({s for d in fpgas if isinstance(s := d.attribute(attribute), str)})
            for shell in shells:
                selector = f'{guard}"{attribute}" in {ref} && {ref}.{attribute} == {_quote(shell)}'
                out.append(Probe("fpga", f"{attribute} {shell}", fpga,
                                 lambda n, s=selector: [_claim([_exactly("fpga", fpga, n, [s])])]))
            fpgas = [d for d in fpgas if d.attribute(attribute) is None]  # a board with a shell: not again
    if only_class is not None:
        out = [p for p in out if p.device_class == only_class]
    return out


def _share_probes(devices: list[w.PoolDevice], device_class: str, selectors: list[str], model: str,
                  ref: str) -> list[Probe]:
    """share-memory and share-compute on GPUs of one model: the other capacities at their
    smallest valid request, so that the probe measures one of them at a time; and the same
    pinned to each GPU (by its uuid, else its PCI address), for what each holds free."""
    out = []
    names = sorted({n for d in devices for n in d.capacity})
    for name in ("memory", "compute"):
        if name not in names:
            continue
        grid = share_grid([d.capacity[name] for d in devices if name in d.capacity])
        if not grid:
            continue
        least = {other: smallest for other in names if other != name
                 and (smallest := _smallest(devices[0].capacity.get(other))) is not None}

        def claims(size, name=name, least=least, selectors=selectors):
            return [_claim([_exactly("share", device_class, 1, selectors, {**least, name: size})])]
        unit = "" if name == "memory" else "%" if _compute_is_percent(devices, name) else ""
        parts = []
        for device in devices:
            pin = _pin(device, ref)
            if pin is not None:
                parts.append(Probe(f"share-{name}", device.name, device_class,
                                   functools.partial(claims, selectors=[*selectors, pin]), sizes=tuple(grid),
                                   unit=unit))
        out.append(Probe(f"share-{name}", model, device_class, claims, sizes=tuple(grid), unit=unit,
                         parts=tuple(parts)))
    return out


def _pin(device: w.PoolDevice, ref: str) -> str | None:
    """A selector that only this device passes (among those the driver publishes)."""
    uuid = device.attribute("uuid")
    if isinstance(uuid, str):
        return f'"uuid" in {ref} && {ref}.uuid == {_quote(uuid)}'
    bus = device.attribute("resource.kubernetes.io/pciBusID")
    if isinstance(bus, str):
        common = 'device.attributes["resource.kubernetes.io"]'
        return f'"pciBusID" in {common} && {common}.pciBusID == {_quote(bus)}'
    return None


def _compute_is_percent(devices: list[w.PoolDevice], name: str) -> bool:
    return all(quantities.value(d.capacity[name]["value"]) == 100 for d in devices if name in d.capacity)


def _smallest(entry: dict | None) -> str | None:
    if not entry:
        return None
    policy = entry.get("requestPolicy") or {}
    if policy.get("validValues"):
        return min(policy["validValues"], key=lambda v: quantities.value(str(v)))
    if (policy.get("validRange") or {}).get("min") is not None:
        return str(policy["validRange"]["min"])
    return None


def share_grid(entries: list[dict], steps_without_policy: int = 64) -> list[str]:
    """The sizes a share may ask for, ascending, up to the largest device's total: its
    validValues, the multiples of its validRange step, or (no policy) 1/64ths of the total."""
    totals = [quantities.value(str(e["value"])) for e in entries]
    top = max(totals)
    policy = entries[0].get("requestPolicy") or {}
    if policy.get("validValues"):
        values = sorted({quantities.value(str(v)) for v in policy["validValues"]})
        return [_canonical(v) for v in values if v <= top]
    valid = policy.get("validRange") or {}
    if valid.get("step") is not None or valid.get("min") is not None:
        low = quantities.value(str(valid.get("min", "0")))
        step = quantities.value(str(valid.get("step", "1")))
        high = min(top, quantities.value(str(valid["max"]))) if valid.get("max") is not None else top
        if step <= 0:
            return [_canonical(low)]
        start = low if low > 0 else step
        count = int((high - start) // step) + 1
        return [_canonical(start + i * step) for i in range(max(count, 0))]
    return [_canonical(top * Decimal(i) / steps_without_policy) for i in range(1, steps_without_policy + 1)]


# -- the search -------------------------------------------------------------------------------------------
def largest(model: NodeModel, probe: Probe) -> Finding:
    """The largest size of this probe that the engine allocates on the node, and the next
    size up, which it does not."""
    finding = Finding(probe.kind, probe.label, None, None, probe.device_class, probe.unit)

    def attempt(size) -> list[dict] | None:
        if probe.within is not None and any(model.allocate(part) is None for part in probe.within(size)):
            return None
        return model.allocate(probe.claims(size))

    if probe.sizes is None:  # a count: up from 1 until refused
        best, results = None, None
        for n in range(1, MAX_COUNT + 1):
            got = attempt(n)
            if got is None:
                break
            best, results = n, got
        finding.largest = best
        nxt = (best or 0) + 1
        finding.next_size = nxt if nxt <= MAX_COUNT else None
    else:
        sizes = probe.sizes
        low, high = -1, len(sizes)  # sizes[low] fits (or none), sizes[high] does not (or past the end)
        results = None
        # Binary search on the grid: a smaller share fits wherever a larger one does.
        while high - low > 1:
            middle = (low + high) // 2
            got = attempt(sizes[middle])
            if got is None:
                high = middle
            else:
                low, results = middle, got
        finding.largest = sizes[low] if low >= 0 else None
        finding.next_size = sizes[high] if high < len(sizes) else None
    if finding.largest is not None:
        finding.request = probe.claims(finding.largest)
        finding.devices = [r["device"] for r in results or []]
    if finding.next_size is not None:
        finding.next_request = probe.claims(finding.next_size)
    for part in probe.parts:
        finding.parts[part.label] = largest(model, part).largest
    return finding


def node_capacity(world: w.World, node: str, driver: str, only_class: str | None = None) -> NodeCapacity:
    model = NodeModel.of(world, node)
    findings = [largest(model, probe) for probe in probes(model.devices, driver, world.classes, only_class)]
    return NodeCapacity(node, _collapse(findings))


def _collapse(findings: list[Finding]) -> list[Finding]:
    """Dynamic MIG probes each ask for one instance of a profile: the node's answer is the
    largest profile that fits, and the next larger one (which does not)."""
    dynamic = [f for f in findings if f.kind == "mig-dynamic"]
    if not dynamic:
        return findings
    ordered = sorted(dynamic, key=lambda f: profile_order(f.label))
    fitting = [f for f in ordered if f.largest is not None]
    best = fitting[-1] if fitting else None
    above = [f for f in ordered if best is None or profile_order(f.label) > profile_order(best.label)]
    merged = Finding("mig-largest", "largest MIG profile", best.label if best else None,
                     above[0].label if above else None, ordered[0].device_class,
                     request=best.request if best else [], devices=best.devices if best else [],
                     # (a profile that does not fit kept its claim as the next size up)
                     next_request=(above[0].request or above[0].next_request) if above else [])
    return [merged] + [f for f in findings if f not in dynamic]


# -- the cluster ------------------------------------------------------------------------------------------
def cluster_lines(nodes: list[NodeCapacity]) -> list[ClusterLine]:
    """Per kind, the largest anywhere and the free capacity it cannot use: counts add up
    over nodes (each node's largest count is what it holds of that kind, as the engine
    placed them); a share's free amount is each node's largest share per model."""
    keys: dict[tuple[str, str], list[tuple[str, Finding]]] = {}
    for node in nodes:
        for finding in node.findings:
            keys.setdefault(finding.key, []).append((node.node, finding))
    free_gpus = {node.node: next((f.largest or 0 for f in node.findings if f.kind == "gpu"), 0) for node in nodes}
    lines = []
    for (kind, label), found in keys.items():
        unit = found[0][1].unit
        if kind == "mig-largest":
            placed = [(n, f) for n, f in found if f.largest is not None]
            best = max((f.largest for _, f in placed), key=profile_order, default=None)
            where = [n for n, f in placed if f.largest == best]
            short = [n for n, f in placed if f.largest != best]
            lines.append(ClusterLine(kind, label, best, where, f"{len(placed)} node(s) with a profile free",
                                     f"{len(short)} node(s) only smaller profiles", unit))
            continue
        if kind.startswith("share-"):
            # free: what each GPU holds (its own largest share); the largest share takes one GPU's
            values = [(n, f.largest) for n, f in found if f.largest is not None]
            best = max((v for _, v in values), key=lambda v: quantities.value(str(v)), default=None)
            where = [n for n, v in values if v == best]
            held = [quantities.value(str(v)) for _, f in found for v in f.parts.values() if v is not None]
            total = sum(held, Decimal(0))
            rest = total - (quantities.value(str(best)) if best is not None else 0)
            lines.append(ClusterLine(kind, label, best, where, f"{_canonical(total)}{unit} on {len(held)} GPU(s)",
                                     f"{_canonical(max(rest, Decimal(0)))}{unit} not in it", unit))
            continue
        counts = [(n, f.largest or 0) for n, f in found]
        best = max((c for _, c in counts), default=0)
        where = [n for n, c in counts if c == best and best > 0]
        if kind in ("gpu-aligned", "gpu-nic"):
            free = sum(free_gpus.get(n, 0) for n, _ in counts)
            noun = "free GPUs"
        else:
            free = sum(c for _, c in counts)
            noun = "free"
        lines.append(ClusterLine(kind, label, best or None, where, f"{free} {noun}", f"{max(free - best, 0)} not in it",
                                 unit))
    return lines


def capacity(world: w.World, driver: str, nodes: list[str] | None = None,
             only_class: str | None = None) -> Capacity:
    per_node = [node_capacity(world, node, driver, only_class) for node in (nodes or world.nodes())]
    return Capacity(per_node, cluster_lines(per_node), list(world.notes))


def capacity_per_node(node_worlds, driver: str, only_class: str | None = None) -> Capacity:
    """As capacity(), from one world per node (capacity_inputs.per_node): a node whose
    content is that of a node already answered gets its answer, under its own name."""
    answered: dict[str, NodeCapacity] = {}
    per_node, notes = [], []
    for item in node_worlds:
        done = answered.get(item.key)
        if done is None:
            done = answered[item.key] = node_capacity(item.world, item.node, driver, only_class)
            notes += [n for n in item.world.notes if n not in notes]
        per_node.append(NodeCapacity(item.node, done.findings, done.notes))
    return Capacity(per_node, cluster_lines(per_node), notes)
