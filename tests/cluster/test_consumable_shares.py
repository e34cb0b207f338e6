"""Consumable GPU shares (KEP-5075, the chart's gpuSharing=consumable) on the real cluster:
two pods whose claims each take 40 % of the compute and 30 GiB of one GPU are allocated
by the real scheduler onto that GPU side by side and run under its MPS daemon (our image);
a third that would take the GPU past 100 % is left Pending by the scheduler, with its
reason in the pod's conditions and events. The driver is the chart's pod (helm)."""

from __future__ import annotations

import pytest

import json
import time
import uuid

from tests.cluster.driverpod import PodDriver
from tests.cluster.test_examples import explain, mps_daemon_pods, wait_logs, wait_pod

SHARE = {"memory": "30Gi", "compute": "40"}
# one GPU of the mixed profile (index 0 is gpu-0000-11-00-0), so that the third share can
# only overcommit it
MANIFEST = """apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: share
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.accel.dra.io
            selectors:
              - cel:
                  expression: device.attributes["accel.dra.io"].index == 0
            capacity:
              requests: {memory: %(memory)s, compute: "%(compute)s"}
""" % SHARE

POD = """apiVersion: v1
kind: Pod
metadata:
  name: %s
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: share
  containers:
    - name: c
      image: nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04
      command: ["sh", "-c", "env | grep -e ^DRA_ -e ^CUDA_MPS; sleep infinity"]
      resources:
        claims:
          - name: gpu
"""


def allocation(cluster, ns: str, pod: dict) -> dict:
    (st,) = pod["status"]["resourceClaimStatuses"]
    claim = json.loads(cluster.kubectl("get", "resourceclaim", "-n", ns, st["resourceClaimName"],
                                       "-o", "json").stdout)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result


@pytest.mark.release(34, "consumable capacity (capacity requests, DRAConsumableCapacity)")
def test_two_shares_run_on_one_gpu_and_a_third_that_would_overcommit_it_stays_pending(
        cluster, driver_image):
    import local_cluster

    ns = f"shares-{uuid.uuid4().hex[:6]}"
    drv = PodDriver(cluster, driver_image).install(profile="mixed", values={"gpuSharing": "consumable"})
    try:
        cluster.kubectl("create", "namespace", ns)
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=MANIFEST)
        results = []
        for name in ("share-a", "share-b"):
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=POD % name)
            pod = wait_pod(cluster, ns, name, {"Running", "Failed", "Succeeded"}, 120)
            assert pod["status"]["phase"] == "Running", pod["status"]
            wait_logs(cluster, ns, name, [
                r"^DRA_GPU_0000_11_00_0_UUID=GPU-", r"^CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps$",
                r"^CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40$", r"^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M$"], 30)
            results.append(allocation(cluster, ns, pod))
        # the scheduler put both on the one GPU, as two shares with the capacity asked for
        assert {r["device"] for r in results} == {"gpu-0000-11-00-0"}, results
        assert len({r["shareID"] for r in results}) == 2, results
        for r in results:
            assert r["consumedCapacity"] == {"memory": "30Gi", "compute": "40"}, r
        (daemon,) = mps_daemon_pods(cluster)  # one MPS daemon for the GPU's shares
        assert daemon["status"]["phase"] == "Running", daemon["status"]

        # 40 + 40 + 40 > 100: the scheduler keeps the third pod off the node
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=POD % "share-c")
        deadline = time.monotonic() + 60
        while True:
            pod = json.loads(cluster.kubectl("get", "pod", "-n", ns, "share-c", "-o", "json").stdout)
            cond = {c["type"]: c for c in pod["status"].get("conditions", [])}.get("PodScheduled", {})
            if cond.get("status") == "False":
                break
            assert time.monotonic() < deadline, pod["status"]
            time.sleep(1)
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod
        assert cond["reason"] == "Unschedulable", cond
        assert "cannot allocate all claims" in cond["message"], cond
        events = json.loads(cluster.kubectl(
            "get", "events", "-n", ns, "--field-selector", "involvedObject.name=share-c", "-o", "json").stdout)
        failed = [e for e in events["items"] if e["reason"] == "FailedScheduling"]
        assert failed and all("cannot allocate all claims" in e["message"] for e in failed), events
        # explain, reading the same cluster, agrees: the claim made for it fits nowhere, for
        # want of the GPU's capacity
        (st,) = pod["status"]["resourceClaimStatuses"]
        code, out = explain(cluster, st["resourceClaimName"], "-n", ns)
        (node,) = [n for c in out["claims"] for n in c["nodes"] if n["node"] == local_cluster.NODE]
        assert code == 1 and not node["fits"], node
        by_device = {d["device"]: d for a in node["alternatives"] for d in a["devices"]}
        assert by_device["gpu-0000-11-00-0"]["code"] == "capacity", by_device["gpu-0000-11-00-0"]
        # and it stays so: nothing prepared for it
        time.sleep(5)
        assert "share-c" not in drv.log()
        # once a share is gone, the third fits
        cluster.kubectl("delete", "pod", "-n", ns, "share-a", "--wait=true", "--timeout=90s")
        pod = wait_pod(cluster, ns, "share-c", {"Running", "Failed", "Succeeded"}, 120)
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert allocation(cluster, ns, pod)["device"] == "gpu-0000-11-00-0"
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        drv.wait_unprepared(ns)
        deadline = time.monotonic() + 60
        while mps_daemon_pods(cluster) and time.monotonic() < deadline:
            time.sleep(1)
        left = mps_daemon_pods(cluster)
    assert drv.restarts() == 0, drv.describe()
    assert not left, [p["metadata"]["name"] for p in left]
