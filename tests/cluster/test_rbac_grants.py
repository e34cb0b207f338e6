"""The used-vs-granted comparison (tests/cluster/rbac.py) that conftest runs at the end of
a whole-tier run, on the chart's own roles and audit events shaped as the real API server
writes them. Needs no cluster."""

from __future__ import annotations

from tests.cluster import rbac
from tests.test_chart import render

SA = "system:serviceaccount:dra-system:dra-dra-accel-driver"


def event(verb: str, resource: str, role: str, *, kind: str = "ClusterRole", group: str = "",
          subresource: str = "", name: str = "", namespace: str = "", code: int = 200,
          decision: str = "allow") -> dict:
    ref = {"resource": resource, "apiGroup": group, "namespace": namespace, "name": name}
    if subresource:
        ref["subresource"] = subresource
    binding = "ClusterRoleBinding" if kind == "ClusterRole" else "RoleBinding"
    return {"verb": verb, "objectRef": {k: v for k, v in ref.items() if v},
            "user": {"username": SA}, "responseStatus": {"code": code},
            "annotations": {"authorization.k8s.io/decision": decision,
                            "authorization.k8s.io/reason": f'RBAC: allowed by {binding} "{role}" of {kind} '
                                                           f'"{role}" to ServiceAccount "x/dra-system"'}}


def all_calls(objects: list[dict]) -> list[dict]:
    """One allowed request per grant, credited to the role that grants it."""
    out = []
    for g in rbac.grants(objects):
        if g.resource == "resourceclaims/driver":
            continue  # no request of its own
        resource, _, sub = g.resource.partition("/")
        out.append(event(g.verb, resource, g.role, kind=g.kind, group=g.group, subresource=sub,
                         name=g.names[0] if g.names else "",
                         namespace="dra-system" if g.kind == "Role" else "user-ns"))
    return out


def test_every_grant_of_the_chart_is_parsed():
    text = {str(g) for g in rbac.grants(render())}
    assert "ClusterRole dra-dra-accel-driver: create resource.k8s.io/resourceslices" in text
    assert ("ClusterRole dra-dra-accel-driver: associated-node:patch resource.k8s.io/resourceclaims/driver "
            "['accel.dra.io']") in text


def test_all_used_leaves_nothing_and_each_missing_call_shows():
    objects = render()
    calls = all_calls(objects)
    assert rbac.unused(objects, calls) == []  # the status patch credits the driver subresource
    for i, call in enumerate(calls):
        left = rbac.unused(objects, calls[:i] + calls[i + 1:])
        assert left, f"dropping {call['verb']} {call['objectRef']} changed nothing"
        if call["objectRef"].get("subresource") == "status":
            assert {g.resource for g in left} == {"resourceclaims/status", "resourceclaims/driver"}
        else:
            assert len(left) == 1, left


def test_refused_calls_and_calls_of_other_namespaces_do_not_count():
    objects = render()
    (get_pods,) = [g for g in rbac.grants(objects) if g.kind == "Role" and g.verb == "delete"]
    refused = event("delete", "pods", get_pods.role, kind="Role", namespace="dra-system", decision="forbid",
                    code=403)
    elsewhere = event("delete", "pods", "some-other-role", kind="Role", namespace="default")
    assert get_pods in rbac.unused(objects, [refused, elsewhere])
    # a failed status patch proves nothing about the driver subresource
    failed = event("patch", "resourceclaims", "dra-dra-accel-driver", group="resource.k8s.io",
                   subresource="status", code=422)
    assert any(g.resource == "resourceclaims/driver" for g in rbac.unused(objects, [failed]))


def test_a_grant_another_role_already_gives_is_used_but_redundant():
    """A Role granting `get pods` in the driver's namespace beside the ClusterRole's
    cluster-wide `get pods` (the chart's MPS Role did until it was found redundant): the
    ClusterRole is matched first (ClusterRoleBindings before RoleBindings), so the Role's
    grant is never what allowed the call."""
    objects = render()
    (mps_role,) = [o for o in objects if o["kind"] == "Role"]
    objects.append({**mps_role, "metadata": {**mps_role["metadata"], "name": "extra-get"},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    (cluster_get,) = [g for g in rbac.grants(objects) if g.kind == "ClusterRole" and g.resource == "pods"]
    (role_get,) = [g for g in rbac.grants(objects) if g.kind == "Role" and g.verb == "get"]
    call = event("get", "pods", cluster_get.role, namespace="dra-system", name="mps-x")
    assert cluster_get not in rbac.unused(objects, [call]) and role_get not in rbac.unused(objects, [call])
    assert rbac.redundant(objects, [call]) == [role_get]
    assert rbac.redundant(render(), [call]) == []  # the chart as shipped has no such overlap
