"""`dra-driver capacity` against the real kube-scheduler (issue 41, items 1 and 6): on a mock
h100x8 node fragmented by real pods holding claims, the request capacity reports as the
largest (built from the claims it prints) is placed by kube-scheduler, and the one a step
larger stays Pending. Two layouts: whole GPUs (5 of 8 held: 3 fit, 4 do not) and GPU+NIC
pairs on one PCIe root (a GPU held with another root's NIC: pairs are fewer than free GPUs).
The driver is a host process (tests/cluster/driverhost.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import BUSYBOX, apply, events, get, namespace, wait, wait_running
from tests.conftest import REPO

GPU_CLASS, NIC_CLASS = f"gpu.{DRIVER}", f"nic.{DRIVER}"


def capacity(cluster, node: str) -> dict:
    """`dra-driver capacity --node NODE -o json` reading the live cluster as its admin."""
    p = subprocess.run([sys.executable, "-m", "driver", "capacity", "--node", node, "--kubeconfig",
                        str(cluster.admin_kubeconfig), "-o", "json"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, f"capacity: {p.returncode}\n{p.stderr}"
    return json.loads(p.stdout)


def finding(answer: dict, node: str, kind: str) -> dict:
    (found,) = [f for n in answer["nodes"] if n["node"] == node for f in n["findings"] if f["kind"] == kind]
    return found


def _claim(name: str, spec: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def _pod(name: str, claims: list[str]) -> dict:
    refs = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "resourceClaims": refs,
                     "containers": [{"name": "app", "image": BUSYBOX, "command": ["sh", "-c", "sleep 3600"],
                                     "resources": {"claims": [{"name": r["name"]} for r in refs]}}]}}


def place(cluster, ns: str, name: str, specs: list[dict]) -> None:
    """A pod with one ResourceClaim per spec (a pod's claims are allocated together)."""
    names = [f"{name}-{i}" for i in range(len(specs))]
    apply(cluster, ns, *[_claim(n, s) for n, s in zip(names, specs)], _pod(name, names))


def hold(cluster, ns: str, name: str, requests: list[dict], constraints: list[dict] | None = None) -> None:
    spec: dict = {"devices": {"requests": requests}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    place(cluster, ns, name, [spec])
    wait_running(cluster, ns, name)


def exactly(name: str, device_class: str, count: int = 1, selector: str | None = None) -> dict:
    body: dict = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if selector:
        body["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": name, "exactly": body}


def _unschedulable(cluster, ns: str, name: str) -> bool:
    pod = get(cluster, ns, "pod", name) or {}
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
               for c in (pod.get("status") or {}).get("conditions") or [])


def largest_placed_next_pending(cluster, ns: str, node: str, kind: str, tag: str) -> dict:
    """The next size up stays Pending (asked first, so that the largest cannot take its
    room), then the largest is placed on the node."""
    found = finding(capacity(cluster, node), node, kind)
    assert found["largest"] and found["claims"] and found["nextClaims"], found
    place(cluster, ns, f"{tag}-next", found["nextClaims"])
    wait(f"pod {ns}/{tag}-next Unschedulable", lambda: _unschedulable(cluster, ns, f"{tag}-next"), 60,
         explain=lambda: f"\ncapacity said {found['largest']} fits, {found['next']} does not\n"
                         f"events:\n{events(cluster, ns)}")
    place(cluster, ns, f"{tag}-largest", found["claims"])
    pod = wait_running(cluster, ns, f"{tag}-largest", timeout=90)
    assert pod["spec"]["nodeName"] == node
    assert _unschedulable(cluster, ns, f"{tag}-next"), "the larger request must still be Pending"
    return found


def test_the_largest_request_capacity_reports_is_placed_and_one_larger_stays_pending(cluster, tmp_path):
    import local_cluster

    node = local_cluster.NODE
    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}, "mock": {"enabled": True}})
    drv = HostDriver(cluster, objects, tmp_path, node, fresh_node=True, extra_env={"MOCK_PROFILE": "h100x8"}).start()
    ns = None
    try:
        drv.wait_ready()
        ns = namespace(cluster, "capacity")
        # Layout 1, scattered whole GPUs: 5 of 8 held by two pods; 3 fit, 4 do not.
        hold(cluster, ns, "held-a", [exactly("gpu", GPU_CLASS, 3)])
        hold(cluster, ns, "held-b", [exactly("gpu", GPU_CLASS, 2)])
        found = largest_placed_next_pending(cluster, ns, node, "gpu", "gpus")
        assert (found["largest"], found["next"]) == (3, 4), found
        # Layout 2 starts from an empty node: the pods first (a claim stays while a pod uses it).
        cluster.kubectl("delete", "pod", "-n", ns, "--all", "--wait=true")
        cluster.kubectl("delete", "resourceclaim", "-n", ns, "--all", "--wait=true")
        # Layout 2, a GPU free but its NIC elsewhere: one pod holds a GPU and the NIC of
        # another root; 6 aligned pairs fit among 7 free GPUs, 7 do not.
        root = 'device.attributes["resource.kubernetes.io"].pcieRoot'
        hold(cluster, ns, "held-c", [exactly("gpu", GPU_CLASS, 1, f'{root} == "pci0000:10"'),
                                     exactly("nic", NIC_CLASS, 1, f'{root} == "pci0000:20"')])
        answer = capacity(cluster, node)
        assert finding(answer, node, "gpu")["largest"] == 7, answer
        found = largest_placed_next_pending(cluster, ns, node, "gpu-nic", "pairs")
        assert (found["largest"], found["next"]) == (6, 7), found
    finally:
        if ns:  # the pods' claims unprepared while the driver still runs
            cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]
