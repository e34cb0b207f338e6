"""End to end: the CDI ids the plugin returns start a real container with podman + runc,
and the device nodes and env arrive inside it.

Needs root, podman, runc and busybox-static (Debian packages; .ci/run installs them).
Specs go to /var/run/cdi, where podman looks, under a driver name unique to the run.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from driver.demo.podman import busybox_rootfs
from driver.demo.podman import ready as podman_ready
from driver.demo.podman import run as run_container
from driver.sim.apiserver import ApiServer
from tests.driverproc import DriverDirs, DriverProcess
from tests.test_plugin_integration import GPU, NIC, new_claim


@pytest.fixture(scope="module")
def container_tools():
    reason = podman_ready()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the podman end-to-end test: {reason}")
        pytest.skip(reason)


@pytest.fixture
def rootfs(tmp_path):
    return busybox_rootfs(tmp_path)


def podman_run(rootfs: Path, cdi_ids: list[str], script: str):
    return run_container(rootfs, cdi_ids, script)


def test_container_gets_devices_and_env(container_tools, rootfs):
    driver_name = f"e2e-{uuid.uuid4().hex[:8]}.accel.dra.io"
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs, driver=driver_name, cdi_root=Path("/var/run/cdi")).start()
        kubelet = driver.kubelet()
        results = [{"request": "gpu", "driver": driver_name, "pool": "node-a", "device": GPU},
                   {"request": "nic", "driver": driver_name, "pool": "node-a", "device": NIC}]
        claim = new_claim(api, "e2e", results)
        try:
            entry = kubelet.prepare([claim]).claims[claim.uid]
            assert entry.error == ""
            cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
            proc = podman_run(rootfs, cdi_ids,
                              "env | sort; for d in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm "
                              "/dev/infiniband/uverbs0 /dev/infiniband/rdma_cm; do stat -c '%n %F' $d; done; "
                              "cat /usr/local/nvidia/lib64/libcuda.so.1; echo; /usr/local/nvidia/bin/nvidia-smi")
            assert proc.returncode == 0, proc.stderr
            out = proc.stdout
            assert "DRA_GPU_0000_11_00_0_CLAIM=default/e2e" in out
            assert "DRA_GPU_0000_11_00_0_UUID=GPU-" in out
            assert "DRA_NIC_0000_12_00_0_IFNAME=enp18s0f0" in out
            assert "DRA_NIC_0000_12_00_0_RDMA_DEVICE=mlx5_0" in out
            for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm",
                         "/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"):
                assert f"{node} character special file" in out, out
            # The node's driver files arrived where CUDA images look for them.
            assert "mock libcuda.so 550.54.15" in out
            assert "mock nvidia-smi: driver 550.54.15, 2 GPU(s) on the node" in out

            # KEP-5304: the request's device metadata, read-only, at the well-known path.
            meta = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/e2e/gpu/{driver_name}-metadata.json"
            proc = podman_run(rootfs, cdi_ids, f"cat {meta}; echo; touch {meta} 2>&1 || echo READ-ONLY")
            assert proc.returncode == 0, proc.stderr
            text, _, rest = proc.stdout.partition("\n\n")
            metadata = json.loads(text)
            assert metadata["kind"] == "DeviceMetadata" and metadata["metadata"]["name"] == "e2e"
            (request,) = metadata["requests"]
            assert request["name"] == "gpu" and request["devices"][0]["name"] == GPU
            assert request["devices"][0]["attributes"]["uuid"]["string"].startswith("GPU-")
            assert "READ-ONLY" in rest

            # A container given only the NIC sees no GPU.
            nic_only = [i for d in entry.devices if d.device_name == NIC for i in d.cdi_device_ids]
            proc = podman_run(rootfs, nic_only, "ls /dev/nvidia0 2>&1; env")
            assert "No such file" in proc.stdout and "DRA_GPU_" not in proc.stdout
        finally:
            assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
            kubelet.close()
            driver.kill()
            dirs.cleanup()
        assert not list(Path("/var/run/cdi").glob(f"{driver_name}-*"))


def test_two_shares_of_one_gpu_under_mps_in_real_containers(container_tools, rootfs):
    """Two claims share one mock GPU under its MPS daemon: each container sees the daemon's
    pipe directory (the control socket itself) and its own limits."""
    from driver.sim.pods import PodRunner
    from tests.test_sharing import MPS_ARGS

    driver_name = f"e2e-{uuid.uuid4().hex[:8]}.accel.dra.io"
    dirs = DriverDirs.make()
    with ApiServer() as api, PodRunner(api, "node-a", dirs.root / "pods"):
        driver = DriverProcess(api, dirs, driver=driver_name, cdi_root=Path("/var/run/cdi"),
                               extra=MPS_ARGS).start()
        kubelet = driver.kubelet()
        claims = []
        for name, memory, compute in (("share-a", "20Gi", "30"), ("share-b", "30Gi", "50")):
            claims.append((new_claim(api, name, [{
                "request": "gpu", "driver": driver_name, "pool": "node-a", "device": GPU,
                "shareID": str(uuid.uuid4()),
                "consumedCapacity": {"memory": memory, "compute": compute}}]), memory, compute))
        try:
            seen = []
            for claim, memory, compute in claims:
                entry = kubelet.prepare([claim]).claims[claim.uid]
                assert entry.error == "", entry.error
                cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
                proc = podman_run(rootfs, cdi_ids,
                                  "echo pipe=$CUDA_MPS_PIPE_DIRECTORY; stat -c '%n %F' /tmp/nvidia-mps/control; "
                                  "echo threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; "
                                  "echo pinned=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; "
                                  f"touch /dev/shm/probe-{claim.name} && echo shm=writable")
                assert proc.returncode == 0, proc.stderr
                seen.append(proc.stdout)
                mib = int(memory.removesuffix("Gi")) * 1024
                assert "pipe=/tmp/nvidia-mps" in proc.stdout
                assert "/tmp/nvidia-mps/control socket" in proc.stdout, "the daemon's control socket"
                assert f"threads={compute}" in proc.stdout and f"pinned=0={mib}M" in proc.stdout
                assert "shm=writable" in proc.stdout
            # Both containers wrote into the one /dev/shm the daemon shares with its clients.
            assert len(list((dirs.state / "mps" / GPU / "shm").glob("probe-*"))) == 2
        finally:
            for claim, _, _ in claims:
                kubelet.unprepare([claim])
            kubelet.close()
            driver.kill()
            for spec in Path("/var/run/cdi").glob(f"{driver_name}-*.json"):
                spec.unlink()
    dirs.cleanup()
