"""The MPS control daemon pod's mounts inside its read-only driver root, as runc treats
them: found on the real cluster (tests/cluster/test_examples.py, gpu-mps-shared-claim), where
every daemon pod of a mock node failed with `make mountpoint "/driver-root/tmp": mkdirat
…: read-only file system` and every MPS prepare timed out. The emulated kubelet now applies
the same rule, and the driver mounts inside the driver root only where the daemon chroots."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate

from driver.devices import mock
from driver.devices.model import Device, DeviceKind
from driver.prepare.mps import DAEMON_DRIVER_ROOT, MpsDaemons
from driver.prepare.setup import Setup
from driver.prepare.sharing import DeviceSharing, Use
from driver.sim.apiserver import ApiServer
from driver.sim.pods import PodRunner
from tests.conftest import REPO


def mounts_inside_read_only(manifest: dict) -> list[tuple[str, Path]]:
    """Each mount whose mountpoint lies in a read-only mount (the deepest mount above it,
    mounted first), with the host path that mountpoint must already have (runc cannot make
    a folder in a read-only bind mount)."""
    (c,) = manifest["spec"]["containers"]
    hosts = {v["name"]: Path(v["hostPath"]["path"]) for v in manifest["spec"]["volumes"]}
    out = []
    for m in c["volumeMounts"]:
        above = [p for p in c["volumeMounts"] if m["mountPath"].startswith(p["mountPath"].rstrip("/") + "/")]
        if above:
            parent = max(above, key=lambda p: len(p["mountPath"]))
            if parent.get("readOnly"):
                out.append((m["mountPath"], hosts[parent["name"]] / m["mountPath"][len(parent["mountPath"]):].lstrip("/")))
    return out


def daemon_sees(manifest: dict, chrooted: bool) -> tuple[str, Path]:
    """CUDA_MPS_PIPE_DIRECTORY as the daemon is told it (its --pipe-directory), and the host
    folder that path reaches through the pod's mounts (inside <driver-root> where it chroots)."""
    (c,) = manifest["spec"]["containers"]
    value = c["command"][c["command"].index("--pipe-directory") + 1]
    seen = f"{DAEMON_DRIVER_ROOT}{value}" if chrooted else value
    hosts = {v["name"]: Path(v["hostPath"]["path"]) for v in manifest["spec"]["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == seen]
    return value, hosts[mount["name"]]


def client_sees(daemons: MpsDaemons, device: str) -> tuple[str, Path]:
    """CUDA_MPS_PIPE_DIRECTORY of a client container (its CDI edits) and the host folder
    mounted at that path."""
    gpu = Device(device, DeviceKind.GPU, {"uuid": "GPU-1"})
    sharing = DeviceSharing(None, None, daemons, "boot", lambda: {})
    env, mounts = sharing.container_edits(Use("ns/c", gpu, Setup("MPS"), None, None), "DRA_GPU_0")
    value = dict(e.split("=", 1) for e in env)["CUDA_MPS_PIPE_DIRECTORY"]
    (mount,) = [m for m in mounts if m.container_path == value]
    return value, Path(mount.host_path)


def test_a_bare_driver_installation_gets_no_mounts_inside_it(tmp_path):
    node = mock.build(mock.load("mixed"), tmp_path / "mock")  # lib/ and bin/, no shell, no tmp/
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         node.driver_root)
    assert not daemons.chroots()
    manifest = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))
    assert mounts_inside_read_only(manifest) == []
    (c,) = manifest["spec"]["containers"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {
        str(daemons.paths("gpu-0").root), "/dev/shm", DAEMON_DRIVER_ROOT, "/tmp/nvidia-mps"}


def test_the_daemon_and_its_clients_use_one_pipe_directory_value(tmp_path):
    """NVIDIA's MPS documentation wants the same CUDA_MPS_PIPE_DIRECTORY for the control
    daemon and every client (issue 38, item 4): the chrooted daemon was told /tmp/pipe, the
    unchrooted one the host path, while clients get /tmp/nvidia-mps. Both kinds of pod must
    tell the daemon the clients' value and mount the pipe folder where the daemon sees it."""
    bare = mock.build(mock.load("mixed"), tmp_path / "mock").driver_root
    full = tmp_path / "run-nvidia-driver"
    for d in ("bin", "tmp", "dev/shm"):
        (full / d).mkdir(parents=True)
    (full / "bin" / "sh").write_text("")
    for root in (bare, full):
        daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img",
                             tmp_path / "state", root)
        manifest = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))
        client = client_sees(daemons, "gpu-0")
        assert daemon_sees(manifest, daemons.chroots()) == client, root
        assert client == ("/tmp/nvidia-mps", daemons.paths("gpu-0").pipe)


def test_the_daemon_pod_sees_a_driver_root_mounted_after_it_started(tmp_path):
    """The GPU operator mounts its driver at /run/nvidia/driver from its own container; a
    daemon pod started before that would see an empty folder for ever without
    HostToContainer propagation (issue 38, item 5)."""
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         Path("/run/nvidia/driver"), driver_root_local=tmp_path)
    (c,) = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))["spec"]["containers"]
    (root,) = [m for m in c["volumeMounts"] if m["mountPath"] == DAEMON_DRIVER_ROOT]
    assert root["mountPropagation"] == "HostToContainer"
    kubernetes_validate.validate(daemons.manifest("gpu-0", "GPU-1", Setup("MPS")), "1.34.0",
                                 strict=True)


def test_multi_user_starts_the_daemon_with_minus_m(tmp_path):
    """The claims' mpsConfig.multiUser reaches the control daemon (issue 38, item 6), and
    the mock control daemon takes -M as nvidia-cuda-mps-control does."""
    node = mock.build(mock.load("mixed"), tmp_path / "mock")
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         node.driver_root)
    (c,) = daemons.manifest("gpu-0", "GPU-1", Setup("MPS", multi_user=True))["spec"]["containers"]
    assert c["command"][-1] == "--multi-user"
    (c,) = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))["spec"]["containers"]
    assert "--multi-user" not in c["command"]
    paths = daemons.paths("gpu-0")
    paths.pipe.mkdir(parents=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe),
           "CUDA_MPS_LOG_DIRECTORY": str(paths.log), "DRA_MOCK_PYTHON": sys.executable}
    binary = node.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control"
    wrong = subprocess.run([str(binary), "-M"], env=env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "Usage" in wrong.stderr, "-M alone is not a daemon"
    daemon = subprocess.Popen([str(binary), "-f", "-M"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (paths.pipe / "control").exists():
            assert daemon.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert "multi-user mode on" in (paths.log / "control.log").read_text()


def test_a_full_root_filesystem_gets_them_and_has_their_mountpoints(tmp_path):
    root = tmp_path / "run-nvidia-driver"
    for d in ("bin", "tmp", "dev/shm"):
        (root / d).mkdir(parents=True)
    (root / "bin" / "sh").write_text("")
    # the driver sees the root where it mounts it (local), the runtime at the host path
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         Path("/run/nvidia/driver"), driver_root_local=root)
    assert daemons.chroots()
    inside = mounts_inside_read_only(daemons.manifest("gpu-0", "GPU-1", Setup("MPS")))
    assert [m for m, _ in inside] == [f"{DAEMON_DRIVER_ROOT}/tmp", f"{DAEMON_DRIVER_ROOT}/dev/shm"]
    assert all((root / p.relative_to("/run/nvidia/driver")).is_dir() for _, p in inside)


def _pod(ro: Path, other: Path, out: Path) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "p"},
            "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                     "volumes": [{"name": "ro", "hostPath": {"path": str(ro), "type": "Directory"}},
                                 {"name": "other", "hostPath": {"path": str(other), "type": "Directory"}}],
                     "containers": [{"name": "c", "command": ["/bin/sh", "-c", f"touch {out}"],
                                     "securityContext": {"runAsUser": 0},
                                     "volumeMounts": [{"name": "ro", "mountPath": "/ro", "readOnly": True},
                                                      {"name": "other", "mountPath": "/ro/sub"}]}]}}


def _wait_status(api: ApiServer, predicate, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        with api.state.lock:
            status = dict(api.state.pods[("ns", "p")].get("status") or {})
        if predicate(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def test_the_emulated_kubelet_refuses_a_mountpoint_it_cannot_make_in_a_read_only_mount(tmp_path):
    ro, other, out = tmp_path / "ro", tmp_path / "other", tmp_path / "ran"
    ro.mkdir(), other.mkdir()
    with ApiServer() as api, PodRunner(api, "node-a", tmp_path / "logs"):
        with api.state.lock:
            api.state.pods[("ns", "p")] = _pod(ro, other, out)
        status = _wait_status(api, lambda s: bool(s.get("containerStatuses")))
        waiting = status["containerStatuses"][0]["state"]["waiting"]
        assert status["phase"] == "Pending"
        assert f'make mountpoint "/ro/sub": mkdirat {ro}/sub: read-only file system' in waiting["message"]
        assert not out.exists()
        (ro / "sub").mkdir()  # the mountpoint exists now: runc mounts over it
        _wait_status(api, lambda s: s.get("phase") in ("Running", "Succeeded"))
        deadline = time.monotonic() + 10
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_container_of_the_emulated_kubelet_has_what_the_image_has_not_the_test_extra(tmp_path):
    """The image installs requirements.lock: cel-python (a runtime dependency, the gauges
    of `run` need it) is in it, the `test` extra (jsonschema, ...) is not, and the
    emulated container finds the same (tests/test_cli_without_extras.py)."""
    out = tmp_path / "out"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "uid": "p"},
           "spec": {"nodeName": "node-a", "restartPolicy": "Never", "containers": [{
               "name": "c", "securityContext": {"runAsUser": 0},
               "command": [sys.executable, "-c",
                           "import importlib.util, sys; import yaml, celpy\n"
                           "try:\n import jsonschema\nexcept ImportError:\n"
                           " open(sys.argv[1], 'w').write('celpy, no jsonschema')\n",
                           str(out)]}]}}
    with ApiServer() as api, PodRunner(api, "node-a", tmp_path / "logs"):
        with api.state.lock:
            api.state.pods[("ns", "p")] = pod
        deadline = time.monotonic() + 20
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert out.read_text() == "celpy, no jsonschema"


def test_the_mock_tools_run_under_the_callers_python_never_a_path_of_the_hosts(tmp_path):
    """The mock tree is shared by the driver on the host and the MPS daemon pod, whose
    Python is the image's /opt/dra: a tool script that names the host's interpreter runs
    nothing in the pod (a tier run from a virtual environment not on PATH crash-looped
    every MPS daemon pod). Each tool runs under the Python of whoever calls it."""
    node = mock.build(mock.load("mixed"), tmp_path / "mock")
    bin_dir = node.driver_root / "usr" / "bin"
    hosts = {sys.executable, os.path.realpath(sys.executable), sys.prefix + "/bin"}
    for script in bin_dir.iterdir():
        text = script.read_text()
        assert not [h for h in hosts if h in text], f"{script.name} names the host's Python:\n{text}"
    # The pod: its PATH has the image's Python first, a stand-in that says it ran.
    image_bin = tmp_path / "image" / "opt" / "dra" / "bin"
    image_bin.mkdir(parents=True)
    ran = tmp_path / "image-python-ran"
    (image_bin / "python3").write_text(f'#!/bin/sh\ntouch {ran}\nexec {sys.executable} "$@"\n')
    (image_bin / "python3").chmod(0o755)
    gpu = next(line.split(":", 1)[1].strip()
               for info in (node.proc / "driver" / "nvidia" / "gpus").glob("*/information")
               for line in info.read_text().splitlines() if line.startswith("GPU UUID:"))
    pod_env = {k: v for k, v in os.environ.items() if k != "DRA_MOCK_PYTHON"}
    pod_env["PATH"] = f"{image_bin}:/usr/bin:/bin"
    done = subprocess.run([str(bin_dir / "nvidia-smi"), "compute-policy", "-i", gpu,
                           "--set-timeslice", "1"], env=pod_env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert ran.exists(), "the tool ran under the host's interpreter, not the pod's"
    # The MPS daemon's wrapper (the pod's entry point) names its own Python to the tool.
    from driver.prepare.mps_daemon import launch
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         node.driver_root)
    paths = daemons.paths("gpu-0")
    paths.pipe.mkdir(parents=True)
    how = launch(node.driver_root, paths, pipe=str(paths.pipe))
    assert how.env["DRA_MOCK_PYTHON"] == sys.executable
