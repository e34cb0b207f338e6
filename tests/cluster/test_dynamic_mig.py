"""Dynamic MIG (the chart's migMode=dynamic) on the real cluster, with the claims of
examples/mig-dynamic: the real scheduler allocates partitions of the first H100 through the
GPU's shared counters (four 1g.10gb at memory slices 0-3, then a 3g.40gb at 4-7), our driver
creates each GPU/compute instance at prepare (the mock GPU's state shows it), the last
3g.40gb no longer fits and its pod stays Pending with the scheduler's reason, `dra-driver
explain` says the same, and when the pods go the instances are destroyed. The driver is the
chart's pod (helm); the mock GPUs' state is read on the node, in the pod's hostPath."""

from __future__ import annotations

import pytest

import json
import time
import uuid

import yaml

from driver.devices.mock.gpustate import GpuStateStore
from tests.cluster.driverhost import DRIVER
from tests.cluster.driverpod import PodDriver
from tests.cluster.test_examples import explain, wait_pod
from tests.conftest import REPO

GPU = "gpu-0000-11-00-0"
# claim (or template) of examples/mig-dynamic -> the pod the test gives it, in this order
CONSUMERS = [("infer-a", "mig-a"), ("infer-b", "mig-b"), ("infer-c", "mig-c"),
             ("infer-1g", "mig-d"), ("train-3g", "mig-3g")]


def consumer(pod: str, claim: str, template: bool) -> str:
    source = "resourceClaimTemplateName" if template else "resourceClaimName"
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "mig", source: claim}],
                 "containers": [{"name": "c", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
                                 "command": ["sh", "-c", "env | grep ^DRA_; sleep infinity"],
                                 "resources": {"claims": [{"name": "mig"}]}}]}})


def allocated_device(cluster, ns: str, pod: dict) -> str:
    (ref,) = pod["spec"]["resourceClaims"]
    name = ref.get("resourceClaimName") or next(
        s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"] if s["name"] == ref["name"])
    claim = json.loads(cluster.kubectl("get", "resourceclaim", "-n", ns, name, "-o", "json").stdout)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result["device"]


def instances(cluster) -> list[dict]:
    """The GPU and compute instances the mock H100s hold now (the state the fake NVML and
    nvidia-smi share), over every GPU."""
    store = GpuStateStore(cluster.kubelet_dir / "plugins" / DRIVER / "mock")
    out = []
    for path in sorted(store.directory.glob("*.json")):
        out += [dict(i, gpu=path.stem) for i in store.get(path.stem).instances]
    return out


@pytest.mark.release(34, "the driver's shared counters for dynamic MIG (DRAPartitionableDevices)")
def test_partitions_through_shared_counters_created_at_prepare_destroyed_with_the_pod(cluster, driver_image):
    import local_cluster

    ns = f"dyn-mig-{uuid.uuid4().hex[:6]}"
    drv = PodDriver(cluster, driver_image).install(profile="h100x8", values={"migMode": "dynamic"})
    try:
        assert instances(cluster) == []
        cluster.kubectl("create", "namespace", ns)
        docs = [d for d in yaml.safe_load_all((REPO / "examples" / "mig-dynamic" / "claim.yaml").read_text())
                if d and d["kind"] != "Pod"]  # the claims and the template; the pods are ours
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
        devices = {}
        for claim, pod in CONSUMERS:
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=consumer(pod, claim, claim == "infer-1g"))
            p = wait_pod(cluster, ns, pod, {"Running", "Failed", "Succeeded"}, 120)
            assert p["status"]["phase"] == "Running", p["status"]
            devices[pod] = allocated_device(cluster, ns, p)
            logs = cluster.kubectl("logs", "-n", ns, pod).stdout
            assert "_UUID=MIG-" in logs, logs
        # the scheduler packed them as the example's comment says: no overlap, by counters
        assert devices == {"mig-a": f"{GPU}-mig-1g-10gb-0", "mig-b": f"{GPU}-mig-1g-10gb-1",
                           "mig-c": f"{GPU}-mig-1g-10gb-2", "mig-d": f"{GPU}-mig-1g-10gb-3",
                           "mig-3g": f"{GPU}-mig-3g-40gb-4"}, devices
        # created at prepare: one GPU instance (with its compute instance) per partition,
        # at the allocated placement
        held = instances(cluster)
        assert sorted(i["start"] for i in held) == [0, 1, 2, 3, 4], held
        assert all(i["ci"] is not None for i in held), held
        created = [json.loads(line)["device"] for line in drv.log().splitlines() if '"mig_partition_created"' in line]
        assert sorted(created) == sorted(devices.values()), created

        # the second 3g.40gb: its counters are used up; the scheduler leaves the pod Pending
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=consumer("mig-too-many", "too-many", False))
        deadline = time.monotonic() + 60
        while True:
            p = json.loads(cluster.kubectl("get", "pod", "-n", ns, "mig-too-many", "-o", "json").stdout)
            cond = {c["type"]: c for c in p["status"].get("conditions", [])}.get("PodScheduled", {})
            if cond.get("status") == "False":
                break
            assert time.monotonic() < deadline, p["status"]
            time.sleep(1)
        assert cond["reason"] == "Unschedulable" and "cannot allocate all claims" in cond["message"], cond
        # explain, reading the same cluster, agrees: fits nowhere, for want of counters
        code, out = explain(cluster, "too-many", "-n", ns)
        (verdict,) = out["claims"]
        (node,) = [n for n in verdict["nodes"] if n["node"] == local_cluster.NODE]
        assert code == 1 and not node["fits"], node
        codes = {d["code"] for a in node["alternatives"] for d in a["devices"]}
        assert "counters" in codes, (codes, node["why"])
        code, out = explain(cluster, "train-3g", "-n", ns)  # allocated: it fits (in its own place)
        assert code == 0, out

        # the pods go: the kubelet unprepares, the driver destroys each instance
        cluster.kubectl("delete", "pod", "-n", ns, "mig-a", "mig-b", "mig-c", "mig-d", "mig-3g",
                        "mig-too-many", "--wait=true", "--timeout=90s")
        deadline = time.monotonic() + 60
        while instances(cluster) and time.monotonic() < deadline:
            time.sleep(1)
        assert instances(cluster) == [], instances(cluster)
        destroyed = [json.loads(line)["device"] for line in drv.log().splitlines()
                     if '"mig_partition_destroyed"' in line]
        assert sorted(destroyed) == sorted(devices.values()), destroyed
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        drv.wait_unprepared(ns)
    assert drv.restarts() == 0, drv.describe()
