"""What a real GPU node does that our mocks did not: a driver installation whose library
folders hold the host's glibc, an image whose default user is not root, a control daemon
chrooted into the driver root (issue 28, items 1-3)."""

from __future__ import annotations

import _ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from driver.devices import mock
from driver.prepare.mps_daemon import CHROOT_DIRECTORY, DaemonError, MpsPaths, launch
from driver.prepare.mps import DAEMON_DRIVER_ROOT, MpsDaemons
from driver.prepare.setup import Setup
from driver.sim.apiserver import ApiServer
from driver.sim.pods import IMAGE_USER, PodRunner
from tests.test_chart import container, render

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, user switch); CI is root")
LIB_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu")


def host_glibc(driver_root: Path) -> None:
    """A libc.so.6 beside the NVIDIA libraries that the image's loader cannot use, as the
    host's glibc is to an image built on another one."""
    for directory in LIB_DIRS:
        (driver_root / directory).mkdir(parents=True, exist_ok=True)
        (driver_root / directory / "libc.so.6").write_bytes(b"\x7fELF not this image's glibc")


def test_a_host_glibc_on_the_search_path_kills_every_process(tmp_path):
    """The premise of the tests below: such a folder on LD_LIBRARY_PATH is fatal."""
    host_glibc(tmp_path)
    done = subprocess.run(["/bin/true"], env={"LD_LIBRARY_PATH": str(tmp_path / "usr/lib64")},
                          capture_output=True, text=True)
    assert done.returncode != 0 and "libc.so.6" in done.stderr


def test_the_chart_puts_no_host_library_folder_on_the_plugins_search_path(tmp_path):
    _, plugin, env = container(render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}}))
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    assert mounts["driver-root"] == "/driver-root" and env["NVIDIA_DRIVER_ROOT_MOUNT"] == "/driver-root"
    host_glibc(tmp_path)
    # The container's environment, with /driver-root where this test's driver root is.
    literal = {k: str(v).replace("/driver-root", str(tmp_path)) for k, v in env.items()
               if isinstance(v, str)}
    done = subprocess.run([sys.executable, "-c", "import driver.cli"],
                          env={**os.environ, **literal}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not {"LD_LIBRARY_PATH", "LD_PRELOAD"} & set(env)


def test_nvml_is_loaded_by_absolute_path_from_the_driver_root(tmp_path):
    host_glibc(tmp_path)
    lib = tmp_path / "usr/lib/x86_64-linux-gnu"
    # A real shared object stands in for libnvidia-ml; the SONAME link is absolute, as
    # distributions ship it, and must be followed inside the driver root.
    shutil.copy(_ctypes.__file__, lib / "libnvidia-ml.so.550.54.15")
    (lib / "libnvidia-ml.so.1").symlink_to("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15")
    script = ("import sys; from pathlib import Path; from driver.devices.nvml import load_nvml\n"
              "nv = load_nvml(Path(sys.argv[1])); print(nv.nvmlLib._name)\n"
              "try:\n    nv.nvmlInit()\nexcept nv.NVMLError as err:\n    print('init:', err)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded, init = done.stdout.splitlines()
    assert loaded == str(lib / "libnvidia-ml.so.550.54.15")
    assert init.startswith("init:"), "the stand-in has no nvmlInit: an NVML error, not a crash"


def test_the_mps_daemon_starts_beside_a_host_glibc(tmp_path):
    node = mock.build(mock.load("h100x8"), tmp_path / "mock")
    host_glibc(node.driver_root)
    directory = tmp_path / "mps"
    (directory / "pipe").mkdir(parents=True)  # no pod here: the pipe folder is where it is
    daemon = subprocess.Popen(
        [sys.executable, "-m", "driver", "mps-control-daemon", "--uuid", "GPU-test",
         "--directory", str(directory), "--nvidia-driver-root", str(node.driver_root),
         "--pipe-directory", str(directory / "pipe")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (directory / "ready").exists():
            assert daemon.poll() is None, daemon.stdout.read()
            assert time.monotonic() < deadline, "the daemon did not get ready"
            time.sleep(0.05)
    finally:
        daemon.terminate()
    assert daemon.wait(30) == 0, daemon.stdout.read()


def test_the_daemon_pod_runs_as_root_and_mounts_its_folders_inside_the_driver_root(tmp_path):
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path, Path("/"))
    manifest = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))
    (c,) = manifest["spec"]["containers"]
    assert c["securityContext"]["runAsUser"] == 0
    volumes = {v["name"]: v["hostPath"]["path"] for v in manifest["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    paths = daemons.paths("gpu-0")
    assert mounts[f"{DAEMON_DRIVER_ROOT}{CHROOT_DIRECTORY}"] == str(paths.root)
    assert mounts[f"{DAEMON_DRIVER_ROOT}/dev/shm"] == str(paths.shm) == mounts["/dev/shm"]


@ROOT_ONLY
def test_the_emulated_kubelet_runs_a_pod_as_the_images_user_unless_it_asks_for_root(tmp_path):
    out = Path(tempfile.mkdtemp(prefix="dra-test-uid-", dir="/tmp"))  # tmp_path's parents are 0700
    out.chmod(0o777)
    try:
        _run_as_pods(tmp_path, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _run_as_pods(tmp_path: Path, out: Path) -> None:

    def pod(name: str, context: dict) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "ns", "uid": name},
                "spec": {"nodeName": "node-a", "restartPolicy": "Never", "containers": [{
                    "name": "c", "command": ["/bin/sh", "-c", f"id -u > {out}/{name}"],
                    "securityContext": context}]}}

    with ApiServer() as api, PodRunner(api, "node-a", tmp_path / "logs"):
        with api.state.lock:
            api.state.pods[("ns", "plain")] = pod("plain", {})
            api.state.pods[("ns", "root")] = pod("root", {"runAsUser": 0})
        deadline = time.monotonic() + 30
        while not ((out / "plain").exists() and (out / "root").exists()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    time.sleep(0.2)
    assert (out / "plain").read_text().strip() == str(IMAGE_USER)
    assert (out / "root").read_text().strip() == "0"


@ROOT_ONLY
def test_the_chrooted_daemon_is_given_the_paths_it_sees_inside_the_driver_root(tmp_path):
    root = tmp_path / "driver-root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "sh").write_text("")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "nvidia-cuda-mps-control").write_text("")
    paths = MpsPaths(tmp_path / "state" / "mps" / "gpu-0")
    paths.pipe.mkdir(parents=True)
    paths.log.mkdir(parents=True)
    (root / "tmp").mkdir()
    with pytest.raises(DaemonError, match=f"is not mounted at {root}/tmp"):
        launch(root, paths)
    (root / "tmp").rmdir()
    (root / "tmp").symlink_to(paths.root)  # what the pod's mount shows the wrapper
    with pytest.raises(DaemonError, match=f"{paths.pipe} is not mounted at {root}/tmp/nvidia-mps"):
        launch(root, paths)
    paths.chroot_pipe_mountpoint.symlink_to(paths.pipe)  # the pipe folder's own mount
    how = launch(root, paths)
    assert how.prefix == ("chroot", str(root), "/usr/bin/nvidia-cuda-mps-control")
    # The value its clients get (issue 38, item 4), not /tmp/pipe.
    assert (how.pipe, how.log) == ("/tmp/nvidia-mps", "/tmp/log")
    assert "LD_LIBRARY_PATH" not in how.env


def test_the_unchrooted_daemon_gets_path_and_preloads_not_library_folders(tmp_path):
    node = mock.build(mock.load("h100x8"), tmp_path / "mock")
    lib = node.driver_root / "usr/lib/x86_64-linux-gnu"
    shutil.copy(_ctypes.__file__, lib / "libcuda.so.1")
    paths = MpsPaths(tmp_path / "mps")
    paths.pipe.mkdir(parents=True)
    with pytest.raises(DaemonError, match=f"{paths.pipe} is not mounted at /nonexistent/nvidia-mps"):
        launch(node.driver_root, paths, "/nonexistent/nvidia-mps")
    how = launch(node.driver_root, paths, str(paths.pipe))
    assert how.env["PATH"].split(os.pathsep)[0] == str(node.driver_root / "usr" / "bin")
    assert how.env["LD_PRELOAD"].split(":")[0] == str(lib / "libcuda.so.1")
    assert "LD_LIBRARY_PATH" not in how.env


def test_the_driver_discovers_beside_a_host_glibc_with_nvml_from_the_driver_root(tmp_path):
    """The driver's own start on such a node, with --nvidia-driver-root (which discover now
    takes too, so that it reads NVML where the plugin does): the host's glibc beside the
    NVIDIA libraries is never loaded and the process runs to its end."""
    root = tmp_path / "driver-root"
    host_glibc(root)
    lib = root / "usr/lib/x86_64-linux-gnu"
    shutil.copy(_ctypes.__file__, lib / "libnvidia-ml.so.1")
    for empty in ("sys/bus/pci/devices", "sys/class/net", "proc"):
        (tmp_path / empty).mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "driver", "discover", "--node-name", "n",
                           "--nvidia-driver-root", str(root), "--sysfs-root", str(tmp_path / "sys"),
                           "--proc-root", str(tmp_path / "proc")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "(no devices found)" in done.stdout
