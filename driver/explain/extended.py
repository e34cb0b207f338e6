"""A pod's extended resources (`resources.limits: nvidia.com/gpu: 1`) as the scheduler turns
them into a ResourceClaim (KEP-5004, feature gate DRAExtendedResource: alpha 1.34, beta 1.36,
GA 1.37; on by default from the beta), so that `explain -f pod.yaml` answers for the claim
the scheduler would make.

The rules are upstream's (kube-scheduler's dynamicresources plugin and the DeviceClass
extended-resource cache of k8s.io/dynamic-resource-allocation, v1.37):

- a resource name is served by DRA when a DeviceClass maps it: explicitly through
  `spec.extendedResourceName` (two classes naming one resource: the newer class wins, on
  a tie the lower name), or implicitly as `deviceclass.resource.kubernetes.io/<class>`;
- on a node whose `status.allocatable` lists the name with a non-zero count a device
  plugin serves it there and the claim leaves it out; a name no class maps and the node
  does not list makes the node unschedulable ("Insufficient …");
- one request per container and resource, named `container-<i>-request-<j>`: i indexes
  initContainers then containers, j the resource's position among the container's sorted
  request names; `exactly`, ExactCount, the container's request as count; no config;
- a non-sidecar init container runs before the others: its need is met first from the
  requests of the containers that follow it, and of the init containers' own requests only
  the largest is kept (the others are mapped to it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from driver.explain import world as w
from driver.explain.verdicts import Explanation, NodeReport
from driver.kube import quantity

IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"
CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"

# kind -> the path from the object to its pod spec
POD_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": ("spec",),
    "PodTemplate": ("template", "spec"),
    "Deployment": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "ReplicationController": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}

_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class ExtendedResourceError(ValueError):
    """A pod's resources the API server would refuse; the message names the object,
    container and resource."""


@dataclass(frozen=True)
class Container:
    name: str
    requests: dict[str, int]  # extended resources only, count > 0
    all_request_names: tuple[str, ...]  # every resource the container requests, sorted
    short_lived: bool  # an init container that is not a sidecar (restartPolicy Always)


@dataclass
class PodResources:
    """The extended resources of one pod spec (a Pod, or a workload's pod template)."""

    kind: str
    namespace: str
    name: str
    containers: list[Container]
    origin: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    def names(self) -> set[str]:
        return {r for c in self.containers for r in c.requests}


@dataclass
class ScheduledClaim:
    """The claim the scheduler makes for a pod on a node: its requests and which container
    and resource each serves (the pod's status.extendedResourceClaimStatus.requestMappings)."""

    requests: list[dict] = field(default_factory=list)
    mappings: list[dict] = field(default_factory=list)

    def spec(self) -> dict:
        return {"devices": {"requests": self.requests}}


def is_extended(name: str) -> bool:
    """Whether the scheduler treats a resource name as an extended resource DRA may serve
    (upstream's IsDRAExtendedResourceName)."""
    if name.startswith(IMPLICIT_PREFIX):
        return True
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False  # native: cpu, memory, hugepages-*, *kubernetes.io/*
    prefix, _, base = name.partition("/")
    return (len(prefix) <= 253 - len("requests.") and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
            and bool(_QUALIFIED_NAME.fullmatch(base)))


def class_mapping(classes: dict[str, w.DeviceClass]) -> dict[str, str]:
    """resource name -> DeviceClass name, as the scheduler's cache resolves it."""
    out = {IMPLICIT_PREFIX + name: name for name in classes}
    claimed: dict[str, list[w.DeviceClass]] = {}
    for c in sorted(classes.values(), key=lambda c: c.name):
        if c.extended_resource_name:
            claimed.setdefault(c.extended_resource_name, []).append(c)
    # the newest creationTimestamp (RFC 3339 text sorts by time); max() keeps the first of
    # equals, which the name order above makes the lower name
    out.update({resource: max(cs, key=lambda c: c.created).name for resource, cs in claimed.items()})
    return out


def pods_in(objects: list[dict], origin: str, default_namespace: str) -> list[PodResources]:
    """The pod specs of a file (Pods and workloads) that ask for extended resources."""
    found = []
    for obj in objects:
        path = POD_SPEC_PATHS.get(obj.get("kind", ""))
        if path is None:
            continue
        meta = obj.get("metadata") or {}
        where = f"{obj['kind']} {meta.get('name', '?')}"
        spec: object = obj
        for key in path:
            spec = spec.get(key) if isinstance(spec, dict) else None
        if not isinstance(spec, dict):
            continue
        pod = PodResources(obj["kind"], meta.get("namespace") or default_namespace,
                           meta.get("name", "?"), _containers(spec, where), origin)
        if pod.names():
            found.append(pod)
    return found


def _containers(spec: dict, where: str) -> list[Container]:
    out = []
    for field_name in ("initContainers", "containers"):
        for c in spec.get(field_name) or []:
            if not isinstance(c, dict):
                raise ExtendedResourceError(f"{where}: {field_name} holds a non-object")
            name = c.get("name", "?")
            resources = c.get("resources") or {}
            requests = dict(resources.get("requests") or {})
            limits = resources.get("limits") or {}
            for resource, limit in limits.items():
                if resource not in requests:  # the API server defaults a request to its limit
                    requests[resource] = limit
                elif is_extended(resource) and _count(requests[resource], where, name, resource) != \
                        _count(limit, where, name, resource):
                    raise ExtendedResourceError(
                        f"{where}: container {name}: {resource}: request {requests[resource]} and limit "
                        f"{limit} differ (the API server requires them equal for an extended resource)")
            extended = {r: _count(v, where, name, r) for r, v in requests.items() if is_extended(r)}
            out.append(Container(name, {r: n for r, n in extended.items() if n > 0},
                                 tuple(sorted(requests)),
                                 field_name == "initContainers" and c.get("restartPolicy") != "Always"))
    return out


def _count(text: object, where: str, container: str, resource: str) -> int:
    try:
        value, _ = quantity.parse(str(text))
    except (ValueError, InvalidOperation):
        raise ExtendedResourceError(f"{where}: container {container}: {resource}: {text!r} is not "
                                    "a quantity") from None
    if value != value.to_integral_value() or value < 0:
        raise ExtendedResourceError(f"{where}: container {container}: {resource}: {text} is not a whole "
                                    "number (extended resources are counted in units)")
    return int(value)


def scheduled_claim(pod: PodResources, resources: dict[str, str]) -> ScheduledClaim:
    """The claim for `resources` (name -> DeviceClass), the ones DRA serves on a node."""
    out = ScheduledClaim()
    containers = pod.containers
    for resource in sorted(resources):
        device_class = resources[resource]
        long_requests: list[dict | None] = [None] * len(containers)
        long_mappings: list[dict] = []
        for i, c in enumerate(containers):
            if not c.short_lived:
                long_requests[i], maps = _request(i, c, resource, device_class, [])
                long_mappings += maps
        largest: dict | None = None
        short_names: set[str] = set()
        short_mappings: list[dict] = []
        for i, c in enumerate(containers):
            if not c.short_lived:
                continue
            # what runs after this init container (sidecars after it, the app containers) is
            # allocated anyway: its devices serve the init container first
            request, maps = _request(i, c, resource, device_class, long_requests[i:])
            if request is not None:
                short_names.add(request["name"])
                if largest is None or largest["exactly"]["count"] < request["exactly"]["count"]:
                    largest = request
            short_mappings += maps
        if largest is not None and len(short_names) > 1:
            for m in short_mappings:
                if m["requestName"] in short_names:
                    m["requestName"] = largest["name"]
        if largest is not None:
            out.requests.append(largest)
        out.requests += [r for r in long_requests if r is not None]
        out.mappings += long_mappings + short_mappings
    out.requests.sort(key=lambda r: r["name"])
    return out


def _request(index: int, c: Container, resource: str, device_class: str,
             reusable: list[dict | None]) -> tuple[dict | None, list[dict]]:
    need = c.requests.get(resource, 0)
    if need == 0:
        return None, []
    mappings = []
    covered = 0
    for r in reusable:
        if r is None:
            continue
        covered += r["exactly"]["count"]
        mappings.append({"containerName": c.name, "resourceName": resource, "requestName": r["name"]})
        if covered >= need:
            return None, mappings
    name = f"container-{index}-request-{c.all_request_names.index(resource)}"
    mappings.append({"containerName": c.name, "resourceName": resource, "requestName": name})
    return ({"name": name, "exactly": {"deviceClassName": device_class, "allocationMode": "ExactCount",
                                       "count": need - covered}}, mappings)


@dataclass(frozen=True)
class NodeView:
    """What one node does with the pod's extended resources."""

    dra: dict[str, str]  # resource -> class: the scheduler's claim asks for these
    device_plugin: dict[str, str]  # resource -> what status.allocatable lists
    missing: tuple[str, ...]  # no class maps them and the node does not list them


def node_view(pod: PodResources, mapping: dict[str, str], allocatable: dict[str, str] | None) -> NodeView:
    """allocatable None: the node's status is unknown (no Node object): its allocatable is
    taken as listing none of the names, which is what a node without a device plugin shows."""
    dra: dict[str, str] = {}
    plugin: dict[str, str] = {}
    missing = []
    for resource in sorted(pod.names()):
        listed = (allocatable or {}).get(resource)
        amount = _amount(listed)
        if resource in mapping and not amount:
            dra[resource] = mapping[resource]
        elif listed is None:
            missing.append(resource)
        else:
            plugin[resource] = listed
    return NodeView(dra, plugin, tuple(missing))


def _amount(listed: str | None) -> Decimal:
    if listed is None:
        return Decimal(0)
    try:
        return quantity.value(str(listed))
    except (ValueError, InvalidOperation):
        return Decimal(0)


def explain_pod(pod: PodResources, world: w.World, nodes: list[str] | None = None) -> Explanation:
    """The scheduler's claim for the pod's extended resources, explained on every node: a
    node where a device plugin lists a resource gets a claim without it; a node where a
    resource is neither mapped nor listed does not fit ("Insufficient …", the scheduler's
    NodeResourcesFit reason)."""
    from driver.explain import engine

    mapping = class_mapping(world.classes)
    ref = f"{pod.namespace}/{pod.name}-extended-resources"
    source = f"the scheduler's claim for {pod.kind} {pod.name}, from {pod.origin}"
    everywhere = scheduled_claim(pod, {r: mapping[r] for r in pod.names() if r in mapping})
    notes: list[str] = []
    for resource in sorted(pod.names() - set(mapping)):
        notes.append(f"{resource}: no DeviceClass serves it (none names it in spec.extendedResourceName); "
                     "only a device plugin that lists it in a node's status.allocatable can")
    if not world.allocatable:
        notes.append("no Node objects: nodes are taken to list none of these resources in "
                     "status.allocatable, as nodes without a device plugin do")
    reports: list[NodeReport] = []
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for node in nodes if nodes is not None else world.nodes():
        view = node_view(pod, mapping, world.allocatable.get(node))
        for resource, listed in view.device_plugin.items():
            notes.append(f"node {node}: status.allocatable lists {resource}: {listed}: a device plugin "
                         "serves it there, not a claim (its free count is not checked here)")
        if view.missing:
            reports.append(NodeReport(node, False, f"Insufficient {', '.join(view.missing)}: no DeviceClass "
                                                   "serves it and the node does not list it in status.allocatable",
                                      fits_when_free=False))
        elif not view.dra:
            reports.append(NodeReport(node, True, "", fits_when_free=True))  # a device plugin's resources only
        else:
            groups.setdefault(tuple(sorted(view.dra.items())), []).append(node)
    suggestions: list[str] = []
    for served, group in groups.items():
        claim = scheduled_claim(pod, dict(served))
        result = engine.explain(ref, claim.spec(), world, pod.namespace, group, source=source)
        reports += result.nodes
        suggestions += [s for s in result.suggestions if s not in suggestions]
    reports.sort(key=lambda r: r.node)
    return Explanation(ref, source, reports, suggestions, list(world.notes) + notes,
                       scheduled={"requests": everywhere.requests, "mappings": everywhere.mappings})
