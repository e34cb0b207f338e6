"""One MPS control daemon per GPU, run as a pod of its own in the driver's namespace.

Why a pod: the daemon must outlive a restart and an upgrade of the driver pod (the
workloads' CUDA contexts live in its MPS server), so it cannot be our child process, and
a process started from our container would die with the container's cgroup. A pod is
what the kubelet keeps running and restarts when it crashes, what an operator sees with
`kubectl get pods -l app.kubernetes.io/component=mps-control-daemon`, and what RBAC can
scope (the driver may create and delete pods in its own namespace only).

Everything the daemon and its clients share lives on the host, under
<state-dir>/mps/<device>/: `pipe/` (CUDA_MPS_PIPE_DIRECTORY: the control socket, the
server's pipes), `log/`, and `shm/`, which the daemon and every client container mount as
/dev/shm. The driver never talks to the pod for readiness: the daemon is up when its
control socket accepts a connection and the wrapper (driver/prepare/mps_daemon.py) has written
`ready` after applying the server defaults.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from driver.kube import names
from driver.kube.client import ApiError, Kube, NotFound
from driver.prepare.mps_daemon import CHROOT_DIRECTORY, PIPE_DIRECTORY, MpsPaths, control_answers
from driver.prepare import shm
from driver.prepare.setup import Setup

COMPONENT = "mps-control-daemon"
CONTAINER_PIPE_DIR = PIPE_DIRECTORY  # where clients find the pipe directory: the daemon's value
DAEMON_DRIVER_ROOT = "/driver-root"
POLL_SECONDS = 0.1


class MpsError(Exception):
    """The daemon could not be started or stopped; the message names the device and pod."""


class MpsStarting(Exception):
    """The device's daemon pod exists but does not answer yet. Raised instead of waiting,
    so that the caller can let go of the prepare locks and wait outside them
    (MpsDaemons.wait_ready): a new daemon pod may need an image pull and a container start,
    longer than anything else may be held up for."""

    def __init__(self, device: str, pod: str) -> None:
        super().__init__(f"the MPS control daemon of {device} (pod {pod}) is starting")
        self.device = device
        self.pod = pod


# The kubelet cancels a NodePrepareResources call after 45 s and then shows only
# DeadlineExceeded; a prepare that waits for a new daemon must answer well before that.
KUBELET_PREPARE_SECONDS = 45.0
MAX_START_WAIT = 30.0
# A stopping daemon gets the pod's grace period to `quit` its servers; the start timeout
# (how long a prepare waits for a new daemon) has nothing to do with that.
TERMINATION_GRACE_SECONDS = 30
STOP_SECONDS = TERMINATION_GRACE_SECONDS + 5.0


def _label_value(value: str) -> str:
    if len(value) <= 63 and names.is_dns_label(value.replace(".", "-")):
        return value
    return hashlib.sha256(value.encode()).hexdigest()[:32]


@dataclass
class MpsDaemons:
    kube: Kube
    driver: str
    node: str
    namespace: str
    image: str
    state_dir: Path  # host path (the chart mounts it at the same path)
    driver_root_host: Path  # the NVIDIA installation on the host, mounted into the pod
    start_timeout: float = MAX_START_WAIT  # how long one prepare waits for a new daemon
    driver_root_local: Path | None = None  # the same, as this process sees it (default: host's)
    shm_size: int | None = None  # bytes of each GPU's shm tmpfs; None: half of the node's memory

    def __post_init__(self) -> None:
        self.log = structlog.get_logger(component="mps")

    # -- names ---------------------------------------------------------------------------
    def paths(self, device: str) -> MpsPaths:
        return MpsPaths(self.state_dir / "mps" / device)

    def pod_name(self, device: str) -> str:
        name = f"{self.driver.replace('.', '-')}-mps-{self.node}-{device}"
        if names.is_dns_subdomain(name) and len(name) <= 253:
            return name
        digest = hashlib.sha256(f"{self.driver}/{self.node}".encode()).hexdigest()[:16]
        return f"mps-{digest}-{device}"

    def labels(self, device: str | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "dra-accel-driver",
                  "app.kubernetes.io/component": COMPONENT,
                  f"{self.driver}/node": _label_value(self.node)}
        if device is not None:
            labels[f"{self.driver}/device"] = device
        return labels

    def _pods_path(self, name: str | None = None) -> str:
        base = f"/api/v1/namespaces/{self.namespace}/pods"
        return f"{base}/{name}" if name else base

    # -- lifecycle -----------------------------------------------------------------------
    def alive(self, device: str) -> bool:
        paths = self.paths(device)
        return paths.ready.exists() and control_answers(paths.pipe)

    def start(self, device: str, uuid: str, setup: Setup) -> str:
        """Create (or adopt) the device's daemon pod. Returns its name once the daemon
        answers; raises MpsStarting while it does not yet (the caller waits, unlocked)."""
        if not self.image:
            raise MpsError(f"MPS on {device} needs the control daemon image: set --mps-image "
                           "($MPS_IMAGE; the Helm chart sets it to the driver's image)")
        name = self.pod_name(device)
        paths = self.paths(device)
        if self.alive(device):
            return name
        for directory in (paths.pipe, paths.log, paths.shm):
            directory.mkdir(parents=True, exist_ok=True)
        if self.chroots():  # the pipe mount's mountpoint inside the chroot (manifest)
            paths.chroot_pipe_mountpoint.mkdir(exist_ok=True)
        shm.ensure_tmpfs(paths.shm, device, self.log, self.shm_size or shm.default_size())
        pod = self._existing(name)
        if pod is not None and (pod.get("metadata") or {}).get("deletionTimestamp"):
            self._wait_gone(name, device)  # a stop in progress: let it finish, then start anew
            pod = None
        if pod is None:
            try:
                self.kube.request("POST", self._pods_path(), body=self.manifest(device, uuid, setup))
            except ApiError as err:
                if err.status != 409:  # 409: created concurrently (the other instance)
                    raise MpsError(f"MPS on {device}: cannot create pod {self.namespace}/{name}: "
                                   f"{err}") from err
            self.log.info("mps_daemon_created", device=device, pod=name, setup=setup.describe())
        if not self.alive(device):
            raise MpsStarting(device, name)
        return name

    def wait_ready(self, device: str, pod: str, seconds: float | None = None) -> None:
        """Wait (no lock held) until the device's daemon answers; an MpsError naming the
        pod's state after `seconds` (default: start_timeout)."""
        wait = self.start_timeout if seconds is None else seconds
        deadline = time.monotonic() + wait
        while not self.alive(device):
            if time.monotonic() > deadline:
                raise MpsError(f"MPS on {device}: the control daemon of pod {self.namespace}/"
                               f"{pod} did not answer within {wait:g}s"
                               f"{self._pod_problem(pod)}; the kubelet retries the prepare, "
                               "which finds the daemon once it answers")
            time.sleep(POLL_SECONDS)

    def stop(self, device: str, name: str | None = None) -> None:
        """Delete the daemon pod, wait until the daemon is gone, remove its directories."""
        name = name or self.pod_name(device)
        try:
            self.kube.request("DELETE", self._pods_path(name))
            self.log.info("mps_daemon_deleted", device=device, pod=name)
        except NotFound:
            pass
        except ApiError as err:
            raise MpsError(f"MPS on {device}: cannot delete pod {self.namespace}/{name}: {err}") from err
        self._wait_gone(name, device)
        deadline = time.monotonic() + STOP_SECONDS
        while control_answers(self.paths(device).pipe):
            if time.monotonic() > deadline:
                raise MpsError(f"MPS on {device}: pod {self.namespace}/{name} is gone but its "
                               "control daemon still answers")
            time.sleep(POLL_SECONDS)
        shm.release(self.paths(device).shm, device, self.log)
        shutil.rmtree(self.paths(device).root, ignore_errors=True)

    def pods(self) -> list[dict]:
        """This node's daemon pods (for orphans: pods no device state record explains)."""
        selector = ",".join(f"{k}={v}" for k, v in self.labels().items())
        listed = self.kube.request("GET", self._pods_path(), query={"labelSelector": selector})
        return list((listed or {}).get("items") or [])

    def _existing(self, name: str) -> dict | None:
        try:
            return self.kube.request("GET", self._pods_path(name))
        except NotFound:
            return None
        except ApiError as err:
            raise MpsError(f"cannot read pod {self.namespace}/{name}: {err}") from err

    def _wait_gone(self, name: str, device: str) -> None:
        deadline = time.monotonic() + STOP_SECONDS
        while self._existing(name) is not None:
            if time.monotonic() > deadline:
                raise MpsError(f"MPS on {device}: pod {self.namespace}/{name} was not deleted "
                               f"within {STOP_SECONDS:g}s")
            time.sleep(POLL_SECONDS)

    def _pod_problem(self, name: str) -> str:
        try:
            pod = self._existing(name)
        except MpsError as err:
            return f" ({err})"
        if pod is None:
            return " (the pod is gone)"
        status = pod.get("status") or {}
        waiting = [(c.get("state") or {}).get("waiting") or {} for c in status.get("containerStatuses") or []]
        reasons = [f"{w.get('reason')}: {w.get('message', '')}".strip(": ") for w in waiting if w]
        detail = "; ".join(reasons) or status.get("message") or status.get("phase") or "no status"
        return f" (pod: {detail})"

    # -- the pod ---------------------------------------------------------------------------
    def chroots(self) -> bool:
        """Whether the daemon will run chrooted in the driver root (driver/prepare/mps_daemon.py
        decides the same way: the root has a shell, so it is a full root filesystem)."""
        local = self.driver_root_local or self.driver_root_host
        return (local / "bin" / "sh").exists()

    def manifest(self, device: str, uuid: str, setup: Setup) -> dict:
        paths = self.paths(device)
        chroot_dir = f"{DAEMON_DRIVER_ROOT}{CHROOT_DIRECTORY}"
        # Mounts inside the read-only driver root need their mountpoints there already: the
        # runtime cannot make a folder in a read-only bind mount (runc: `make mountpoint
        # "/driver-root/tmp": mkdirat …: read-only file system`, seen on the local cluster
        # with a mock node's bare installation folder). A full root filesystem has /tmp and
        # /dev/shm; a bare installation folder has neither, and the daemon does not chroot
        # there, so it needs neither mount.
        # The pipe folder goes where the daemon sees PIPE_DIRECTORY, the value its clients
        # get (MPS wants the same one for both): inside the chroot, over a mountpoint in
        # the MPS folder (writable, made by start()), not in the read-only driver root.
        pipe_mounts = [
            # Where the daemon, chrooted to the driver root, finds its log folder and the
            # clients' shm (driver/prepare/mps_daemon.py), then its pipe folder.
            {"name": "mps", "mountPath": chroot_dir},
            {"name": "pipe", "mountPath": f"{DAEMON_DRIVER_ROOT}{PIPE_DIRECTORY}"},
            {"name": "shm", "mountPath": f"{DAEMON_DRIVER_ROOT}/dev/shm"},
        ] if self.chroots() else [{"name": "pipe", "mountPath": PIPE_DIRECTORY}]
        command = ["dra-driver", "mps-control-daemon", "--uuid", uuid,
                   "--directory", str(paths.root), "--nvidia-driver-root", DAEMON_DRIVER_ROOT,
                   "--pipe-directory", PIPE_DIRECTORY]
        if setup.active_threads is not None:
            command += ["--active-thread-percentage", str(setup.active_threads)]
        if setup.pinned_memory is not None:
            command += ["--pinned-memory-limit", setup.pinned_memory]
        if setup.multi_user:
            command += ["--multi-user"]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.pod_name(device), "namespace": self.namespace,
                         "labels": self.labels(device),
                         "annotations": {f"{self.driver}/setup": setup.describe()}},
            "spec": {
                "nodeName": self.node,
                "restartPolicy": "Always",
                # The MPS server checks its clients' PIDs; clients run in other pods.
                "hostPID": True,
                "priorityClassName": "system-node-critical",
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                "containers": [{
                    "name": COMPONENT,
                    "image": self.image,
                    "command": command,
                    # Under nvidia-container-runtime a variable set to anything but
                    # `void` (an image's `all`) makes it inject GPUs; this pod sees its
                    # GPU as privileged and needs nothing injected
                    # (docs/migrating-from-device-plugin.md).
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                    # Root, as NVIDIA runs the control daemon: the image's own user (65532)
                    # can create no socket in the root-owned folders the driver made, and
                    # every MPS prepare would time out. Privileged: the GPU device nodes.
                    "securityContext": {"privileged": True, "runAsUser": 0, "runAsGroup": 0},
                    "volumeMounts": [
                        {"name": "mps", "mountPath": str(paths.root)},
                        {"name": "shm", "mountPath": "/dev/shm"},
                        # HostToContainer: with the GPU operator's /run/nvidia/driver, a
                        # pod started before the operator's driver container mounted the
                        # installation there would see an empty folder for ever.
                        {"name": "driver-root", "mountPath": DAEMON_DRIVER_ROOT, "readOnly": True,
                         "mountPropagation": "HostToContainer"},
                        *pipe_mounts,
                    ],
                }],
                "volumes": [
                    {"name": "mps", "hostPath": {"path": str(paths.root), "type": "Directory"}},
                    {"name": "pipe", "hostPath": {"path": str(paths.pipe), "type": "Directory"}},
                    {"name": "shm", "hostPath": {"path": str(paths.shm), "type": "Directory"}},
                    {"name": "driver-root", "hostPath": {"path": str(self.driver_root_host),
                                                         "type": "Directory"}},
                ],
            },
        }
