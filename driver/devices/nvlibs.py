"""The NVIDIA user-space driver files a GPU container needs (libcuda, libnvidia-ml, ...).

The libraries must match the kernel driver, so they come from the node, not the image.
We bind-mount them where CUDA images look: the official images set
LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 and put /usr/local/nvidia/bin
on PATH, so no ldcache hook is needed. Each library is mounted under its SONAME
(libcuda.so.1), the name programs dlopen.
"""

from __future__ import annotations

import os
from pathlib import Path

from driver.cdi import Mount

LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib",
                "lib/x86_64-linux-gnu", "lib64")
BINARY_DIRS = ("usr/bin", "bin")
# name prefix -> SONAME. The compute stack; graphics/video libraries are left out.
LIBRARIES = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libnvidia-ptxjitcompiler.so": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm.so": "libnvidia-nvvm.so.4",
    "libcudadebugger.so": "libcudadebugger.so.1",
    "libnvidia-gpucomp.so": "libnvidia-gpucomp.so",
}
BINARIES = ("nvidia-smi", "nvidia-debugdump")
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"
CONTAINER_BIN_DIR = "/usr/local/nvidia/bin"


def find(local_root: Path, host_root: Path, version: str | None) -> tuple[Mount, ...]:
    """Mounts for the driver files of `version` found under `local_root` (where this process
    sees the driver installation), with host paths under `host_root` (where the runtime
    will find them). Without a version (no NVML), nothing."""
    if not version:
        return ()
    mounts: list[Mount] = []
    seen: set[str] = set()
    for directory in LIBRARY_DIRS:
        for prefix, soname in LIBRARIES.items():
            if soname in seen:
                continue
            relative = Path(directory) / f"{prefix}.{version}"
            if (local_root / relative).is_file():
                seen.add(soname)
                mounts.append(Mount(str(host_root / relative), f"{CONTAINER_LIB_DIR}/{soname}"))
    for directory in BINARY_DIRS:
        for binary in BINARIES:
            relative = Path(directory) / binary
            if binary not in seen and os.access(local_root / relative, os.X_OK):
                seen.add(binary)
                mounts.append(Mount(str(host_root / relative), f"{CONTAINER_BIN_DIR}/{binary}"))
    return tuple(mounts)


class DriverFiles:
    """find() once per driver version: the files change only with a driver upgrade, and a
    driver upgrade changes the version NVML reports."""

    def __init__(self, local_root: Path, host_root: Path) -> None:
        self.local_root = local_root
        self.host_root = host_root
        self._cache: dict[str | None, tuple[Mount, ...]] = {}

    def mounts(self, version: str | None) -> tuple[Mount, ...]:
        if version not in self._cache:
            self._cache = {version: find(self.local_root, self.host_root, version)}
        return self._cache[version]
