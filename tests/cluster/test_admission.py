"""The chart's node-scoped ValidatingAdmissionPolicy, enforced by the real API server: the
driver's token (bound to its node) may write its own node's slices and is refused another
node's, with the policy's message."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from driver.prepare.mps import MpsDaemons
from driver.prepare.setup import Setup
from tests.cluster.driverhost import DRIVER, NAMESPACE, daemonset_env, install, service_account, token


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


def a_slice(name: str, node: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "dev-0"}]}}


URL = "/apis/resource.k8s.io/v1/resourceslices"


def refused(cluster, obj: dict, tok: str, timeout: float = 20) -> tuple[int, dict]:
    """POST obj with tok until the API server refuses it: a new policy takes effect once
    the API server's informers have it (about a second); each accepted try is undone."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = cluster.api("POST", URL, obj, token=tok)
        if code != 201 or time.monotonic() > deadline:
            return code, body
        cluster.api("DELETE", f"{URL}/{obj['metadata']['name']}")
        time.sleep(0.5)


def test_driver_token_may_write_only_its_own_nodes_slices(cluster, chart):
    import local_cluster

    own = local_cluster.NODE
    tok = token(cluster, service_account(chart), own, seconds=600)
    url = URL

    code, body = refused(cluster, a_slice("admission-test-other", "some-other-node"), tok)
    assert code in (403, 422), f"another node's slice was accepted: {code} {body}"
    message = body.get("message", "")
    assert "own-node-slices" in message and (
        f"driver pod on node {own} may not write ResourceSlices of node some-other-node") in message, message

    code, body = cluster.api("POST", url, a_slice("admission-test-own", own), token=tok)
    assert code == 201, body
    code, body = cluster.api("DELETE", f"{url}/admission-test-own", token=tok)
    assert code == 200, body

    # the admin may (the policy binds the driver's account only)
    code, body = cluster.api("POST", url, a_slice("admission-test-other", "some-other-node"))
    assert code == 201, body
    try:
        # ... and the driver may not update or delete it either
        body["spec"]["devices"] = [{"name": "dev-1"}]
        code, answer = cluster.api("PUT", f"{url}/admission-test-other", body, token=tok)
        assert code in (403, 422), f"update of another node's slice accepted: {code} {answer}"
        code, answer = cluster.api("DELETE", f"{url}/admission-test-other", token=tok)
        assert code in (403, 422), f"delete of another node's slice accepted: {code} {answer}"
    finally:
        cluster.api("DELETE", f"{url}/admission-test-other")


def test_token_without_node_is_refused_slice_writes(cluster, chart):
    """A token of the driver's account that is not bound to a node (no node-name in its
    user info) can write no node's slices."""
    import local_cluster

    p = cluster.kubectl("create", "token", service_account(chart), "-n", "dra-system", "--duration", "600s")
    code, body = refused(cluster, a_slice("admission-test-unbound", local_cluster.NODE), p.stdout.strip())
    assert code in (403, 422), f"a token without a node wrote a node's slice: {code} {body}"
    assert "the driver's token is not bound to a node" in body.get("message", ""), body


OTHER_NODE = "admission-test-second-node"


@pytest.fixture(scope="module")
def second_node(cluster, chart):
    """A second Node object (no kubelet behind it): a token can be bound only to a Node that
    exists, and the policies must tell two real nodes apart."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": OTHER_NODE},
        # nothing of other tests' may land there
        "spec": {"unschedulable": True,
                 "taints": [{"key": "dra-test/no-kubelet", "effect": "NoSchedule"}]}}))
    yield OTHER_NODE
    cluster.kubectl("delete", "node", OTHER_NODE, "--wait=false", check=False)


PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def mps_pod(objects: list[dict], node: str) -> dict:
    """The MPS control daemon pod the driver of this chart creates on `node`
    (driver/prepare/mps.py), as it POSTs it."""
    env = daemonset_env(objects)
    daemons = MpsDaemons(None, DRIVER, node, NAMESPACE, env["MPS_IMAGE"],
                         Path("/var/lib/kubelet/plugins") / DRIVER, Path("/"))
    return daemons.manifest("gpu-0000-21-00-0", "GPU-admission-test", Setup("MPS", active_threads=30))


def pod_verdict(cluster, pod: dict, tok: str, timeout: float = 20) -> tuple[int, dict]:
    """A dry-run create (admission runs, nothing is stored or started), repeated while a
    policy may not have reached the API server's informers yet."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = cluster.api("POST", f"{PODS}?dryRun=All", pod, token=tok)
        if code != 201 or time.monotonic() > deadline:
            return code, body
        time.sleep(0.5)


def test_a_token_bound_to_one_node_creates_no_pod_on_another(cluster, chart, second_node):
    import local_cluster

    own = local_cluster.NODE
    tok = token(cluster, service_account(chart), own, seconds=600)
    code, body = pod_verdict(cluster, mps_pod(chart, second_node), tok)
    assert code in (403, 422), f"a pod on another node was admitted: {code} {body}"
    message = body.get("message", "")
    assert "own-node-pods" in message and (
        f"driver pod on node {own} may not create pods on node {second_node}") in message, message

    # Its own node's MPS daemon, exactly as the driver builds it, is admitted ...
    code, body = cluster.api("POST", f"{PODS}?dryRun=All", mps_pod(chart, own), token=tok)
    assert code == 201, body
    # ... and on its own node nothing else: another command in the same image
    shell = mps_pod(chart, own)
    shell["spec"]["containers"][0]["command"] = ["sh", "-c", "id"]
    code, body = cluster.api("POST", f"{PODS}?dryRun=All", shell, token=tok)
    assert code in (403, 422) and "only MPS control daemon pods" in body.get("message", ""), body

    # The token of the second node: no pod on the first node, and none of its slices.
    other_tok = token(cluster, service_account(chart), second_node, seconds=600)
    code, body = cluster.api("POST", f"{PODS}?dryRun=All", mps_pod(chart, own), token=other_tok)
    assert code in (403, 422), f"a pod on another node was admitted: {code} {body}"
    assert f"driver pod on node {second_node} may not create pods on node {own}" in body.get("message", "")
    code, body = cluster.api("POST", URL, a_slice("admission-test-first", own), token=other_tok)
    assert code in (403, 422), f"another node's slice was accepted: {code} {body}"
    assert f"driver pod on node {second_node} may not write ResourceSlices of node {own}" in body.get(
        "message", ""), body
    code, body = cluster.api("POST", URL, a_slice("admission-test-second", second_node), token=other_tok)
    assert code == 201, body
    code, body = cluster.api("DELETE", f"{URL}/admission-test-second", token=other_tok)
    assert code == 200, body


def test_a_token_deletes_no_pod_of_another_node(cluster, chart, second_node):
    """A pod the admin made on the second node (never started: no kubelet runs there)."""
    import local_cluster

    pod = mps_pod(chart, second_node)
    pod["metadata"]["name"] = "admission-test-other-node-pod"
    code, body = cluster.api("POST", PODS, pod)
    assert code == 201, body
    try:
        tok = token(cluster, service_account(chart), local_cluster.NODE, seconds=600)
        code, body = cluster.api("DELETE", f"{PODS}/admission-test-other-node-pod?dryRun=All", token=tok)
        assert code in (403, 422), f"another node's pod was deleted: {code} {body}"
        assert "may not delete pods on node" in body.get("message", ""), body
    finally:
        cluster.api("DELETE", f"{PODS}/admission-test-other-node-pod?gracePeriodSeconds=0")
