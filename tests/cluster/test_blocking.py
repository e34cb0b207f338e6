"""`explain --blocking` against the real kube-scheduler (issue 41, items 2 and 6): on a mock
h100x8 node, four pods hold six of the eight GPUs (one claim of 3, three of 1); a pod
asking for 6 GPUs stays Pending; explain, reading the live cluster, names the smallest set
of claims in its way, with their pods; once those pods and claims are deleted, the pending
pod is scheduled and runs. The driver is a host process (tests/cluster/driverhost.py)."""

from __future__ import annotations

import json

from tests.cluster.driverhost import DRIVER, HostDriver, explain, install
from tests.cluster.workloads import BUSYBOX, apply, events, get, namespace, wait, wait_running

GPU_CLASS = f"gpu.{DRIVER}"


def _claim(name: str, count: int) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": GPU_CLASS, "allocationMode": "ExactCount", "count": count}}]}}}


def _pod(name: str, claim: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                     "containers": [{"name": "app", "image": BUSYBOX, "command": ["sh", "-c", "sleep 3600"],
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


def _unschedulable(cluster, ns: str, name: str) -> bool:
    pod = get(cluster, ns, "pod", name) or {}
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
               for c in (pod.get("status") or {}).get("conditions") or [])


def test_the_blocking_set_explain_names_lets_the_pending_pod_schedule(cluster, tmp_path):
    import local_cluster

    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}, "mock": {"enabled": True}})
    drv = HostDriver(cluster, objects, tmp_path, local_cluster.NODE, fresh_node=True,
                     extra_env={"MOCK_PROFILE": "h100x8"}).start()
    ns = None
    try:
        drv.wait_ready()
        ns = namespace(cluster, "blocking")
        holders = {"big": 3, "small-0": 1, "small-1": 1, "small-2": 1}
        apply(cluster, ns, *[o for name, count in holders.items() for o in (_claim(name, count), _pod(name, name))])
        for name in holders:
            wait_running(cluster, ns, name)
        apply(cluster, ns, _claim("want", 6), _pod("want", "want"))
        wait(f"pod {ns}/want Unschedulable", lambda: _unschedulable(cluster, ns, "want"), 60,
             explain=lambda: f"\nevents:\n{events(cluster, ns)}")

        code, out = explain(cluster, "want", "-n", ns, "--blocking")
        assert code == 1, out
        (answer,) = out["blocking"]
        (node,) = [n for n in answer["nodes"] if n["node"] == local_cluster.NODE]
        assert node["helps"] and not node["fits"] and node["smallest"], node
        named = [h["claim"] for h in node["claims"]]
        # the claim of 3 and one of the single-GPU claims: 2 + 4 = 6 free
        assert len(named) == 2 and f"{ns}/big" in named, named
        for held in node["claims"]:
            assert held["pods"] == [held["claim"]], held  # each claim's pod has its name

        for held in node["claims"]:
            name = held["claim"].split("/", 1)[1]
            cluster.kubectl("delete", "pod", "-n", ns, name, "--wait=true")
            cluster.kubectl("delete", "resourceclaim", "-n", ns, name, "--wait=true")
        pod = wait_running(cluster, ns, "want", timeout=90)
        claim = get(cluster, ns, "resourceclaim", "want")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 6, json.dumps(claim["status"], indent=1)
        # what explain said the request would then get is what the scheduler gave it
        assert sorted(r["device"] for r in results) == sorted(a["device"] for a in node["allocation"])
        assert pod["spec"]["nodeName"] == local_cluster.NODE
    finally:
        if ns:  # the pods' claims unprepared while the driver still runs
            cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]
