"""The two GPU settings sharing changes: compute mode and the compute time slice.

The compute mode goes through NVML (nvmlDeviceSetComputeMode; needs root, as the driver
pod has). The time slice has no NVML call in current drivers: `nvidia-smi compute-policy
-i <uuid> --set-timeslice <n>` is the interface, run from the node's driver installation:
chrooted there when it is a full root filesystem, else with that installation's
libnvidia-ml.so.1 preloaded by absolute path (the driver image has none). Both
settings last until changed again or the GPU is reset; a reboot clears them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.devices.mock.tools import PYTHON_VARIABLE
from driver.devices.nvlibs import locate
from driver.prepare.mps_daemon import chrooted

SMI_TIMEOUT = 30.0


class GpuControlError(Exception):
    """A setting could not be read or changed; the message names the GPU and the call."""


@dataclass
class GpuControl:
    nvml: Any  # the pynvml module of this node (the real bindings; in mock mode over a fake library)
    driver_root: Path  # the NVIDIA driver installation, as this process sees it

    def _call(self, uuid: str, what: str, fn, *args) -> Any:
        nv = self.nvml
        if nv is None:
            raise GpuControlError(f"GPU {uuid}: cannot {what}: NVML is not available on this node")
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            raise GpuControlError(f"GPU {uuid}: cannot {what}: nvmlInit: {err}") from err
        try:
            handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            return fn(handle, *args)
        except nv.NVMLError as err:
            raise GpuControlError(f"GPU {uuid}: cannot {what}: {err}") from err
        finally:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def compute_mode(self, uuid: str) -> int:
        return int(self._call(uuid, "read the compute mode", self.nvml.nvmlDeviceGetComputeMode))

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        self._call(uuid, f"set compute mode {mode_name(self.nvml, mode)}",
                   self.nvml.nvmlDeviceSetComputeMode, mode)

    def set_timeslice(self, uuid: str, timeslice: int) -> None:
        smi = self.driver_root / "usr" / "bin" / "nvidia-smi"
        if not smi.exists():
            raise GpuControlError(f"GPU {uuid}: cannot set the time slice: {smi} not found "
                                  "(--nvidia-driver-root names the driver installation)")
        env = dict(os.environ)
        # A mock node's nvidia-smi is a script that runs the mock's tool under the Python
        # it is told (driver/devices/mock/tools.py): ours. A real nvidia-smi ignores it.
        env[PYTHON_VARIABLE] = sys.executable
        arguments = ["compute-policy", "-i", uuid, "--set-timeslice", str(timeslice)]
        if chrooted(self.driver_root):
            # A full root filesystem: nvidia-smi runs with the glibc it was built against.
            command = ["chroot", str(self.driver_root), "/usr/bin/nvidia-smi", *arguments]
        else:
            # Only libnvidia-ml.so.1 itself, by absolute path: the installation's library
            # folders also hold the host's glibc, which must not replace the image's.
            library = locate(self.driver_root, "libnvidia-ml.so.1")
            if library is not None:
                env["LD_PRELOAD"] = ":".join(filter(None, (str(library), env.get("LD_PRELOAD"))))
            command = [str(smi), *arguments]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=SMI_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise GpuControlError(f"GPU {uuid}: nvidia-smi {' '.join(arguments)}: {err}") from err
        if done.returncode != 0:
            output = " ".join((done.stderr or done.stdout).split())
            raise GpuControlError(f"GPU {uuid}: nvidia-smi {' '.join(arguments)} failed "
                                  f"({done.returncode}): {output}")


def mode_name(nvml: Any, mode: int) -> str:
    names = {getattr(nvml, n, None): n.removeprefix("NVML_COMPUTEMODE_")
             for n in ("NVML_COMPUTEMODE_DEFAULT", "NVML_COMPUTEMODE_PROHIBITED",
                       "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS")}
    return names.get(mode, str(mode))
