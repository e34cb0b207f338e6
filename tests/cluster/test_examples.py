"""Examples from examples/, applied as a user applies them (`kubectl apply -f`), allocated
by the real kube-scheduler, prepared by the driver through the real kubelet, the container
run by containerd/runc with the CDI devices, and the container's output what the example's
README says."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from tests.cluster.driverhost import HostDriver, install
from tests.conftest import REPO

# example folder -> (mock profile, what its container prints, as regexes)
EXAMPLES = {
    "sriov-vf-rdma": ("sriov", [r"^DRA_NIC_\w+_IFNAME=\S+$", r"^DRA_NIC_\w+_RDMA_DEVICE=mlx5_\d+$",
                                r"^DRA_NIC_\w+_PCI_BUS_ID=[0-9a-f:.]+$", r"^NCCL_IB_HCA=auto$",
                                r"^rdma_cm$", r"^uverbs\d+$"]),
    # busybox stand-ins under the vendor images' names (hack/local-cluster/cluster.py)
    "gpu-single": ("mixed", [r"^DRA_GPU_\w+_UUID=GPU-[0-9a-f-]+$", r"^DRA_GPU_\w+_REQUEST=gpu$",
                             r"\s/dev/nvidia\d+$", r"\s/dev/nvidiactl$"]),
    "fpga-by-shell": ("alveo", [r"^DRA_FPGA_\w+_INTERFACE_ID=[0-9a-f-]+$", r"renderD\d+$"]),
    "mig": ("a100-mig", [r"^DRA_MIG_\w+_UUID=MIG-[0-9a-f-]+$", r"^DRA_MIG_\w+_REQUEST=mig$"]),
    "prioritized-gpu": ("h100x8", [r"^DRA_GPU_\w+_UUID=GPU-[0-9a-f-]+$", r"^DRA_GPU_\w+_REQUEST=gpu$"]),
}


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


def pod_of(manifest: str) -> str:
    docs = [d for d in manifest.split("\n---") if re.search(r"^kind: Pod$", d, re.M)]
    (doc,) = docs
    return re.search(r"^  name: (\S+)$", doc, re.M).group(1)


def wait_pod(cluster, ns: str, name: str, phases: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    pod: dict = {}
    while time.monotonic() < deadline:
        p = cluster.kubectl("get", "pod", "-n", ns, name, "-o", "json", check=False)
        if p.returncode == 0:
            pod = json.loads(p.stdout)
            if pod.get("status", {}).get("phase") in phases:
                return pod
        time.sleep(1)
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "wide", check=False).stdout
    raise AssertionError(f"pod {ns}/{name} not in {phases} after {timeout}s: "
                         f"{json.dumps(pod.get('status'), indent=1)}\nevents:\n{events}")


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_runs_on_the_real_cluster(cluster, chart, example, tmp_path):
    import local_cluster

    profile, expected = EXAMPLES[example]
    manifest = (REPO / "examples" / example / "claim.yaml").read_text()
    ns = f"ex-{example}-{uuid.uuid4().hex[:6]}"[:63]
    drv = HostDriver(cluster, chart, tmp_path, local_cluster.NODE, fresh_node=True,
                     extra_env={"MOCK_PROFILE": profile}).start()
    try:
        drv.wait_log("slices_in_sync", 90)
        cluster.kubectl("create", "namespace", ns)
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
        name = pod_of(manifest)
        pod = wait_pod(cluster, ns, name, {"Succeeded", "Failed", "Running"}, 120)
        if pod["status"]["phase"] == "Running":
            pod = wait_pod(cluster, ns, name, {"Succeeded", "Failed"}, 60)
        logs = cluster.kubectl("logs", "-n", ns, name).stdout
        assert pod["status"]["phase"] == "Succeeded", f"{pod['status']}\n{logs}"
        lines = logs.splitlines()
        for rx in expected:
            assert any(re.search(rx, line) for line in lines), f"{example}: no line matches {rx}:\n{logs}"
        # each claim the resourceclaim controller made from a template (named
        # <pod>-<podClaimName>-<suffix>) was prepared by our driver; once the pod is done the
        # controller deletes them again
        statuses = pod["status"].get("resourceClaimStatuses", [])
        assert statuses, pod["status"]
        prepared = {json.loads(line).get("claim_name") for line in drv.log().splitlines()
                    if '"claim_prepared"' in line and f'"{ns}"' in line}
        for st in statuses:
            prefix = f"{name}-{st['name']}-"
            assert any(p.startswith(prefix) for p in prepared), (st, prepared)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]
