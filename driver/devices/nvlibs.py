"""The NVIDIA user-space driver files a GPU container needs (libcuda, libnvidia-ml, ...).

The libraries must match the kernel driver, so they come from the node, not the image.
We bind-mount them where CUDA images look: the official images set
LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 and put /usr/local/nvidia/bin
on PATH, so no ldcache hook is needed. Each library is mounted under its SONAME
(libcuda.so.1), the name programs dlopen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class DriverFile:
    """One file of the installation: where the runtime finds it on the host, and where a
    container gets it (the prepare side makes a CDI bind mount of it)."""

    host_path: str
    container_path: str
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"
CONTAINER_BIN_DIR = "/usr/local/nvidia/bin"


def find(local_root: Path, host_root: Path, version: str | None) -> tuple[DriverFile, ...]:
    """The driver files of `version` found under `local_root` (where this process
    sees the driver installation), with host paths under `host_root` (where the runtime
    will find them). Without a version (no NVML), nothing."""
    if not version:
        return ()
    mounts: list[DriverFile] = []
    seen: set[str] = set()
    for directory in LIBRARY_DIRS:
        for prefix, soname in LIBRARIES.items():
            if soname in seen:
                continue
            relative = Path(directory) / f"{prefix}.{version}"
            if (local_root / relative).is_file():
                seen.add(soname)
                mounts.append(DriverFile(str(host_root / relative), f"{CONTAINER_LIB_DIR}/{soname}"))
    for directory in BINARY_DIRS:
        for binary in BINARIES:
            relative = Path(directory) / binary
            if binary not in seen and os.access(local_root / relative, os.X_OK):
                seen.add(binary)
                mounts.append(DriverFile(str(host_root / relative), f"{CONTAINER_BIN_DIR}/{binary}"))
    return tuple(mounts)


class DriverFiles:
    """find() once per driver version: the files change only with a driver upgrade, and a
    driver upgrade changes the version NVML reports."""

    def __init__(self, local_root: Path, host_root: Path) -> None:
        self.local_root = local_root
        self.host_root = host_root
        self._cache: dict[str | None, tuple[DriverFile, ...]] = {}

    def files(self, version: str | None) -> tuple[DriverFile, ...]:
        if version not in self._cache:
            self._cache = {version: find(self.local_root, self.host_root, version)}
        return self._cache[version]


# -- finding one library inside a driver installation -----------------------------------
# Where a root filesystem keeps its libraries, in the order the NVIDIA container toolkit
# searches a driver root when its ld.so.cache names none; /etc/ld.so.conf's folders follow.
SEARCH_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
               "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "usr/lib", "lib")
MAX_LINKS = 40  # what the kernel allows in one path walk


def resolve_in_root(root: Path, path: str) -> Path | None:
    """`path` as a process chrooted to `root` would reach it: symbolic links (absolute ones
    too, such as a /lib64 -> /usr/lib64) are followed inside `root`, never into the
    filesystem this process runs in. None when a component is missing or the links loop."""
    pending = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        if candidate.is_symlink():
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        if not candidate.exists():
            return None
        done.append(part)
    return root.joinpath(*done)


def _configured_dirs(root: Path, conf: str = "etc/ld.so.conf", depth: int = 0) -> list[str]:
    """Library folders named in the installation's ld.so.conf (with its `include` globs)."""
    path = resolve_in_root(root, conf)
    if path is None or depth > 4:
        return []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line.startswith("include "):
            pattern = line.split(None, 1)[1].strip()
            if not pattern.startswith("/"):
                pattern = str(Path(conf).parent / pattern)
            for included in sorted(root.glob(pattern.lstrip("/"))):
                found += _configured_dirs(root, str(included.relative_to(root)), depth + 1)
        elif line.startswith("/"):
            found.append(line.lstrip("/"))
    return found


def locate(root: Path, soname: str) -> Path | None:
    """Where `soname` (libnvidia-ml.so.1, libcuda.so.1) of the installation at `root` is,
    as a path this process can open; None when the installation has none."""
    seen: set[str] = set()
    for directory in (*SEARCH_DIRS, *_configured_dirs(root)):
        if directory in seen:
            continue
        seen.add(directory)
        found = resolve_in_root(root, f"{directory}/{soname}")
        if found is not None and found.is_file():
            return found
    return None
