"""The pods of `explain -f FILE` that name several claims (spec.resourceClaims): the scheduler
allocates all of a pod's claims in one go, each beside the devices of the ones before and
backtracking across them, so a claim that fits alone may not fit beside its pod's others,
and the others may choose differently to leave it room. Such claims are explained together
(engine.explain_pod), not one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from driver.explain import world as w
from driver.explain.extended import POD_SPEC_PATHS
from driver.explain.sources import Claim, SourceError
from driver.scheduling import taints


@dataclass(frozen=True)
class PodClaims:
    """A pod spec (a Pod, or a workload's template) and its claims, in its order."""

    kind: str
    namespace: str
    name: str
    claims: list[Claim]  # a template's entry as the claim the API server makes from it
    named: list[Claim]  # the claims and templates of the file that it names
    node_selector: dict = field(default_factory=dict)
    required_affinity: dict | None = None  # nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution
    tolerations: list[dict] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def pods_with_claims(objects: list[dict], claims: list[Claim], origin: str,
                     default_namespace: str) -> list[PodClaims]:
    """The pod specs of a file that name two or more claims, each resolved to a claim or
    template of the same file and namespace. A name that is not there is an error that
    names the pod and the entry: the pod could never be scheduled as written."""
    found = []
    for obj in objects:
        path = POD_SPEC_PATHS.get(obj.get("kind", ""))
        if path is None:
            continue
        meta = obj.get("metadata") or {}
        spec: object = obj
        for key in path:
            spec = spec.get(key) if isinstance(spec, dict) else None
        entries = spec.get("resourceClaims") if isinstance(spec, dict) else None
        if not isinstance(entries, list) or len(entries) < 2:
            continue  # one claim (or none): the claim alone is what the scheduler allocates
        namespace = meta.get("namespace") or default_namespace
        where = f"{origin}: {obj['kind']} {meta.get('name', '?')}"
        named = [_resolve(entry, index, claims, namespace, where) for index, entry in enumerate(entries)]
        # A template gives each entry a claim of its own, named after the pod and the entry
        # (the API server adds a random suffix).
        pod = meta.get("name", "?")
        made = [claim if claim.kind == "ResourceClaim" else replace(claim, name=f"{pod}-{entry.get('name', index)}")
                for index, (claim, entry) in enumerate(zip(named, entries))]
        affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution")
        found.append(PodClaims(obj["kind"], namespace, pod, made, named, dict(spec.get("nodeSelector") or {}),
                               affinity if isinstance(affinity, dict) else None,
                               [t for t in spec.get("tolerations") or [] if isinstance(t, dict)]))
    return found


def _resolve(entry: object, index: int, claims: list[Claim], namespace: str, where: str) -> Claim:
    if not isinstance(entry, dict):
        raise SourceError(f"{where}: spec.resourceClaims[{index}] is not an object")
    for key, kind in (("resourceClaimName", "ResourceClaim"), ("resourceClaimTemplateName", "ResourceClaimTemplate")):
        name = entry.get(key)
        if name:
            for claim in claims:
                if claim.kind == kind and claim.name == name and claim.namespace == namespace:
                    return claim
            raise SourceError(f"{where}: spec.resourceClaims[{index}] ({entry.get('name', '?')}): no {kind} "
                              f"{name!r} in namespace {namespace} in the file")
    raise SourceError(f"{where}: spec.resourceClaims[{index}] ({entry.get('name', '?')}) names neither "
                      "resourceClaimName nor resourceClaimTemplateName")


def node_filter(pod: PodClaims, node: str, world: w.World) -> str | None:
    """Why the scheduler does not consider the node for the pod at all (its nodeSelector,
    required node affinity, or a taint of the Node it does not tolerate), or None. Judged
    only where the Node object is known; otherwise the node is a candidate."""
    labels = world.labels.get(node)
    if labels is None:
        return None
    for key, value in sorted(pod.node_selector.items()):
        if labels.get(key) != str(value):
            have = f"{labels[key]!r}" if key in labels else "no such label"
            return f"the pod's nodeSelector {key}={value} does not match the node ({have})"
    if pod.required_affinity is not None and not w.selector_matches(pod.required_affinity, node, labels):
        return "the pod's required node affinity does not match the node's labels"
    taint = taints.blocking(world.node_taints.get(node, ()), pod.tolerations)
    if taint is not None:
        return f"the node's taint {taints.text(taint)} is not tolerated by the pod"
    return None
