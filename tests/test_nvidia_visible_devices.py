"""GPU isolation under NVIDIA's container runtime (issue 38, item 1).

Where `nvidia-container-runtime` is the node's runtime (the GPU operator's usual setup) it
reads `NVIDIA_VISIBLE_DEVICES` from the OCI spec that containerd made, CDI edits applied,
and injects those GPUs on top of the claim's. Every CUDA image sets it to `all`. Only
`void` (or unset) makes it inject nothing (nvidia-container-toolkit
internal/config/image/cuda_image.go), so every GPU and MIG device's CDI edits set it, as
NVIDIA's own CDI library does in its common edits (pkg/nvcdi/wrapper.go GetCommonEdits),
and so does every container of ours that could run under that runtime.
tests/cluster/test_nvidia_runtime.py runs the real runtime on the local cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.devices.model import DeviceKind
from driver.prepare import edits, opaque
from driver.prepare.mps import MpsDaemons
from driver.prepare.setup import Setup
from tests.test_chart import container, render

GPU_KINDS = (DeviceKind.GPU, DeviceKind.MIG)


def image_env_after_cdi(image_env: list[str], device_env: tuple[str, ...]) -> dict[str, str]:
    """What the container's environment is once the CDI edits are applied: CDI replaces a
    variable the image set by name (container-device-interface's ContainerEdits.Apply,
    generate.AddMultipleProcessEnv), in order."""
    env = dict(e.split("=", 1) for e in image_env)
    env.update(e.split("=", 1) for e in device_env)
    return env


@pytest.mark.parametrize("profile", ["mixed", "a100-mig", "h100x8"])
def test_every_gpu_and_mig_device_turns_nvidia_visible_devices_off(built, profile):
    node, result = built(profile)
    cuda_image = ["PATH=/usr/local/nvidia/bin:/usr/bin", "NVIDIA_VISIBLE_DEVICES=all"]
    seen = set()
    for device in result.inventory.devices:
        built_edits = edits.build(device, opaque.default_for(device.kind), claim="ns/c",
                                  request="r", dev_root=node.dev)
        env = image_env_after_cdi(cuda_image, built_edits.env)
        if device.kind in GPU_KINDS:
            seen.add(device.kind)
            assert env["NVIDIA_VISIBLE_DEVICES"] == "void", (profile, device.name)
        else:
            # A NIC or FPGA alone in a container leaves the image's choice alone.
            assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in built_edits.env), device.name
    assert DeviceKind.GPU in seen
    if profile == "a100-mig":
        assert DeviceKind.MIG in seen


def test_the_chart_s_driver_container_asks_nvidias_runtime_for_no_gpus():
    _, plugin, env = container(render())
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void", plugin["name"]


def test_the_mps_daemon_pod_asks_nvidias_runtime_for_no_gpus(tmp_path: Path):
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         tmp_path / "driver-root")
    (pod_container,) = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))["spec"]["containers"]
    env = {e["name"]: e["value"] for e in pod_container.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "void"
