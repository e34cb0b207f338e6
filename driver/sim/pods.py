"""The kubelet's part for pods the driver creates (MPS control daemons): run them.

A PodRunner for a node watches the emulator's pods bound to that node and runs each
container's `command` as a local process, in its own session, so that it outlives the
driver process exactly as a pod outlives the driver pod. Like the kubelet it checks
hostPath volumes (`type: Directory` must exist), restarts containers that exit when
`restartPolicy: Always`, reports status, and on delete sends SIGTERM, waits for the grace
period, then SIGKILL, and only then removes the pod.

Like the kubelet it runs the container as the pod's user: `runAsUser` of the container or
the pod, else the image's own user (IMAGE_USER, our Dockerfile's `USER`). Where the
emulator itself runs as root, a non-root user is really switched to, so a pod that needs
root and forgets to ask for it fails here as on a node. `start_delay` stands for the image
pull and container start of a real node (the container waits as `ContainerCreating`).

What it cannot do is give the process a mount namespace. Instead every command argument
and environment value that starts with a volume's mountPath is rewritten to the volume's
host path, which is what the process would reach through the mount; a pod whose
program found its files by other means would fail here, not silently work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from driver.sim.apiserver import ApiServer

TICK = 0.05
MAX_GRACE = 10.0
IMAGE_USER = 65532  # the driver image's USER (Dockerfile); tests/test_dockerfile.py checks it
# What the image does not install: it has requirements.lock, not the `test` extra. A
# container here runs with this process's packages, so these are made unimportable in it,
# as they are in the image (found on the real cluster: the daemon pod crashed at "No module
# named 'celpy'" while the emulated one ran, before cel-python became a runtime dependency).
NOT_IN_IMAGE = ("pytest", "jsonschema", "kubernetes_validate", "grpc_tools", "trustme")


@dataclass
class _Running:
    process: subprocess.Popen | None
    restarts: int = 0
    next_start: float = 0.0
    terminating_since: float | None = None
    error: str = ""


@dataclass
class PodRunner:
    api: ApiServer
    node: str
    log_dir: Path
    start_delay: float = 0.0  # seconds from a pod's first sight to its container's start
    _running: dict[tuple[str, str], _Running] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "PodRunner":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.api.state.lock:
            self.api.state.pod_nodes.add(self.node)
        self._thread = threading.Thread(target=self._loop, name=f"pods-{self.node}", daemon=True)
        self._thread.start()
        return self

    def _image_site(self) -> Path:
        """A folder with a sitecustomize that hides NOT_IN_IMAGE from the container's Python."""
        site = self.log_dir / "image-site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in NOT_IN_IMAGE))
        return site

    def __exit__(self, *exc) -> None:
        """The node shuts down: every pod's processes end (the pods stay in the API)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for running in self._running.values():
            _terminate(running.process, 5.0)
        with self.api.state.lock:
            self.api.state.pod_nodes.discard(self.node)

    def processes(self) -> dict[str, int]:
        """pod name -> PID of its running container process (tests kill these)."""
        return {name: r.process.pid for (_, name), r in self._running.items()
                if r.process is not None and r.process.poll() is None}

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.api.state.lock:
                pods = {k: p for k, p in self.api.state.pods.items()
                        if p["spec"].get("nodeName") == self.node}
            for key, pod in pods.items():
                self._sync(key, pod)
            for key in set(self._running) - set(pods):
                _terminate(self._running.pop(key).process, 1.0)  # removed without us
            self._stop.wait(TICK)

    def _sync(self, key: tuple[str, str], pod: dict) -> None:
        now = time.monotonic()
        if key not in self._running:
            self._running[key] = _Running(None, next_start=now + self.start_delay)
            if self.start_delay > 0:
                self._status(key, "Pending", self._running[key], waiting="ContainerCreating")
        running = self._running[key]
        if pod["metadata"].get("deletionTimestamp"):
            grace = min(MAX_GRACE, float(pod["spec"].get("terminationGracePeriodSeconds", 30)))
            if running.process is not None and running.process.poll() is None:
                if running.terminating_since is None:
                    running.terminating_since = now
                    running.process.send_signal(signal.SIGTERM)
                    return
                if now - running.terminating_since < grace:
                    return
                running.process.kill()
                running.process.wait()
            with self.api.state.lock:
                self.api.state.pods.pop(key, None)
                self.api.state.resource_version += 1
                self.api.state.changed.notify_all()
            self._running.pop(key, None)
            return
        process = running.process
        if process is not None and process.poll() is None:
            return
        if process is not None:  # exited
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Never" or (policy == "OnFailure" and process.returncode == 0):
                self._status(key, "Succeeded" if process.returncode == 0 else "Failed", running)
                return
            if running.next_start == 0.0:
                running.restarts += 1
                running.next_start = now + min(5.0, 0.2 * 2 ** running.restarts)
        if now < running.next_start:
            return
        running.next_start = 0.0
        try:
            running.process = self._start(key, pod)
            running.error = ""
            self._status(key, "Running", running)
        except _ContainerError as err:
            running.error = str(err)
            running.process = None
            running.next_start = now + 1.0
            self._status(key, "Pending", running)

    def _start(self, key: tuple[str, str], pod: dict) -> subprocess.Popen:
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        (container,) = spec["containers"]  # the driver's pods have one container
        mounts: list[tuple[str, str]] = []
        for mount in container.get("volumeMounts") or []:
            host = (volumes[mount["name"]].get("hostPath") or {})
            if not host:
                raise _ContainerError(f"volume {mount['name']}: only hostPath volumes are emulated")
            path = Path(host["path"])
            if host.get("type") == "Directory" and not path.is_dir():
                raise _ContainerError(f"hostPath type check failed: {path} is not a directory")
            mounts.append((mount["mountPath"].rstrip("/") or "/", str(path)))
        mounts.sort(key=lambda m: -len(m[0]))
        # runc makes each mountpoint in the rootfs as it has been mounted so far; inside a
        # read-only mount it cannot make one, and the container fails to start. (Found on
        # the real cluster: the MPS daemon pod's mounts inside its read-only driver root.)
        # The mountpoint lies in the deepest mount above it (mounted first: parents before
        # children); only where that one is read-only must it exist already.
        read_only = {m["mountPath"].rstrip("/") or "/" for m in container.get("volumeMounts") or []
                     if m.get("readOnly")}
        for inside, _ in mounts:
            above = [(p, o) for p, o in mounts if inside.startswith(p.rstrip("/") + "/")]
            if not above:
                continue
            parent, parent_outside = max(above, key=lambda m: len(m[0]))
            if parent in read_only:
                mountpoint = Path(parent_outside) / inside[len(parent):].lstrip("/")
                if not mountpoint.exists():
                    raise _ContainerError(
                        f'error mounting to rootfs at "{inside}": make mountpoint "{inside}": '
                        f"mkdirat {mountpoint}: read-only file system")

        def translate(value: str) -> str:
            for inside, outside in mounts:
                if value == inside or value.startswith(inside + "/"):
                    return outside + value[len(inside):]
            return value

        command = [translate(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not command:
            raise _ContainerError("the emulated kubelet needs an explicit command (no image entrypoints)")
        env = dict(os.environ)
        # The image's PATH: where this Python's scripts are (dra-driver in a virtualenv).
        env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(self._image_site()), env.get("PYTHONPATH"))))
        env.update({e["name"]: translate(str(e.get("value", ""))) for e in container.get("env") or []})
        context = {**((spec.get("securityContext") or {})),
                   **{k: v for k, v in (container.get("securityContext") or {}).items()
                      if k in ("runAsUser", "runAsGroup")}}
        user = int(context.get("runAsUser", IMAGE_USER))
        group = int(context.get("runAsGroup", user if "runAsUser" in context else IMAGE_USER))
        switch = {"user": user, "group": group, "extra_groups": []} \
            if os.geteuid() == 0 and user != 0 else {}
        log = open(self.log_dir / f"{key[0]}_{key[1]}.log", "ab")
        try:
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **switch)
        except OSError as err:
            raise _ContainerError(f"cannot start {command[0]}: {err}") from err
        finally:
            log.close()

    def _status(self, key: tuple[str, str], phase: str, running: _Running,
                waiting: str = "") -> None:
        state = {"running": {}} if phase == "Running" else \
            {"waiting": {"reason": "CreateContainerConfigError", "message": running.error}} \
            if running.error else {"waiting": {"reason": waiting}} if waiting else {"terminated": {}}
        with self.api.state.lock:
            pod = self.api.state.pods.get(key)
            if pod is None:
                return
            pod["status"] = {"phase": phase, "containerStatuses": [{
                "name": pod["spec"]["containers"][0]["name"], "ready": phase == "Running",
                "restartCount": running.restarts, "state": state}]}


class _ContainerError(Exception):
    pass


def _terminate(process: subprocess.Popen | None, grace: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
