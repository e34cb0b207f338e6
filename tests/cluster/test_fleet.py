"""The fleet case (issue 42): 50 fake nodes kept Ready by kwok beside the real node, each with
the ResourceSlices our driver publishes for the mixed profile (published by bench/fleet.py
through the driver's own discovery and publisher), a handful of pods placed on them by the
real kube-scheduler with their claims allocated from those slices, and the fake nodes
removed again, their slices with them. The large runs are `python -m bench fleet`."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace

import pytest

from bench.fleet import SHAPES, Fleet, Figures, claim_spec, device_classes, mock_inventory
from tests.cluster.conftest import HACK

NODES = 50
PODS = 6  # three whole GPUs, three GPU+NIC pairs on one PCIe root
NAMESPACE = "fleet-case"
# A driver name of its own: the other cases' slices and classes stay out of it.
SHAPE = replace(SHAPES["mixed"], driver="fleet.accel.dra.io")


@pytest.fixture(scope="module")
def fake_nodes(cluster):
    import local_cluster

    build = subprocess.run([str(HACK / "build.sh"), "kwok"], capture_output=True, text=True)
    if build.returncode:
        pytest.fail(f"hack/local-cluster/build.sh kwok failed ({build.returncode}):\n{build.stderr[-4000:]}",
                    pytrace=False)
    cluster.api("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": NAMESPACE}})
    try:
        yield cluster.add_fake_nodes(NODES, prefix="fleet-case")
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        cluster.remove_fake_nodes()
        assert cluster.node_ready(), f"the real node {local_cluster.NODE} is no longer Ready"


def _slices(cluster, driver: str) -> list[dict]:
    code, body = cluster.api("GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver={driver}")
    assert code == 200, body
    return body["items"]


def test_fake_nodes_get_our_slices_and_pods_placed_by_the_real_scheduler(cluster, fake_nodes):
    from driver.publish import slices

    made = [obj["metadata"]["name"] for obj in device_classes(SHAPE)
            if cluster.api("POST", "/apis/resource.k8s.io/v1/deviceclasses", obj)[0] == 201]
    try:
        inventory = mock_inventory(SHAPE)
        fleet = Fleet(cluster, fake_nodes, PODS)
        fig = Figures(SHAPE.name, NODES)
        fleet.publish(SHAPE, inventory, fig)
        # Every fake node has exactly the slices the driver builds for it, owned by its Node.
        stored = _slices(cluster, SHAPE.driver)
        by_node: dict[str, list[dict]] = {}
        for s in stored:
            by_node.setdefault(s["spec"]["nodeName"], []).append(s)
        assert sorted(by_node) == sorted(fake_nodes)
        node = fake_nodes[7]
        code, node_obj = cluster.api("GET", f"/api/v1/nodes/{node}")
        want = slices.build(inventory, slices.PoolIdentity(SHAPE.driver, node, node_obj["metadata"]["uid"]), 1,
                            sharing=SHAPE.sharing, layout=slices.SPLIT)
        got = {s["metadata"]["name"]: s for s in by_node[node]}
        assert sorted(got) == sorted(w["metadata"]["name"] for w in want)
        for w in want:
            g = got[w["metadata"]["name"]]
            assert g["spec"] == w["spec"] and g["metadata"]["ownerReferences"] == w["metadata"]["ownerReferences"]
        assert fig.writes == len(stored) and fig.throttled == 0, fig

        # Pods with claims: placed by kube-scheduler on fake nodes, marked Running by kwok.
        import local_cluster

        for i in range(PODS):
            kind = "gpu" if i % 2 == 0 else "aligned"
            name = f"fleet-{i}"
            code, body = cluster.api("POST", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                "spec": claim_spec(kind, SHAPE, i)})
            assert code == 201, body
            code, body = cluster.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"nodeSelector": {local_cluster.FAKE_NODE_LABEL: local_cluster.FAKE_NODE_VALUE},
                         "tolerations": [local_cluster.FAKE_NODE_TOLERATION],
                         "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "d"}]}}],
                         "resourceClaims": [{"name": "d", "resourceClaimName": name}]}})
            assert code == 201, body
        deadline = time.monotonic() + 60
        pods: list[dict] = []
        while time.monotonic() < deadline:
            pods = cluster.api("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")[1].get("items", [])
            if len(pods) == PODS and all(p.get("status", {}).get("phase") == "Running" for p in pods):
                break
            time.sleep(1)
        assert [p["status"].get("phase") for p in pods] == ["Running"] * PODS, \
            [(p["metadata"]["name"], p["status"]) for p in pods]
        for p in pods:
            where = p["spec"]["nodeName"]
            assert where in fake_nodes, (p["metadata"]["name"], where)
            claim = cluster.api("GET", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/"
                                       f"{p['metadata']['name']}")[1]
            results = claim["status"]["allocation"]["devices"]["results"]
            assert {r["pool"] for r in results} == {where} and {r["driver"] for r in results} == {SHAPE.driver}
            if len(results) == 2:  # the pair shares a PCIe root, as the constraint asks
                devices = {r["device"]: r for r in results}
                roots = set()
                for s in by_node[where]:
                    for d in s["spec"].get("devices", []):
                        if d["name"] in devices:
                            roots.add(d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"])
                assert len(roots) == 1, (results, roots)

        # Removed: the nodes go, and their slices with them (owner references).
        cluster.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--force", "--grace-period=0", check=False)
        cluster.remove_fake_nodes()
        assert cluster.fake_node_names() == []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _slices(cluster, SHAPE.driver):
            time.sleep(1)
        assert _slices(cluster, SHAPE.driver) == []
    finally:
        cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.driver={SHAPE.driver}", check=False)
        for name in made:
            cluster.api("DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{name}")
