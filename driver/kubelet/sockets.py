"""Unix sockets for the kubelet: replaced atomically at start, only our own removed at stop.

gRPC unlinks the path it bound when the server stops. During an upgrade without unique
socket names the new pod has by then replaced the old pod's socket file, and the old pod
would delete the new one's. So we bind a private dot-name (the kubelet ignores dot files),
rename it onto the public path (atomic: no moment without a socket, stale files from a
crash replaced), and at stop remove the public path only if it is still our inode.

The private name carries the instance token, not the PID: both pods of an upgrade are
usually PID 1 and share the directories.

Names: unix socket paths hold at most 107 bytes. With seamless upgrades the names carry
the pod UID (36 characters); when that does not fit, we fall back as the upstream
kubelet-plugin helper does: a short hash of the UID, then a hash of driver and UID.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL
PRIVATE_NAME_MAX = len(".s-") + 12 + len("-999")  # `.s-<token>-<n>`, see OwnedSocket


def _hash(*parts: str, length: int) -> str:
    digest = hashlib.sha256("/".join(parts).encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")[:length]


def fits(path: Path) -> bool:
    """Does a socket at `path` fit, including the private name it is first bound under?"""
    longest = max(len(os.fsencode(path.name)), PRIVATE_NAME_MAX)
    return len(os.fsencode(str(path.parent))) + 1 + longest <= UNIX_PATH_MAX


def registration_candidates(directory: Path, driver: str, pod_uid: str | None) -> list[Path]:
    if not pod_uid:
        return [directory / f"{driver}-reg.sock"]
    return [directory / f"{driver}-{pod_uid}-reg.sock",
            directory / f"{driver}-{_hash(pod_uid, length=8)}-reg.sock",
            directory / f"dra-{_hash(driver, pod_uid, length=16)}-reg.sock"]


def dra_candidates(directory: Path, pod_uid: str | None) -> list[Path]:
    if not pod_uid:
        return [directory / "dra.sock"]
    return [directory / f"dra-{pod_uid}.sock", directory / f"dra-{_hash(pod_uid, length=8)}.sock"]


def first_fitting(candidates: list[Path]) -> Path | None:
    return next((p for p in candidates if fits(p)), None)


@dataclass
class OwnedSocket:
    path: Path
    owner: str  # the instance token (driver/state/instance.py)
    inode: int | None = None
    _private: Path | None = field(default=None, repr=False)
    _counter: "itertools.count[int]" = field(default_factory=itertools.count, repr=False)

    def address(self) -> str:
        """Where to bind: a private name beside the public path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = self.path.lstat().st_mode
            if not stat.S_ISSOCK(mode):
                raise FileExistsError(f"{self.path} exists and is not a socket; refusing to replace it")
        except FileNotFoundError:
            pass
        self._private = self.path.parent / f".s-{self.owner}-{next(self._counter) % 1000}"
        self._private.unlink(missing_ok=True)
        return f"unix://{self._private}"

    def publish(self) -> None:
        """After binding: move the socket onto its public name and remember it is ours."""
        assert self._private is not None, "address() first"
        os.replace(self._private, self.path)
        self.inode = self.path.stat().st_ino

    def remove(self) -> bool:
        if self.inode is None:
            return False
        try:
            if self.path.stat().st_ino != self.inode:
                return False  # replaced by another instance: leave it alone
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False
        finally:
            self.inode = None
