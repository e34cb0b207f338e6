"""Our GPU CDI edits against NVIDIA's idea of the same node (issue 38).

`nvidia-ctk cdi generate --mode nvml` (NVIDIA Container Toolkit, versions.env's tag) runs
against a mock node: its driver root holds the native libnvidia-ml.so.1
(hack/nvidia-toolkit/fakenvml.c) with a snapshot of the node's fake NVML, its /dev the
mock device nodes. For every GPU NVIDIA's spec names (by UUID), its device edits plus the
spec's common edits are compared with what edits.build() gives the same device: device
nodes, env, mounts, hooks. Each difference is either gone or listed below with its reason
(docs/testing.md, "Our CDI specs against nvidia-ctk's").
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import nvidia_toolkit
from driver.devices import nvlibs
from driver.devices.model import DeviceKind
from driver.devices.mock import nativenvml
from driver.prepare import edits, opaque
from driver.prepare.cdi import Mount
from tests.conftest import discover_profile

# Variables of NVIDIA's common edits we do not set, and why.
ENV_NOT_SET = {
    # Read by nvidia-cdi-hook (enable-cuda-compat) only; our specs run no hook.
    "NVIDIA_CTK_LIBCUDA_DIR",
}
# Mounts of NVIDIA's common edits we do not make, by container path, and why.
MOUNTS_NOT_MADE = {
    # /dev/null there tells a runtime configured to read device requests from volume mounts
    # (accept-nvidia-visible-devices-as-volume-mounts) "no devices"; such a runtime reads
    # the variable when no such mount exists, and the variable is `void`.
    "/var/run/nvidia-container-devices/void",
}
# Driver files NVIDIA mounts and we do not, by name, and why.
FILES_NOT_MOUNTED = {
    # The MPS control program: a client container never runs it; our MPS control daemon
    # pod runs it from the driver root (driver/prepare/mps.py).
    "nvidia-cuda-mps-control",
}
# nvidia-cdi-hook subcommands NVIDIA's spec runs and ours does not, and why (a hook that
# is not listed here fails the test: a new toolkit release added one to judge).
HOOKS_NOT_RUN = {
    # Links libcuda.so / libnvidia-ml.so.1 to the versioned files it mounts at host paths;
    # we mount each library under its SONAME in /usr/local/nvidia/lib64 instead.
    "create-symlinks",
    # ldconfig in the container for the host library folder; CUDA images find ours
    # through LD_LIBRARY_PATH=/usr/local/nvidia/lib64 (driver/devices/nvlibs.py).
    "update-ldcache",
    # Forward-compatibility libraries of newer CUDA images; not supported by our specs.
    "enable-cuda-compat",
    # Stops the CUDA driver creating device nodes in the container (NVreg_ModifyDeviceFiles);
    # our containers are unprivileged, their /dev is the runtime's.
    "disable-device-node-modification",
    # Writes the driver's application profile; we leave the image's.
    "update-application-profile",
    # Per-device memory limits for CUDA; our consumable shares set MPS limits instead.
    "apply-cuda-memory-limits",
}


def nvidia_spec(ctk: Path, node) -> dict:
    done = subprocess.run(
        [str(ctk), "cdi", "generate", "--mode", "nvml", "--format", "json",
         "--driver-root", str(node.driver_root), "--dev-root", str(node.root),
         "--nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook", "--device-name-strategy", "uuid"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def merged(device: dict, common: dict) -> dict:
    """What a container requesting this device alone gets: CDI applies the spec's edits
    with the device's."""
    edits_ = device["containerEdits"]
    return {key: common.get(key, []) + edits_.get(key, []) for key in ("env", "deviceNodes", "mounts", "hooks")}


@pytest.fixture(scope="module")
def toolkit() -> Path:
    return nvidia_toolkit.build()


@pytest.mark.parametrize("profile", ["mixed", "h100x8"])
def test_every_gpu_s_edits_match_nvidia_ctk_but_for_the_written_down_differences(toolkit, tmp_path, profile):
    node, result = discover_profile(profile, tmp_path / "mock")
    nativenvml.install(node.driver_root, node.library, toolkit / "libnvidia-ml.so.1")
    spec = nvidia_spec(toolkit / "nvidia-ctk", node)
    theirs = {d["name"]: merged(d, spec.get("containerEdits", {})) for d in spec["devices"]}
    gpus = [d for d in result.inventory.devices if d.kind is DeviceKind.GPU]
    assert {d.attributes["uuid"] for d in gpus} == set(theirs) - {"all"}, "NVIDIA sees other GPUs"
    files = nvlibs.find(node.driver_root, node.driver_root, result.nvidia_driver_version)
    mounts = tuple(Mount(f.host_path, f.container_path) for f in files)
    for device in gpus:
        nvidia = theirs[device.attributes["uuid"]]
        ours = edits.build(device, opaque.default_for(device.kind), claim="ns/c", request="r",
                           dev_root=node.dev, driver_mounts=mounts)
        where = f"{profile} {device.name}"
        assert ({(n["path"], n["hostPath"]) for n in nvidia["deviceNodes"]}
                == {(n.path, n.host_path) for n in ours.device_nodes}), where
        nvidia_env = {e for e in nvidia["env"] if e.split("=", 1)[0] not in ENV_NOT_SET}
        assert nvidia_env <= set(ours.env), (where, nvidia_env - set(ours.env))
        nvidia_files = {m["hostPath"] for m in nvidia["mounts"] if m["containerPath"] not in MOUNTS_NOT_MADE
                        and Path(m["hostPath"]).name not in FILES_NOT_MOUNTED}
        assert nvidia_files == {m.host_path for m in ours.mounts}, where
        hooks = {h["args"][1] for h in nvidia["hooks"]}
        assert hooks <= HOOKS_NOT_RUN, (where, hooks - HOOKS_NOT_RUN)
