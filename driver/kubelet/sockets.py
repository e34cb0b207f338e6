"""Unix sockets for the kubelet: replaced atomically at start, only our own removed at stop.

gRPC unlinks the path it bound when the server stops. During an upgrade without unique
socket names the new pod has by then replaced the old pod's socket file, and the old pod
would delete the new one's. So we bind a private dot-name (the kubelet ignores dot files),
put it at the public path, and at stop remove the public path only if it is still our inode.

The kubelet's plugin watcher stats every file created in plugins_registry *before* it
ignores dot-names (k8s.io/kubernetes pkg/kubelet/pluginmanager/pluginwatcher,
handleCreateEvent), and logs `Error when handling create event ... stat file ... no such
file or directory` for one that is gone by then. So the private name is not renamed away:
it is hard-linked to the public name and stays while the socket lives (gRPC unlinks it
when the server stops). Only a file that is not ours at the public name (another pod's
socket during an upgrade without unique names, or one a crash left) is replaced by a
rename, which is atomic: no moment without a socket there.

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
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL
PRIVATE_NAME_MAX = len(".s-") + 12 + len("-999")  # `.s-<token>-<n>`, see OwnedSocket


PRIVATE_PREFIX = ".s-"
# A private name whose owner is not known (its instance entry is gone) is removed only once
# this old: it may be another instance's that is binding right now.
SWEEP_MIN_AGE_SECONDS = 60.0


def sweep_private(directory: Path, owner_state: Callable[[str], str],
                  min_age: float = SWEEP_MIN_AGE_SECONDS) -> list[Path]:
    """Remove the private socket names (`.s-<token>-<n>`) that instances killed before
    their servers stopped left in `directory`. `owner_state(token)`: "alive", "dead" or
    "unknown" (driver/state/instance.py)."""
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(PRIVATE_PREFIX):
            continue
        state = owner_state(entry.name[len(PRIVATE_PREFIX):].rsplit("-", 1)[0])
        if state == "alive":
            continue
        try:
            if state != "dead" and now - entry.lstat().st_mtime < min_age:
                continue
        except FileNotFoundError:
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def sweep_public(directory: Path, ours: Callable[[str], bool],
                 owner_state: Callable[[str], str]) -> list[Path]:
    """Remove the public sockets (`<driver>-<uid>-reg.sock`, `dra-<uid>.sock`) that killed
    instances left in `directory`; call before `sweep_private`, whose names show owners.

    The real kubelet keeps a dead registration as long as its socket file is there and
    retries its health stream every 10 s, forever. A socket is a dead instance's when
    nobody listens on it: the kernel refuses a connection to a socket whose process is
    gone, whatever our records say (they may have been swept by an earlier start). Only
    names that are ours are touched: `ours(name)`, or the inode of a private name of a
    dead instance of this state directory (the hashed `dra-<hash>-reg.sock` another
    driver could also use)."""
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    dead_inodes = set()
    for entry in entries:
        if entry.name.startswith(PRIVATE_PREFIX) and owner_state(
                entry.name[len(PRIVATE_PREFIX):].rsplit("-", 1)[0]) == "dead":
            try:
                dead_inodes.add(entry.lstat().st_ino)
            except FileNotFoundError:
                pass
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or not (ours(entry.name) or st.st_ino in dead_inodes):
            continue
        if _listening(entry):
            continue
        try:
            # A socket renamed onto the name since the probe is a live one (without
            # seamless upgrades both pods use one name): leave it.
            if entry.lstat().st_ino != st.st_ino:
                continue
        except FileNotFoundError:
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _listening(path: Path) -> bool:
    """Does a process accept connections on the socket at `path`? Only a refusal says no:
    a time-out or a full backlog is a live server that is busy."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()


def registration_ours(driver: str) -> Callable[[str], bool]:
    """The names `registration_candidates` gives this driver (the hashed third one aside)."""
    return lambda name: name == f"{driver}-reg.sock" or (
        name.startswith(f"{driver}-") and name.endswith("-reg.sock"))


def dra_ours(name: str) -> bool:
    """The names `dra_candidates` gives, in the driver's own plugin folder."""
    return name == "dra.sock" or (name.startswith("dra-") and name.endswith(".sock"))


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
        self._private = self.path.parent / f"{PRIVATE_PREFIX}{self.owner}-{next(self._counter) % 1000}"
        self._private.unlink(missing_ok=True)
        return f"unix://{self._private}"

    def publish(self, replaces: "OwnedSocket | None" = None) -> None:
        """After binding: give the socket its public name and remember it is ours.
        `replaces`: our earlier socket at the same name (a registration offered again): if
        it is still there it goes first (the kubelet sees it removed, then the new one)."""
        assert self._private is not None, "address() first"
        if replaces is not None and replaces.inode is not None:
            try:
                if self.path.stat().st_ino == replaces.inode:
                    self.path.unlink()
            except FileNotFoundError:
                pass
        try:
            os.link(self._private, self.path)
        except FileExistsError:
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
            self._forget_private()
            self.inode = None

    def _forget_private(self) -> None:
        """The private name, if it is still this socket (gRPC unlinks it at server stop)."""
        if self._private is None:
            return
        try:
            if self._private.stat().st_ino == self.inode:
                self._private.unlink()
        except FileNotFoundError:
            pass
