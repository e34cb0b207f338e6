"""GPU isolation under NVIDIA's container runtime (issue 38), on the real cluster.

The node as the GPU operator sets it up: containerd's `nvidia` handler runs
nvidia-container-runtime (build.sh nvidia-toolkit, CDI mode, our runc underneath;
hack/local-cluster/cluster.py), and NVIDIA's node-wide CDI spec (`nvidia.com/gpu`, from
`nvidia-ctk cdi generate` against the mock node and its native NVML) lies in the CDI
folder. A pod with that RuntimeClass, the CUDA stand-in image (NVIDIA_VISIBLE_DEVICES=all,
as every CUDA image) and a claim for one GPU must see exactly that GPU's device node: the
runtime reads the variable from the spec containerd made, and without our `void` it adds
`nvidia.com/gpu=all`, every GPU of the node.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from driver.devices import mock
from driver.devices.mock import nativenvml
from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import apply, claim, get, namespace, wait

PROFILE = "mixed"  # two H100s: /dev/nvidia0 and /dev/nvidia1
CUDA_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"  # the stand-in, with NVIDIA's env
NVIDIA_SPEC = "nvidia.com-gpu.json"


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


@pytest.fixture(scope="module")
def driver(cluster, chart, tmp_path_factory):
    import local_cluster

    drv = HostDriver(cluster, chart, tmp_path_factory.mktemp("drv"), local_cluster.NODE,
                     fresh_node=True, extra_env={"MOCK_PROFILE": PROFILE}).start()
    drv.wait_ready()
    yield drv
    assert drv.stop() == 0, drv.log()[-3000:]


@pytest.fixture(scope="module")
def nvidia_node(cluster, driver):
    """NVIDIA's node-wide spec in the cluster's CDI folder, removed afterwards."""
    toolkit = cluster.nvidia_toolkit_bin
    if not (toolkit / "nvidia-container-runtime").exists():
        why = f"NVIDIA's toolkit is not built ({toolkit}; build.sh nvidia-toolkit)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"cluster tier cannot run under CI=true: {why}", pytrace=False)
        pytest.skip(why)
    node = mock.attach(mock.load(PROFILE), cluster.kubelet_dir / "plugins" / DRIVER / "mock")
    assert node is not None and node.library is not None, "the driver's mock node is not there"
    nativenvml.install(node.driver_root, node.library, toolkit / "libnvidia-ml.so.1")
    spec = cluster.cdi_dir / NVIDIA_SPEC
    # No hooks: they would run NVIDIA's ldconfig and symlink steps over the mock's stand-in
    # files; the devices are what this test is about.
    done = subprocess.run([str(toolkit / "nvidia-ctk"), "cdi", "generate", "--mode", "nvml",
                           "--driver-root", str(node.driver_root), "--dev-root", str(node.root),
                           "--disable-hook", "all", "--output", str(spec)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    yield node
    spec.unlink(missing_ok=True)


def test_a_cuda_image_under_nvidia_container_runtime_sees_only_its_claimed_gpu(cluster, nvidia_node):
    ns = namespace(cluster, "nvrt")
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "nvidia"}, "handler": "nvidia"}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(runtime_class))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cuda"},
           "spec": {"runtimeClassName": "nvidia", "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": "one-gpu"}],
                    "containers": [{"name": "app", "image": CUDA_IMAGE,
                                    "command": ["sh", "-c", "echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; "
                                                "env | grep -E '^DRA_GPU_.*_PCI_BUS_ID='; "
                                                "ls /dev | grep -E '^nvidia[0-9]+$'"],
                                    "resources": {"claims": [{"name": "gpu"}]}}]}}
    try:
        apply(cluster, ns, claim("one-gpu", "gpu.accel.dra.io"), pod)
        phase = wait("the pod to finish", lambda: (get(cluster, ns, "pod", "cuda") or {})
                     .get("status", {}).get("phase") in ("Succeeded", "Failed"), 120)
        assert phase
        status = get(cluster, ns, "pod", "cuda")["status"]
        logs = cluster.kubectl("logs", "-n", ns, "cuda").stdout
        assert status["phase"] == "Succeeded", (status, logs)
        # The claim is deallocated once its pod has finished: the container says which GPU
        # it was given (the driver's DRA_GPU_<BDF>_PCI_BUS_ID).
        lines = logs.split()
        (bus_id,) = [line.split("=", 1)[1] for line in lines if line.startswith("DRA_GPU_")]
        (minor,) = [g.minor for g in nvidia_node.library.gpus if g.bus_id.lower() == bus_id.lower()]
        assert "VISIBLE=void" in lines, logs
        assert [line for line in lines if line.startswith("nvidia")] == [f"nvidia{minor}"], logs
        # NVIDIA's runtime did run this container, and was asked for no device of its own
        # (with the image's `all` it logs "Injecting devices using CDI: [nvidia.com/gpu=all]").
        runtime_log = (cluster.logs / "nvidia-container-runtime.log").read_text()
        assert "No devices requested; no modification required." in runtime_log, runtime_log[-2000:]
        assert "nvidia.com/gpu=all" not in runtime_log, runtime_log[-2000:]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "runtimeclass", "nvidia", "--wait=false", check=False)
