"""A real container for the demo: podman + runc + a busybox rootfs, where they can run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# What the demo's containers print: the env the CDI specs set, the device nodes, and the
# mock nvidia-smi the driver's CDI mounts bring in.
SHOW = ("env | grep '^DRA_\\|^NCCL\\|^CUDA_MPS' | sort; "
        "ls /dev/nvidia* /dev/infiniband/* /dev/dri/* /dev/dfl* 2>/dev/null; "
        "[ -d /tmp/nvidia-mps ] && echo MPS pipe directory: $(ls /tmp/nvidia-mps); "
        "[ -x /usr/local/nvidia/bin/nvidia-smi ] && /usr/local/nvidia/bin/nvidia-smi; true")


SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))  # where podman looks for CDI specs


def ready() -> str | None:
    """None when a container can be started here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not Path("/bin/busybox").exists():
        return "busybox-static not installed"
    return None


def busybox_rootfs(directory: Path) -> Path:
    root = directory / "rootfs"
    for sub in ("bin", "dev", "proc", "sys", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "env", "ls", "grep", "sort", "stat", "cat"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


def run(rootfs: Path, cdi_ids: list[str], script: str = SHOW) -> subprocess.CompletedProcess:
    args = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", "run", "--rm", "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    for cdi_id in cdi_ids:
        args += ["--device", cdi_id]
    return subprocess.run(args + ["--rootfs", str(rootfs), "/bin/sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
