"""The chart's node-scoped ValidatingAdmissionPolicy, enforced by the real API server: the
driver's token (bound to its node) may write its own node's slices and is refused another
node's, with the policy's message."""

from __future__ import annotations

import time

import pytest

from tests.cluster.driverhost import DRIVER, install, service_account, token


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
