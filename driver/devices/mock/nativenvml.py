"""A mock node's GPUs for a native libnvidia-ml.so.1 (hack/nvidia-toolkit/fakenvml.c).

Tools that load NVML themselves (NVIDIA's nvidia-ctk, Go over dlopen) cannot use the
Python model in fakenvml.py. This module writes what that model answers now (GPUs, their
MIG mode and MIG devices, the driver version) as the native library's state file, and
installs a built library into the node's driver root where the real one would be, as
NVIDIA's own mock-NVML CI does with its library. The state is a snapshot: MIG devices
created after it are not seen until it is written again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from driver.devices.mock.fakenvml import FakeNvmlLibrary

LIBRARY_DIR = Path("usr/lib/x86_64-linux-gnu")  # where the mock tree puts driver files
STATE_FILE = "nvml-state"  # beside the library; DRA_MOCK_NVML_STATE overrides it


def state(library: FakeNvmlLibrary) -> str:
    """The native library's state file (format: hack/nvidia-toolkit/fakenvml.c)."""
    lines = [f"driver {library.driver_version or ''}", f"cuda {library.cuda}"]
    for gpu in library.gpus:
        mode, _ = library.mig_modes(gpu) if gpu.mig_capable else (0, 0)
        lines.append(f"gpu {gpu.index} {gpu.minor} {gpu.uuid} {gpu.bus_id} {gpu.pci_device:04x} "
                     f"{int(gpu.mig_capable)} {mode} {gpu.memory_bytes} {gpu.product}")
        if mode:
            for slot, mig in enumerate(library.migs(gpu)):
                lines.append(f"mig {gpu.index} {slot} {mig.gi} {mig.ci} {mig.uuid} "
                             f"{mig.memory_bytes} {mig.multiprocessors} {mig.copy_engines} "
                             f"{mig.decoders} {mig.encoders} {mig.slices} "
                             f"{gpu.product} MIG {mig.profile}")
    return "\n".join(lines) + "\n"


def install(driver_root: Path, library: FakeNvmlLibrary, built: Path) -> Path:
    """Put the built native library in place of the tree's stand-in file, with the SONAME
    link and its state beside it; returns the library's path."""
    version = library.driver_version or ""
    lib_dir = driver_root / LIBRARY_DIR
    target = lib_dir / f"libnvidia-ml.so.{version}"
    target.unlink(missing_ok=True)
    shutil.copyfile(built, target)
    target.chmod(0o755)
    soname = lib_dir / "libnvidia-ml.so.1"
    soname.unlink(missing_ok=True)
    soname.symlink_to(target.name)  # relative, as the driver's installer makes it
    (lib_dir / STATE_FILE).write_text(state(library))
    return target
