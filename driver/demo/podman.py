"""A real container for the demo: podman + runc + a busybox rootfs, where they can run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

# What the demo's containers print: the env the CDI specs set, the device nodes, the MPS
# pipe directory of a container given one (the rootfs is shared, so an empty mount point an
# earlier container left is no sign of MPS), and the mock nvidia-smi the driver's CDI
# mounts bring in.
SHOW = ("env | grep '^DRA_\\|^NCCL\\|^CUDA_MPS' | sort; "
        "ls /dev/nvidia* /dev/infiniband/* /dev/dri/* /dev/dfl* 2>/dev/null; "
        "[ -n \"$CUDA_MPS_PIPE_DIRECTORY\" ] && echo MPS pipe directory: $(ls $CUDA_MPS_PIPE_DIRECTORY); "
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


def run(rootfs: Path, cdi_ids: list[str], script: str = SHOW, name: str | None = None,
        debug: bool = False) -> subprocess.CompletedProcess:
    """One container, named `name` so that it can be found again. podman runs in its own
    session: the terminal's Ctrl-C (sent to the whole process group) does not kill it
    half-way through creating its container, which would leave a Created container, its
    conmon and a `runc init` behind. When the demo is interrupted meanwhile, podman gets a
    few seconds to finish (its container prints and exits at once, `--rm` removes it);
    then it is killed and its container removed."""
    args = _args(rootfs, cdi_ids, script, debug)
    if name is not None:
        args[args.index("run") + 1:args.index("run") + 1] = ["--name", name]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except BaseException:
        try:
            proc.communicate(timeout=5)
        except BaseException:
            proc.kill()
            proc.wait()
        if name is not None:
            remove([name])
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


CONTAINER_PREFIX = "dra-demo-"  # dra-demo-<pid>-<n>: the demo's containers


def _quiet(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except (OSError, subprocess.SubprocessError):
        return None


def remove(names: list[str]) -> None:
    if names:
        _quiet(["podman", "rm", "--force", "--ignore", *names])


def leftovers(alive: Callable[[int], bool]) -> list[str]:
    """Remove what killed demos left behind, and say what: containers podman knows (named
    dra-demo-<pid>-<n>, Created or Initialized), and those it lost track of when it was
    killed while creating one, which only runc lists (their rootfs is in a demo's work
    directory, /tmp/dra-demo-<pid>-*/rootfs). `alive(pid)`: does that demo still run?"""
    removed: list[str] = []
    listed = _quiet(["podman", "ps", "--all", "--external", "--format", "{{.ID}} {{.Names}}"])
    stale = []
    for line in (listed.stdout.splitlines() if listed and listed.returncode == 0 else []):
        cid, _, cname = line.partition(" ")
        pid = _demo_pid(cname.strip(), CONTAINER_PREFIX)
        if pid is not None and not alive(pid):
            stale.append(cid)
            removed.append(cname.strip())
    remove(stale)
    states = _quiet(["runc", "list", "--format", "json"])
    containers = []
    if states is not None and states.returncode == 0:
        try:
            containers = json.loads(states.stdout) or []
        except ValueError:
            pass
    for c in containers:
        rootfs = Path(c.get("rootfs") or "")
        if rootfs.name != "rootfs" or not rootfs.parent.name.startswith("dra-demo-"):
            continue
        pid = _demo_pid(rootfs.parent.name, "dra-demo-")
        if (alive(pid) if pid is not None else rootfs.exists()):
            continue
        _quiet(["runc", "delete", "--force", c["id"]])
        remove([c["id"]])
        removed.append(c["id"][:12])
    return removed


def _demo_pid(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


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


def refused_spec(rootfs: Path, cdi_ids: list[str], spec: Path, version: str,
                 name: str | None = None) -> str | None:
    """Why podman did not load this spec, from its own debug log (it says only
    "unresolvable CDI devices" otherwise): `unknown field "netDevices"` for a field its CDI
    library does not know, `invalid version "1.1.0"` for a version it does not; None when
    the log does not say."""
    try:
        debug = run(rootfs, cdi_ids, "true", name=name, debug=True).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    text = debug.replace('\\"', '"').replace("\\n", "\n").replace("\\t", "\t")
    for line in text.splitlines():
        line = line.strip().lstrip("* ").strip()
        if str(spec) in line or f'invalid version "{version}"' in line:
            return line.rsplit(": ", 1)[-1] if str(spec) in line else f'invalid version "{version}"'
    return None
