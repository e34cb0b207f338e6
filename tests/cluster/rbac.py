"""What the chart grants the driver, against what the driver used in a run of the tier.

Grants come from the chart's ClusterRoles and Roles, one per (role, group, resource, verb).
A grant is used when the API server's audit log shows a request of the driver's service
account that RBAC allowed and that the grant covers (a Role: in its namespace). Where two
roles cover one request, RBAC names only the first in the audit event's
`authorization.k8s.io/reason` (ClusterRoleBindings are matched first): a grant that covered
requests but never was that one is reported by `redundant`, not failed.

One grant has no request of its own: `associated-node:patch` on `resourceclaims/driver` is
checked by the API server inside a `resourceclaims/status` patch that changes
`status.devices` (k8s.io/kubernetes pkg/registry/resource/utils.go, AuthorizedForDeviceStatus,
1.36+). It is credited by a successful status patch of the driver; that the patch needs it
is proved by tests/cluster/test_claim_status.py, which takes the grant away and sees the
patch refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REASON = re.compile(r'of (ClusterRole|Role) "([^"]+)"')
STATUS_DEVICES = ("resource.k8s.io", "resourceclaims/status", "patch")
DRIVER_SUBRESOURCE = ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch")


@dataclass(frozen=True)
class Grant:
    kind: str  # ClusterRole or Role
    role: str
    namespace: str  # a Role's; "" for a ClusterRole
    group: str
    resource: str
    verb: str
    names: tuple[str, ...] = ()  # resourceNames; empty: any

    def __str__(self) -> str:
        names = f" {list(self.names)}" if self.names else ""
        return f"{self.kind} {self.role}: {self.verb} {self.group or 'core'}/{self.resource}{names}"


def grants(objects: list[dict]) -> list[Grant]:
    out = []
    for o in objects:
        if o.get("kind") not in ("ClusterRole", "Role"):
            continue
        for rule in o.get("rules") or []:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        out.append(Grant(o["kind"], o["metadata"]["name"],
                                         o["metadata"].get("namespace", "") if o["kind"] == "Role" else "",
                                         group, resource, verb, tuple(rule.get("resourceNames") or ())))
    return out


def _request(ev: dict) -> tuple[str, str, str, str, str] | None:
    ref = ev.get("objectRef")
    if not ref or not ref.get("resource"):
        return None  # a non-resource URL (discovery): every authenticated user may read it
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return ref.get("apiGroup", "") or "", resource, ev["verb"], ref.get("name", ""), ref.get("namespace", "")


def _covers(g: Grant, group: str, resource: str, verb: str, name: str, namespace: str) -> bool:
    return ((g.group, g.resource, g.verb) == (group, resource, verb)
            and (not g.names or name in g.names)
            and (g.kind == "ClusterRole" or g.namespace == namespace))


def used(events: list[dict], granted: list[Grant]) -> tuple[set[Grant], set[Grant]]:
    """(the grants the audit events show in use, those RBAC named as the allowing rule)."""
    covered: set[Grant] = set()
    named: set[Grant] = set()
    for ev in events:
        annotations = ev.get("annotations") or {}
        request = _request(ev)
        if request is None or annotations.get("authorization.k8s.io/decision") != "allow":
            continue
        m = REASON.search(annotations.get("authorization.k8s.io/reason", ""))
        for g in granted:
            if _covers(g, *request):
                covered.add(g)
                if m and (g.kind, g.role) == m.groups():
                    named.add(g)
        if request[:3] == STATUS_DEVICES and ev.get("responseStatus", {}).get("code", 0) < 300:
            driver = {g for g in granted if (g.group, g.resource, g.verb) == DRIVER_SUBRESOURCE}
            covered |= driver
            named |= driver
    return covered, named


def unused(objects: list[dict], events: list[dict]) -> list[Grant]:
    granted = grants(objects)
    covered, _ = used(events, granted)
    return [g for g in granted if g not in covered]


def redundant(objects: list[dict], events: list[dict]) -> list[Grant]:
    """Grants that covered requests, all of which another role's grant allowed first."""
    granted = grants(objects)
    covered, named = used(events, granted)
    return [g for g in granted if g in covered and g not in named]
