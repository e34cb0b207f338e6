"""Runs `dra-driver run` as a real process against the API emulator, in a short temp dir
(unix socket paths are limited to 107 bytes, pytest's tmp_path can be longer)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import FakeKubelet

DRIVER = "accel.dra.io"


@dataclass
class DriverDirs:
    root: Path

    @classmethod
    def make(cls) -> "DriverDirs":
        from tests.conftest import SHORT_TMP_PREFIX

        return cls(Path(tempfile.mkdtemp(prefix=Path(SHORT_TMP_PREFIX).name, dir="/tmp")))

    @property
    def registry(self) -> Path:
        return self.root / "registry"

    @property
    def plugins(self) -> Path:
        return self.root / "plugins"

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def state(self) -> Path:
        return self.root / "state"

    def cleanup(self) -> None:
        from driver.prepare import shm

        shm.release_all_under(self.root)  # MPS tmpfs mounts a killed driver left
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class DriverProcess:
    api: ApiServer
    dirs: DriverDirs
    profile: str = "mixed"
    node: str = "node-a"
    extra: list[str] = field(default_factory=list)
    cdi_root: Path | None = None
    driver: str = DRIVER
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    # Run inside this command (e.g. tests/netns.py in its own network namespace).
    wrapper: list[str] = field(default_factory=list)
    # False: the defaults 9400/9401, as the chart starts the driver.
    disable_ports: bool = True

    def args(self) -> list[str]:
        ports = ["--metrics-port", "0", "--healthz-port", "0"] if self.disable_ports else []
        return [
            *self.wrapper,
            sys.executable, "-m", "driver", "run",
            "--node-name", self.node, "--driver-name", self.driver, "--mock", self.profile,
            "--kubeconfig", str(self.api.kubeconfig(self.dirs.root)),
            "--kubelet-registrar-dir", str(self.dirs.registry),
            "--kubelet-plugins-dir", str(self.dirs.plugins),
            "--cdi-root", str(self.cdi_root or self.dirs.cdi),
            "--state-dir", str(self.dirs.state),
            *ports, "--log-format", "json",
            *self.extra,
        ]

    def start(self) -> "DriverProcess":
        self.log_path = self.dirs.root / f"driver-{len(list(self.dirs.root.glob('driver-*.log')))}.log"
        log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def kubelet(self) -> FakeKubelet:
        kubelet = FakeKubelet(self.dirs.registry)
        try:
            kubelet.register()
        except Exception:
            raise AssertionError(f"registration failed; driver log:\n{self.log()}")
        return kubelet

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""
