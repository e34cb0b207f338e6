"""The /dev/shm that an MPS control daemon and its clients share: a tmpfs per GPU.

MPS servers and clients exchange data through shared memory, so every client container
and the daemon mount the GPU's shm folder at /dev/shm. On a disk-backed folder that
traffic would be written to the node's disk; NVIDIA mounts a tmpfs there, and so do we,
with an explicit size (--mps-shm-size; by default half of the node's memory, as NVIDIA).
The mount is made by this driver on the host (the chart gives the plugins folder
Bidirectional mount propagation, so it reaches the host and the runtime's bind mounts)
and released when the daemon is stopped; an orphan one goes with the orphan daemon at
reconcile. Where mounting is not permitted (an unprivileged test run), the folder stays a
plain folder and a warning says so: the daemon still works, only slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Any

MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
# Any UID's clients create their segments there, as in a normal /dev/shm.
MODE = "1777"
FALLBACK_SIZE = 64 << 20  # where /proc/meminfo cannot be read (NVIDIA's fallback too)


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def default_size(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Half of the node's memory, as NVIDIA's driver sizes its MPS shm (--mps-shm-size
    sets another size)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_SIZE


def ensure_tmpfs(path: Path, device: str, log: Any, size: int) -> bool:
    """Mount a tmpfs of `size` bytes at `path` unless one is there; whether `path` is a
    tmpfs now. The size is explicit so that what MPS may hold in memory is a number an
    operator chose (and reads in the mount table), not whatever the kernel defaults to."""
    if os.path.ismount(path):
        return True
    if os.geteuid() != 0:
        path.chmod(0o1777)
        log.warning("mps_shm_not_tmpfs", device=device, path=str(path),
                    reason="not running as root: a plain folder")
        return False
    options = f"mode={MODE},size={size}".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        path.chmod(0o1777)
        log.warning("mps_shm_not_tmpfs", device=device, path=str(path),
                    reason=f"mount tmpfs: {os.strerror(err)}")
        return False
    log.info("mps_shm_mounted", device=device, path=str(path), size=size)
    return True


def release(path: Path, device: str, log: Any) -> None:
    """Unmount the tmpfs at `path`, if one is there (its segments die with the daemon)."""
    if not os.path.ismount(path):
        return
    if _libc().umount2(str(path).encode(), MNT_DETACH) != 0:
        log.warning("mps_shm_unmount_failed", device=device, path=str(path),
                    error=os.strerror(ctypes.get_errno()))
        return
    log.info("mps_shm_unmounted", device=device, path=str(path))


def release_all_under(root: Path) -> list[str]:
    """Unmount every mount below `root` (a state folder being removed: a test's or the
    demo's, after a driver was killed before it could release its GPUs' shm)."""
    prefix = str(root).rstrip("/") + "/"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    targets = sorted({line.split()[1].replace("\\040", " ") for line in lines
                      if len(line.split()) > 1 and line.split()[1].startswith(prefix)},
                     key=len, reverse=True)
    released = []
    for target in targets:
        if _libc().umount2(target.encode(), MNT_DETACH) == 0:
            released.append(target)
    return released
