"""Examples from examples/, applied as a user applies them (`kubectl apply -f`), allocated
by the real kube-scheduler, prepared by the driver through the real kubelet, the container
run by containerd/runc with the CDI devices, and the container's output what the example's
README says. The driver is the chart's DaemonSet pod, installed with helm
(tests/cluster/driverpod.py); the examples run grouped by the driver config they need
(mock profile, chart values), so that the pod is reinstalled only when that changes."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pytest
import yaml

from tests.cluster.driverhost import NAMESPACE, explain
from tests.cluster.driverpod import PodDriver
from tests.cluster.workloads import example_param
from tests.conftest import REPO

GPU_UUID = r"^DRA_GPU_\w+_UUID=GPU-[0-9a-f-]+$"
MIG_UUID = r"^DRA_MIG_\w+_UUID=MIG-[0-9a-f-]+$"
# the variables are named after the device: a dynamic MIG partition's is
# gpu-<bdf>-mig-<profile>-<placement>
PARTITION_UUID = r"^DRA_GPU_\w+_MIG_\w+_UUID=MIG-[0-9a-f-]+$"
# the mock's nvidia-smi (the CDI spec mounts the node's into /usr/local/nvidia/bin, on the
# NVIDIA images' PATH)
NVIDIA_SMI = r"^mock nvidia-smi: driver \S+, \d+ GPU\(s\) on the node$"


@dataclass(frozen=True)
class Example:
    profile: str  # the mock profile the example's README names
    expect: dict[str, list[str]]  # pod -> regexes that lines of its containers' logs match
    values: dict = field(default_factory=dict)  # chart values beyond the mock's (the pod's config)
    # the pods' commands end (restartPolicy Never: Succeeded) or sleep (Running)
    finishes: bool = True
    mps: bool = False  # an MPS control daemon pod runs our image
    nri: bool = False  # the driver's NRI plugin moves the pod's NIC (values: nri.enabled)
    # The examples that run PyTorch (`python -c "import torch…"`) need NVIDIA's image and a
    # real GPU; here their claims and pods run as written with only the container's
    # command swapped for one the busybox stand-in can run, printing what torch would
    # (which GPUs the container got)
    command: tuple[str, ...] | None = None
    verify: Callable[[object, str], None] | None = None  # (cluster, the pod's logs)


EXAMPLES = {
    "sriov-vf-rdma": Example("sriov", {"sriov-vf-rdma": [
        r"^DRA_NIC_\w+_IFNAME=\S+$", r"^DRA_NIC_\w+_RDMA_DEVICE=mlx5_\d+$",
        r"^DRA_NIC_\w+_PCI_BUS_ID=[0-9a-f:.]+$", r"^NCCL_IB_HCA=auto$", r"^rdma_cm$", r"^uverbs\d+$"]}),
    # the VF moved into the pod as net1 by the driver's NRI plugin, with the claim's address,
    # MTU and route, seen with `ip` from inside
    "nic-in-pod": Example("sriov", {"nic-in-pod": [
        r"net1\s+inet 10\.99\.1\.5/24", r"net1(@\S+)?: .*mtu 1400", r"^10\.99\.0\.0/16 via 10\.99\.1\.1"]},
        values={"nri": {"enabled": True}}, nri=True),
    # the H100 of >= 80 GB the CEL selector asks for: the GPU in the container is one
    # (its UUID looked up in the slices)
    "gpu-by-model": Example("h100x8", {"gpu-by-model": [GPU_UUID, r"^DRA_GPU_\w+_REQUEST=gpu$"]},
                            command=("sh", "-c", "env | grep ^DRA_GPU_ | sort"),
                            verify=lambda cluster, logs: _an_h100_of_80g(cluster, logs)),
    # both GPUs of the claim in one container, as `torch.cuda.device_count()` would say
    "gpu-two": Example("mixed", {"gpu-two": [r"^2 GPUs$"]},
                       command=("sh", "-c", "echo $(env | grep -c '^DRA_GPU_.*_UUID=') GPUs")),
    # busybox stand-ins under the vendor images' names (hack/local-cluster/cluster.py)
    "gpu-single": Example("mixed", {"gpu-single": [GPU_UUID, r"^DRA_GPU_\w+_REQUEST=gpu$",
                                                   r"\s/dev/nvidia\d+$", r"\s/dev/nvidiactl$"]}),
    "fpga-by-shell": Example("alveo", {"fpga-by-shell": [r"^DRA_FPGA_\w+_INTERFACE_ID=[0-9a-f-]+$",
                                                         r"renderD\d+$"]}),
    "mig": Example("a100-mig", {"mig": [MIG_UUID, r"^DRA_MIG_\w+_REQUEST=mig$"]}),
    "prioritized-gpu": Example("h100x8", {"prioritized-gpu": [GPU_UUID, r"^DRA_GPU_\w+_REQUEST=gpu$"]}),
    # a GPU and an RDMA NIC on one PCIe root: both devices' variables, the NIC's verbs node
    "gpu-nic-aligned": Example("h100x8", {"gpu-nic-aligned": [
        GPU_UUID, r"^DRA_GPU_\w+_REQUEST=gpu$", r"^DRA_NIC_\w+_RDMA_DEVICE=mlx5_\d+$",
        r"^DRA_NIC_\w+_REQUEST=nic$", r"^uverbs\d+$"]}),
    # the one pod of the file (infer-d, from the template) gets a partition created at
    # prepare; the file's standalone claims have no pod, so the scheduler never allocates
    # them (tests/cluster/test_dynamic_mig.py gives each a pod)
    "mig-dynamic": Example("h100x8", {"infer-d": [PARTITION_UUID, r"^DRA_GPU_\w+_MIG_\w+_REQUEST=mig$",
                                                  NVIDIA_SMI]},
                           values={"migMode": "dynamic"}),
    # two containers of one pod share the claim; each runs the node's nvidia-smi (the
    # mock's, mounted by the CDI spec into /usr/local/nvidia/bin)
    "gpu-shared": Example("mixed", {"gpu-shared": [NVIDIA_SMI]}, finishes=False),
    # two pods share one claim, the GPU time-sliced (nvidia-smi compute-policy at prepare)
    "gpu-timeslicing": Example("mixed", {
        pod: [GPU_UUID, r"^DRA_GPU_\w+_REQUEST=gpu$", NVIDIA_SMI] for pod in ("timesliced-a", "timesliced-b")},
        finishes=False),
    # a consumable share (20 GiB, 30 %) of a GPU under its MPS daemon; the file's two
    # standalone claims have no pod, so the scheduler never allocates them
    "gpu-consumable": Example("mixed", {"inference-c": [
        GPU_UUID, r"^CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps$", r"^CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30$",
        r"^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M$"]},
        values={"gpuSharing": "consumable"}, finishes=False, mps=True),
    # one claim, two pods, one MPS control daemon pod (our image) whose pipe directory both
    # containers see
    "gpu-mps-shared-claim": Example("mixed", {
        pod: [r"^pipe=/tmp/nvidia-mps$", r"^control$"] for pod in ("mps-client-a", "mps-client-b")},
        finishes=False, mps=True),
}


def _an_h100_of_80g(cluster, logs: str) -> None:
    from tests.cluster.workloads import slice_device

    (uuid_,) = [line.split("=", 1)[1] for line in logs.splitlines() if re.match(GPU_UUID, line)]
    devices = json.loads(cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    (name,) = [d["name"] for s in devices for d in s["spec"].get("devices") or []
               if (d.get("attributes") or {}).get("uuid", {}).get("string") == uuid_]
    device = slice_device(cluster, name)
    assert device["attributes"]["productName"]["string"].startswith("NVIDIA H100"), device
    from driver.kube.quantity import value
    assert value(device["capacity"]["memory"]["value"]) >= 80 * 10**9, device


def with_command(manifest: str, command: tuple[str, ...]) -> str:
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    for d in docs:
        if d["kind"] == "Pod":
            for c in d["spec"]["containers"]:
                c["command"] = list(command)
    return yaml.safe_dump_all(docs, sort_keys=False)


def config(ex: Example) -> tuple[str, str]:
    """What the driver pod must run with for the example: its mock profile and values."""
    return ex.profile, json.dumps(ex.values, sort_keys=True)


# Examples of one config adjacent: each change of config costs a reinstall of the pod.
ORDER = sorted(EXAMPLES, key=lambda name: (config(EXAMPLES[name]), name))


@pytest.fixture(scope="module")
def pod_driver(cluster, driver_image):
    """The chart's pod, kept across the module's examples while their config is the same."""
    return PodDriver(cluster, driver_image)


def driver_for(drv: PodDriver, ex: Example) -> PodDriver:
    # drv.pod is None until an install worked (and again after one that failed)
    if drv.pod is None or (drv.profile, drv.values) != (ex.profile, ex.values):
        drv.install(profile=ex.profile, values=ex.values)
    return drv


def pods_of(manifest: str) -> list[str]:
    return [d["metadata"]["name"] for d in yaml.safe_load_all(manifest) if d and d.get("kind") == "Pod"]


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


def wait_logs(cluster, ns: str, name: str, expected: list[str], timeout: float) -> str:
    """The pod's containers' logs once every regex matches a line (a running pod may not
    have printed everything yet)."""
    deadline = time.monotonic() + timeout
    logs = ""
    while True:
        logs = cluster.kubectl("logs", "-n", ns, name, "--all-containers", check=False).stdout
        missing = [rx for rx in expected if not any(re.search(rx, line) for line in logs.splitlines())]
        if not missing:
            return logs
        if time.monotonic() > deadline:
            raise AssertionError(f"{ns}/{name}: no line matches {missing}:\n{logs}")
        time.sleep(1)


def prepared_claims(drv: PodDriver, ns: str) -> set[str]:
    return {json.loads(line).get("claim_name") for line in drv.log().splitlines()
            if '"claim_prepared"' in line and f'"{ns}"' in line}


def explained(cluster, path, ns: str) -> dict[str, bool]:
    """explain's verdict, against the live cluster, for each claim and template of a file:
    name -> fits on some node."""
    _, out = explain(cluster, "-f", str(path), "-n", ns)
    return {c["claim"].split("/", 1)[1]: any(n["fits"] for n in c["nodes"]) for c in out["claims"]}


def mps_daemon_pods(cluster) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", NAMESPACE, "-l",
                          "app.kubernetes.io/component=mps-control-daemon", "-o", "json").stdout
    return json.loads(out)["items"]


@pytest.mark.parametrize("example", [example_param(name) for name in ORDER])
def test_example_runs_on_the_real_cluster(cluster, pod_driver, driver_image, example):
    ex = EXAMPLES[example]
    manifest = (REPO / "examples" / example / "claim.yaml").read_text()
    if ex.command:
        manifest = with_command(manifest, ex.command)
    assert set(pods_of(manifest)) >= set(ex.expect), pods_of(manifest)
    ns = f"ex-{example}-{uuid.uuid4().hex[:6]}"[:63]
    drv = driver_for(pod_driver, ex)
    restarts = drv.restarts()
    try:
        if ex.nri:
            drv.wait_log("nri_synchronized", 30)
        cluster.kubectl("create", "namespace", ns)
        # explain's verdict first, from what the cluster has before the example: each claim
        # or template that a pod of the example uses must fit, as the scheduler then finds
        verdicts = explained(cluster, REPO / "examples" / example / "claim.yaml", ns)
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
        used = {c.get("resourceClaimName") or c.get("resourceClaimTemplateName")
                for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Pod"
                for c in d["spec"].get("resourceClaims", [])}
        assert used <= set(verdicts), (used, verdicts)
        assert all(verdicts[c] for c in used), f"explain says some do not fit: {verdicts}"
        try:
            check_pods(cluster, drv, ns, ex)
        except AssertionError as e:
            if not ex.mps:
                raise
            daemons = [(p["metadata"]["name"], p.get("status")) for p in mps_daemon_pods(cluster)]
            logs = "\n".join(cluster.kubectl("logs", "-n", NAMESPACE, n, "--all-containers", check=False).stdout
                             for n, _ in daemons)
            raise AssertionError(f"{e}\nMPS daemon pods: {json.dumps(daemons, indent=1)}\ntheir logs:\n{logs}") from None
        if ex.mps:
            (daemon,) = mps_daemon_pods(cluster)
            # the chart's default: the driver's own image
            assert daemon["spec"]["containers"][0]["image"] == driver_image
            assert daemon["status"]["phase"] == "Running", daemon["status"]
    finally:
        # The pods first, with a short grace period: the examples' sleeping shells run as
        # PID 1 and ignore SIGTERM, so each waited out the default 30 s before the kubelet
        # killed it (the kubelet still stops them and the driver unprepares as usual).
        cluster.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=1", "--wait=true",
                        "--timeout=60s", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        # every claim unprepared before the pod may be replaced for the next config
        drv.wait_unprepared(ns)
        if ex.mps:
            # the last unprepare deletes the daemon pod and waits for it
            deadline = time.monotonic() + 60
            while mps_daemon_pods(cluster) and time.monotonic() < deadline:
                time.sleep(1)
            left = mps_daemon_pods(cluster)
    # the pod served the example without a crash or a failed liveness probe
    assert drv.restarts() == restarts, drv.describe()
    if ex.mps:
        assert not left, [p["metadata"]["name"] for p in left]


def check_pods(cluster, drv: PodDriver, ns: str, ex: Example) -> None:
    for name, expected in ex.expect.items():
        pod = wait_pod(cluster, ns, name, {"Succeeded", "Failed", "Running"}, 120)
        if ex.finishes and pod["status"]["phase"] == "Running":
            pod = wait_pod(cluster, ns, name, {"Succeeded", "Failed"}, 60)
        want = "Succeeded" if ex.finishes else "Running"
        logs = wait_logs(cluster, ns, name, expected, 30 if pod["status"]["phase"] == want else 0)
        assert pod["status"]["phase"] == want, f"{pod['status']}\n{logs}"
        if ex.verify is not None:
            ex.verify(cluster, logs)
        # each claim the resourceclaim controller made from a template (named
        # <pod>-<podClaimName>-<suffix>) was prepared by our driver, and so was each
        # claim the pod names; once the pod is done the controller deletes the
        # generated ones again
        prepared = prepared_claims(drv, ns)
        for claim in pod["spec"].get("resourceClaims", []):
            if claim.get("resourceClaimName"):
                assert claim["resourceClaimName"] in prepared, (claim, prepared)
                continue
            statuses = {s["name"]: s.get("resourceClaimName") for s in
                        pod["status"].get("resourceClaimStatuses", [])}
            assert claim["name"] in statuses, pod["status"]
            prefix = f"{name}-{claim['name']}-"
            assert any(p.startswith(prefix) for p in prepared), (claim, prepared)
