"""`dra-driver mps-control-daemon`: what runs in a GPU's MPS control daemon pod.

It starts the node's `nvidia-cuda-mps-control -f` with the pipe and log directories and
only this GPU visible, waits until the daemon answers, applies the server defaults the
claims asked for (active thread percentage, pinned device memory limit), writes `ready`
and then lives as long as the daemon. SIGTERM (the pod is deleted) sends `quit`, so the
daemon ends its MPS servers the way MPS intends, not by a signal. If the daemon dies, so
does this process, and the kubelet restarts the container.

The daemon comes from the node's driver installation (--nvidia-driver-root): where that
is a full root filesystem (the host's /, the GPU operator's /run/nvidia/driver) it runs
chrooted there, so that its libraries, glibc included, are the ones it was built with.
Inside the chroot the container's paths mean nothing, so the pod also mounts the GPU's
MPS directory at <driver-root>/tmp (CHROOT_DIRECTORY), its pipe folder over
<driver-root>/tmp/nvidia-mps and its shm at <driver-root>/dev/shm, and the daemon is told
the paths it sees there. Its pipe directory is /tmp/nvidia-mps (PIPE_DIRECTORY) either way,
the value the clients get: MPS wants one value for the daemon and its clients. Else (an installation folder without a
shell, such as a bare lib64/ + bin/ tree, and mock nodes) it runs directly, with the
installation's binaries on PATH (the control daemon starts nvidia-cuda-mps-server by name)
and its NVIDIA libraries preloaded by absolute path. Never its library folders on
LD_LIBRARY_PATH: they hold the host's glibc, which the image's loader would then load.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from driver.kube import quantity
from driver.devices.mock.tools import PYTHON_VARIABLE
from driver.devices.nvlibs import BINARY_DIRS, locate

READY = "ready"
CONTROL = "control"
BINARY = "usr/bin/nvidia-cuda-mps-control"
START_SECONDS = 30.0
# Where the pod mounts the GPU's MPS directory inside the driver root, for the chroot.
# /tmp exists in every root filesystem, so the mount needs no folder made on the host.
CHROOT_DIRECTORY = "/tmp"
# CUDA_MPS_PIPE_DIRECTORY of the daemon and of every client: NVIDIA's MPS documentation
# wants one value for both (the server's pipes are found by that path), so the pod mounts
# the pipe folder where the daemon sees this path and the clients' CDI mount puts it at
# the same path. MPS's own default, and where NVIDIA's DRA driver mounts it too.
PIPE_DIRECTORY = "/tmp/nvidia-mps"
# Loaded by absolute path into the daemon and the servers it starts (non-chroot only).
PRELOADED = ("libcuda.so.1", "libnvidia-ml.so.1")


class DaemonError(Exception):
    pass


@dataclass(frozen=True)
class MpsPaths:
    root: Path

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        return self.root / "shm"

    @property
    def ready(self) -> Path:
        return self.root / READY

    @property
    def chroot_pipe_mountpoint(self) -> Path:
        """Where the chrooted daemon's PIPE_DIRECTORY lands on the host: the pod mounts
        `root` at <driver-root>/tmp and the pipe folder over <driver-root>/tmp/nvidia-mps,
        so this folder (made by the driver) is the second mount's mountpoint."""
        return self.root / Path(PIPE_DIRECTORY).relative_to(CHROOT_DIRECTORY)


def control_answers(pipe: Path) -> bool:
    """Whether a control daemon listens on the pipe directory (a connect, no command)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(str(pipe / CONTROL))
        return True
    except OSError:
        return False
    finally:
        sock.close()


@dataclass(frozen=True)
class Launch:
    """How the control binary runs: its argv prefix, and the environment and MPS
    directories as the daemon (chrooted or not) sees them."""

    prefix: tuple[str, ...]
    env: dict[str, str]
    pipe: str
    log: str


def chrooted(root: Path) -> bool:
    return root != Path("/") and (root / "bin" / "sh").exists() and os.geteuid() == 0


def _same_folder(a: Path, b: Path) -> bool:
    return a.is_dir() and b.is_dir() and os.path.samefile(a, b)


def launch(root: Path, paths: MpsPaths, pipe: str = PIPE_DIRECTORY) -> Launch:
    """`pipe`: CUDA_MPS_PIPE_DIRECTORY as the daemon sees it (inside the chroot where it
    chroots); the pod must show the pipe folder there, which is checked, because a daemon
    listening in a folder of its own would leave every prepare waiting without a clue."""
    binary = root / BINARY
    if not binary.exists():
        raise DaemonError(f"{binary} not found: --nvidia-driver-root must name the NVIDIA "
                          "driver installation")
    if chrooted(root):
        inside = root / CHROOT_DIRECTORY.lstrip("/")
        if not _same_folder(inside / "log", paths.log):
            raise DaemonError(f"{paths.root} is not mounted at {inside}: the chrooted daemon "
                              "would not find its log directory (the pod's volume mounts)")
        if not _same_folder(root / pipe.lstrip("/"), paths.pipe):
            raise DaemonError(f"{paths.pipe} is not mounted at {root / pipe.lstrip('/')}: the "
                              "chrooted daemon would not find its pipe directory (the pod's "
                              "volume mounts)")
        return Launch(("chroot", str(root), "/" + BINARY), {}, pipe, f"{CHROOT_DIRECTORY}/log")
    if not _same_folder(Path(pipe), paths.pipe):
        raise DaemonError(f"{paths.pipe} is not mounted at {pipe}: the daemon would not listen "
                          "where its clients look (the pod's volume mounts)")
    env = {"PATH": os.pathsep.join([str(root / d) for d in BINARY_DIRS if (root / d).is_dir()]
                                   + [os.environ.get("PATH", "")]).rstrip(os.pathsep),
           # A mock node's binary is a script that runs the mock's tool under the Python it
           # is told (driver/devices/mock/tools.py): this pod's, never the host's.
           PYTHON_VARIABLE: sys.executable}
    preload = [str(p) for p in (locate(root, s) for s in PRELOADED) if p is not None]
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD")]))
    return Launch((str(binary),), env, pipe, str(paths.log))


def _control(how: Launch, env: dict[str, str], commands: list[str]) -> str:
    done = subprocess.run(list(how.prefix), input="\n".join(commands) + "\n", env=env,
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise DaemonError(f"nvidia-cuda-mps-control {commands}: "
                          f"{' '.join((done.stderr or done.stdout).split())}")
    return done.stdout


def run(args: argparse.Namespace) -> int:
    paths = MpsPaths(Path(args.directory))
    root = Path(args.nvidia_driver_root)
    paths.ready.unlink(missing_ok=True)
    for directory in (paths.pipe, paths.log):
        directory.mkdir(parents=True, exist_ok=True)
    try:
        how = launch(root, paths, args.pipe_directory)
    except DaemonError as err:
        print(f"mps-control-daemon: {err}", file=sys.stderr)
        return 1
    env = {**os.environ, **how.env, "CUDA_MPS_PIPE_DIRECTORY": how.pipe,
           "CUDA_MPS_LOG_DIRECTORY": how.log, "CUDA_VISIBLE_DEVICES": args.uuid}
    # -M: multi-user mode, one root MPS server for every client UID (NVIDIA starts it as
    # `-d -M`; -f is the same daemon in the foreground, so this process can wait on it).
    daemon = subprocess.Popen([*how.prefix, "-f", *(["-M"] if args.multi_user else [])], env=env)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + START_SECONDS
    while not control_answers(paths.pipe):
        if daemon.poll() is not None or stopping:
            break
        if time.monotonic() > deadline:
            print(f"mps-control-daemon: the daemon did not answer within {START_SECONDS:g}s",
                  file=sys.stderr)
            daemon.kill()
            return 1
        time.sleep(0.05)
    if daemon.poll() is None and not stopping:
        commands = []
        if args.active_thread_percentage is not None:
            commands.append(f"set_default_active_thread_percentage {args.active_thread_percentage}")
        if args.pinned_memory_limit is not None:
            mib = max(1, int(quantity.value(args.pinned_memory_limit)) >> 20)
            # Device 0: CUDA_VISIBLE_DEVICES leaves the daemon this one GPU.
            commands.append(f"set_default_device_pinned_mem_limit 0 {mib}M")
        try:
            if commands:
                _control(how, env, commands)
        except (DaemonError, OSError, subprocess.TimeoutExpired) as err:
            print(f"mps-control-daemon: {err}", file=sys.stderr)
            daemon.kill()
            return 1
        paths.ready.write_text(f"{daemon.pid}\n")
        print(f"mps-control-daemon: ready for GPU {args.uuid} (pipe {paths.pipe})", flush=True)
    while daemon.poll() is None:
        if stopping:
            paths.ready.unlink(missing_ok=True)
            try:
                _control(how, env, ["quit"])
                daemon.wait(timeout=20)
            except (DaemonError, OSError, subprocess.TimeoutExpired):
                daemon.kill()
            break
        time.sleep(0.2)
    paths.ready.unlink(missing_ok=True)
    code = daemon.wait()
    return 0 if stopping else (code or 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uuid", required=True, help="the GPU (or MIG device) UUID to serve")
    parser.add_argument("--directory", required=True,
                        help="the GPU's MPS directory (pipe/, log/ below it)")
    parser.add_argument("--nvidia-driver-root", default="/",
                        help="the NVIDIA driver installation that has nvidia-cuda-mps-control")
    parser.add_argument("--active-thread-percentage", type=int, default=None,
                        help="the server's default CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the claim's "
                             "mpsConfig); unset: MPS's own default, 100")
    parser.add_argument("--pinned-memory-limit", default=None, help="a quantity, e.g. 20Gi")
    parser.add_argument("--pipe-directory", default=PIPE_DIRECTORY,
                        help="CUDA_MPS_PIPE_DIRECTORY as the daemon sees it, inside the chroot "
                             "where it chroots; the pod mounts the pipe folder there, and the "
                             f"clients see it at the same path (default {PIPE_DIRECTORY})")
    parser.add_argument("--multi-user", action="store_true",
                        help="start the daemon with -M: one root MPS server for the clients of "
                             "every UID (the claims' mpsConfig.multiUser; Volta or newer)")
