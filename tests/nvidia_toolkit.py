"""NVIDIA Container Toolkit binaries for tests, built as CI builds them.

`hack/local-cluster/build.sh nvidia-toolkit` (part of `build.sh all`) builds nvidia-ctk,
nvidia-container-runtime, nvidia-cdi-hook at versions.env's tag and the native
libnvidia-ml.so.1 for mock nodes; a second call is a stamp check. Without Go or a C
compiler the tests that need them are skipped with the reason, and fail under CI=true (as
the allocator-oracle tests do).
"""

from __future__ import annotations

import shutil
from pathlib import Path


from tests import gobuilt

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = ROOT / "hack" / "local-cluster"


def version() -> str:
    return gobuilt.pinned("NVIDIA_CONTAINER_TOOLKIT_VERSION")


def missing() -> str | None:
    if shutil.which("go") is None:
        return "Go is not installed: nvidia-ctk cannot be built (build.sh nvidia-toolkit)"
    if shutil.which("cc") is None:
        return "no C compiler: nvidia-ctk (cgo) and the native NVML cannot be built"
    return None


def build() -> Path:
    """The folder with nvidia-ctk, nvidia-container-runtime, nvidia-cdi-hook and the
    native libnvidia-ml.so.1; skips (fails under CI) where they cannot be built."""
    reason = missing()
    if reason:
        gobuilt.skip_or_fail(reason)
    gobuilt.build("nvidia-toolkit")
    return LOCAL_CLUSTER / "bin" / f"nvidia-container-toolkit-{version()}"
