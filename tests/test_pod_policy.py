"""The chart's own-node-pods ValidatingAdmissionPolicy, evaluated the way the API server
evaluates it (match conditions, variables in order, validations; failurePolicy Fail), on
the MPS control daemon pod the driver really builds (driver/prepare/mps.py) and on what a
stolen driver token might send instead. tests/cluster/test_admission.py has the real API
server enforce the same policy."""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import kubernetes_validate
import pytest

from driver.prepare.mps import MpsDaemons
from driver.prepare.setup import Setup
from driver.scheduling import cel as k8s_cel
from tests.test_chart import by_kind, container, render

SA = "system:serviceaccount:dra-system:dra-dra-accel-driver"
NODE_KEY = "authentication.kubernetes.io/node-name"


def policy_of(objects: list[dict]) -> dict:
    (found,) = [p for p in by_kind(objects, "ValidatingAdmissionPolicy")
                if p["metadata"]["name"].endswith("-own-node-pods")]
    return found


def verdict(policy: dict, operation: str, pod: dict, node: str | None = "node-a",
            user: str = SA) -> tuple[bool, str]:
    """(admitted, message) for `operation` on `pod` by `user`, whose token is bound to
    `node` (None: a token bound to no node)."""
    extra = {NODE_KEY: [node]} if node else {}
    activation = {
        "object": celpy.json_to_cel(None if operation == "DELETE" else pod),
        "oldObject": celpy.json_to_cel(pod if operation == "DELETE" else None),
        "request": celpy.json_to_cel({"operation": operation,
                                      "userInfo": {"username": user, "extra": extra}}),
    }
    env = celpy.Environment()
    variables: dict = {}

    def run(expression: str):
        program = env.program(env.compile(expression), functions=k8s_cel.FUNCTIONS)
        result = program.evaluate({**activation, "variables": celpy.celtypes.MapType(variables)})
        if isinstance(result, celpy.CELEvalError):
            raise result
        return result

    spec = policy["spec"]
    try:
        for condition in spec.get("matchConditions") or []:
            if not bool(run(condition["expression"])):
                return True, "not matched"
        for variable in spec["variables"]:
            variables[celpy.celtypes.StringType(variable["name"])] = run(variable["expression"])
        for validation in spec["validations"]:
            result = run(validation["expression"])
            if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                if "messageExpression" in validation:
                    return False, str(run(validation["messageExpression"]))
                return False, validation["message"]
    except celpy.CELEvalError as err:
        return False, f"runtime error: {err}"
    return True, ""


def daemon_pod(objects: list[dict], node: str = "node-a") -> dict:
    """The pod the driver of this chart creates for a GPU's MPS daemon on `node`."""
    _, _, env = container(objects)
    daemons = MpsDaemons(None, "accel.dra.io", node, "dra-system", env["MPS_IMAGE"],
                         Path("/var/lib/kubelet/plugins/accel.dra.io"), Path("/"))
    pod = daemons.manifest("gpu-0000-21-00-0", "GPU-4e227674", Setup("MPS", active_threads=30, pinned_memory="20480M"))
    # What the API server's defaulting and ServiceAccount admission add before validating
    # admission runs.
    pod["spec"]["serviceAccountName"] = "default"
    return pod


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    return render()


def test_the_driver_may_create_and_delete_its_mps_daemon_on_its_own_node(chart):
    policy, pod = policy_of(chart), daemon_pod(chart)
    assert verdict(policy, "CREATE", pod) == (True, "")
    assert verdict(policy, "DELETE", pod) == (True, "")


def test_the_image_the_policy_admits_follows_the_mps_image_value():
    objects = render({"mps": {"image": "registry.example/mps:1"}})
    pod = daemon_pod(objects)
    assert pod["spec"]["containers"][0]["image"] == "registry.example/mps:1"
    assert verdict(policy_of(objects), "CREATE", pod) == (True, "")
    assert verdict(policy_of(render()), "CREATE", pod)[0] is False


def test_a_pod_on_another_node_or_on_no_node_is_refused(chart):
    policy = policy_of(chart)
    other = daemon_pod(chart, node="node-b")
    assert verdict(policy, "CREATE", other) == (
        False, "driver pod on node node-a may not create pods on node node-b")
    assert verdict(policy, "DELETE", other) == (
        False, "driver pod on node node-a may not delete pods on node node-b")
    unscheduled = daemon_pod(chart)
    del unscheduled["spec"]["nodeName"]  # the scheduler would pick any node
    assert verdict(policy, "CREATE", unscheduled) == (
        False, "driver pod on node node-a may not create pods on no node (spec.nodeName unset)")


def test_a_token_bound_to_no_node_creates_no_pod(chart):
    ok, message = verdict(policy_of(chart), "CREATE", daemon_pod(chart), node=None)
    assert not ok and "not bound to a node" in message


def changed(pod: dict, edit) -> dict:
    pod = copy.deepcopy(pod)
    edit(pod["spec"], pod["spec"]["containers"][0])
    return pod


EDITS = {
    "another image": lambda s, c: c.update(image="docker.io/library/busybox:1.36"),
    "another command": lambda s, c: c.update(command=["sh", "-c", "cat /host/etc/shadow"]),
    "no command (the image's entrypoint)": lambda s, c: c.pop("command"),
    "a second container": lambda s, c: s["containers"].append({**c, "name": "second"}),
    "an init container": lambda s, c: s.update(initContainers=[{**c, "name": "init"}]),
    "an ephemeral container": lambda s, c: s.update(ephemeralContainers=[{**c, "name": "debug"}]),
    "PATH pointing elsewhere": lambda s, c: c.update(env=[{"name": "PATH", "value": "/driver-root/tmp"}]),
    "a preloaded library": lambda s, c: c.update(env=[{"name": "LD_PRELOAD", "value": "/x.so"}]),
    "variables from a ConfigMap": lambda s, c: c.update(envFrom=[{"configMapRef": {"name": "x"}}]),
    "the driver's service account": lambda s, c: s.update(serviceAccountName="dra-dra-accel-driver"),
}


@pytest.mark.parametrize("what", sorted(EDITS))
def test_anything_but_the_mps_daemon_is_refused(chart, what):
    policy = policy_of(chart)
    pod = changed(daemon_pod(chart), EDITS[what])
    ok, message = verdict(policy, "CREATE", pod)
    assert not ok, f"{what} was admitted"
    assert "MPS control daemon" in message or "service account" in message, message


def test_harmless_variables_are_admitted_and_other_users_are_not_matched(chart):
    policy = policy_of(chart)
    pod = changed(daemon_pod(chart), lambda s, c: c.update(env=[{"name": "TZ", "value": "UTC"}]))
    assert verdict(policy, "CREATE", pod) == (True, "")
    anything = changed(daemon_pod(chart, node="node-b"), EDITS["another command"])
    assert verdict(policy, "CREATE", anything, user="system:admin") == (True, "not matched")


def test_the_policy_renders_validates_and_goes_with_the_admission_switch(chart):
    policy = policy_of(chart)
    (binding,) = [b for b in by_kind(chart, "ValidatingAdmissionPolicyBinding")
                  if b["spec"]["policyName"] == policy["metadata"]["name"]]
    for version in ("1.32.0", "1.34.0", "1.37.0"):
        kubernetes_validate.validate(policy, version, strict=True)
        kubernetes_validate.validate(binding, version, strict=True)
    names = [p["metadata"]["name"] for p in
             by_kind(render({"admissionPolicy": {"enabled": False}}), "ValidatingAdmissionPolicy")]
    assert not any(n.endswith("-own-node-pods") for n in names)
