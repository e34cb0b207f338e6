"""Issue 38, item 5: a driver pod that starts before the GPU operator's driver container has
mounted the NVIDIA installation under the driver root.

The driver runs as a real process on a real-node configuration (no --mock): the sysfs,
/dev and /proc trees of a mock profile stand in for the host's (they hold NVIDIA GPUs, or
only NICs), the driver root is an empty folder, and NVML is the real nvidia-ml-py, which
finds no libnvidia-ml.so.1 there, as on such a node. The library that "appears" later is
a real shared object (Python's own _ctypes, as in tests/test_real_node.py): the driver
loads it by absolute path from the driver root, and nvmlInit then fails with
FunctionNotFound (it exports no NVML), which proves the library was reached; with a real
driver's library the same discovery finds the GPUs.
"""

from __future__ import annotations

import _ctypes
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from driver.devices import mock
from driver.devices.driverwait import nvidia_gpus_on_pci
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import FakeKubelet
from tests.driverproc import DriverDirs
from tests.inprocess import free_port
from tests.test_chart import container, render

LIB_DIR = "usr/lib/x86_64-linux-gnu"


def install_library(driver_root: Path) -> Path:
    """The installation's NVML appearing, with its SONAME link as drivers ship it."""
    lib = driver_root / LIB_DIR
    lib.mkdir(parents=True, exist_ok=True)
    shutil.copy(_ctypes.__file__, lib / "libnvidia-ml.so.550.54.15")
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    return lib / "libnvidia-ml.so.550.54.15"


class RealNodeDriver:
    """`dra-driver run` without --mock, on a mock profile's trees and an empty driver root."""

    def __init__(self, api: ApiServer, dirs: DriverDirs, profile: str, *extra: str) -> None:
        self.dirs = dirs
        self.node = mock.build(mock.load(profile), dirs.root / "node")
        self.driver_root = dirs.root / "driver-root"
        self.driver_root.mkdir()
        self.healthz = free_port()
        self.log_path = dirs.root / "driver.log"
        self.args = [
            sys.executable, "-m", "driver", "run", "--node-name", "node-a",
            "--kubeconfig", str(api.kubeconfig(dirs.root)),
            "--kubelet-registrar-dir", str(dirs.registry), "--kubelet-plugins-dir", str(dirs.plugins),
            "--cdi-root", str(dirs.cdi), "--state-dir", str(dirs.state),
            "--sysfs-root", str(self.node.sysfs), "--dev-root", str(self.node.dev),
            "--proc-root", str(self.node.proc), "--nvidia-driver-root", str(self.driver_root),
            "--metrics-port", "0", "--healthz-port", str(self.healthz), "--log-format", "json",
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "RealNodeDriver":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        assert self.proc.wait(30) == 0, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == name:
                out.append(record)
        return out

    def wait_event(self, name: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(name)
            if found:
                return found[0]
            assert self.proc.poll() is None, f"driver exited before {name}:\n{self.log()}"
            time.sleep(0.1)
        raise AssertionError(f"no {name} within {timeout}s:\n{self.log()}")

    def probe(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except urllib.error.URLError as err:  # not listening yet
            return 0, str(err)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.probe("/readyz")[0] != 200:
            assert time.monotonic() < deadline, f"not ready: {self.probe('/readyz')}\n{self.log()}"
            time.sleep(0.1)


@pytest.fixture
def world():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        yield api, dirs
    dirs.cleanup()


def registry_sockets(dirs: DriverDirs) -> list[str]:
    return sorted(p.name for p in dirs.registry.glob("*.sock")) if dirs.registry.exists() else []


def test_a_gpu_node_waits_not_ready_until_the_library_appears(world):
    api, dirs = world
    with RealNodeDriver(api, dirs, "l4", "--nvidia-driver-wait", "120") as driver:
        started = driver.wait_event("nvidia_driver_waiting")
        assert started["gpus_on_pci"] == nvidia_gpus_on_pci(driver.node.sysfs) > 0
        assert started["driver_root"] == str(driver.driver_root) and started["timeout_seconds"] == 120
        deadline = time.monotonic() + 10
        while driver.probe("/readyz")[0] == 0:
            assert time.monotonic() < deadline, "the probes are not served while waiting"
            time.sleep(0.1)
        code, body = driver.probe("/readyz")
        assert code == 503 and "waiting for the NVIDIA driver: no libnvidia-ml.so.1 under" in body, body
        assert driver.probe("/livez")[0] == 200
        # The kubelet does not see the driver meanwhile, and nothing is published.
        assert registry_sockets(dirs) == [] and not api.state.slices
        assert driver.events("nvidia_driver_wait_ended") == []

        library = install_library(driver.driver_root)
        ended = driver.wait_event("nvidia_driver_wait_ended")
        assert ended["found"] is True and ended["library"] == str(library)  # the SONAME link, followed
        FakeKubelet(dirs.registry).register()
        driver.wait_ready()
        # The stand-in has no NVML functions: nvmlInit reached it and said so.
        (unavailable,) = driver.events("nvml_unavailable")
        assert "Function Not Found" in unavailable["reason"], unavailable
        assert len(driver.events("nvidia_driver_waiting")) == 1  # one line at start ...
        assert len(driver.events("nvidia_driver_wait_ended")) == 1  # ... and one at the end
        assert driver.events("nvml_library_loaded") == []  # loaded at start, not late


def test_after_the_bound_it_starts_without_gpus_and_rediscovery_loads_the_library(world):
    api, dirs = world
    with RealNodeDriver(api, dirs, "l4", "--nvidia-driver-wait", "1",
                        "--rediscover-interval", "1") as driver:
        ended = driver.wait_event("nvidia_driver_wait_ended")
        assert ended["found"] is False and ended["level"] == "warning"
        assert "starting without GPUs; rediscovery publishes them once it appears" in ended["reason"]
        FakeKubelet(dirs.registry).register()
        driver.wait_ready()
        (unavailable,) = driver.events("nvml_unavailable")
        assert "Library Not Found" in unavailable["reason"], unavailable
        assert driver.events("nvml_library_loaded") == []

        library = install_library(driver.driver_root)
        # the next periodic rediscovery binds NVML to it
        assert driver.wait_event("nvml_library_loaded", timeout=20)["library"] == str(library)


def test_sigterm_while_waiting_stops_at_once_having_started_nothing(world):
    api, dirs = world
    with RealNodeDriver(api, dirs, "l4", "--nvidia-driver-wait", "120") as driver:
        driver.wait_event("nvidia_driver_waiting")
        driver.proc.terminate()
        assert driver.proc.wait(10) == 0, driver.log()
        (ended,) = driver.events("nvidia_driver_wait_ended")
        assert ended["found"] is False and ended["reason"] == "stopping"
        assert registry_sockets(dirs) == [] and driver.events("plugin_serving") == []


@pytest.mark.parametrize("profile", ["sriov", "alveo"])
def test_a_node_without_nvidia_gpus_starts_at_once(world, profile):
    """A NIC- or FPGA-only node under a chart whose driver root (one value for the whole
    cluster) is the GPU operator's: it has no NVIDIA GPU on the bus, so no wait."""
    api, dirs = world
    with RealNodeDriver(api, dirs, profile, "--nvidia-driver-wait", "120") as driver:
        assert nvidia_gpus_on_pci(driver.node.sysfs) == 0
        FakeKubelet(dirs.registry).register()
        driver.wait_ready()
        assert driver.events("nvidia_driver_waiting") == []


def test_a_bad_wait_value_is_one_line_naming_the_option():
    done = subprocess.run([sys.executable, "-m", "driver", "run", "--nvidia-driver-wait", "soon"],
                          capture_output=True, text=True, env={**os.environ, "NODE_NAME": "n"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nvidia-driver-wait" in lines[0] and "Traceback" not in done.stderr


def test_the_chart_propagates_later_mounts_of_the_driver_root_and_sets_the_bound():
    objects = render({"nvidia": {"driverRoot": "/run/nvidia/driver", "driverWaitSeconds": 900}})
    ds, plugin, env = container(objects)
    (mount,) = [m for m in plugin["volumeMounts"] if m["name"] == "driver-root"]
    assert mount["mountPropagation"] == "HostToContainer" and mount["readOnly"] is True
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "driver-root"]
    # the pod must start where the operator has not made the folder yet (or never will)
    assert volume["hostPath"] == {"path": "/run/nvidia/driver", "type": "DirectoryOrCreate"}
    assert env["NVIDIA_DRIVER_WAIT"] == "900"
    assert container(render())[2]["NVIDIA_DRIVER_WAIT"] == "300"
