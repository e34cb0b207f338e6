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


def _args(rootfs: Path, cdi_ids: list[str], script: str, debug: bool = False) -> list[str]:
    args = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
    if debug:
        args.append("--log-level=debug")
    args += ["run", "--rm", "--network", "none",
             "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    for cdi_id in cdi_ids:
        args += ["--device", cdi_id]
    return args + ["--rootfs", str(rootfs), "/bin/sh", "-c", script]


def run(rootfs: Path, cdi_ids: list[str], script: str = SHOW) -> subprocess.CompletedProcess:
    return subprocess.run(_args(rootfs, cdi_ids, script), capture_output=True, text=True, timeout=120)


def version() -> str:
    """`podman 4.3.1`, or just `podman` when it does not say."""
    try:
        out = subprocess.run(["podman", "version", "--format", "{{.Client.Version}}"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"podman {out}" if out else "podman"


# What makes a spec need a newer cdiVersion than 0.5.0, as the demo's message names it.
NEWER_FIELDS = {"netDevices": "netDevices (NicConfig moveInterface: true; containerd >= 2.2.1 or "
                              "CRI-O >= 1.35 with runc >= 1.4 take it)"}


def refused_spec(rootfs: Path, cdi_ids: list[str], spec: Path, version: str) -> str | None:
    """Why podman did not load this spec, from its own debug log (it says only
    "unresolvable CDI devices" otherwise): `unknown field "netDevices"` for a field its CDI
    library does not know, `invalid version "1.1.0"` for a version it does not; None when
    the log does not say."""
    try:
        debug = subprocess.run(_args(rootfs, cdi_ids, "true", debug=True), capture_output=True,
                               text=True, timeout=120).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    text = debug.replace('\\"', '"').replace("\\n", "\n").replace("\\t", "\t")
    for line in text.splitlines():
        line = line.strip().lstrip("* ").strip()
        if str(spec) in line or f'invalid version "{version}"' in line:
            return line.rsplit(": ", 1)[-1] if str(spec) in line else f'invalid version "{version}"'
    return None
