"""Which driver processes are alive on this node, and which of them is the newest.

During a seamless upgrade two pods of the DaemonSet run side by side, both usually PID 1,
sharing the plugin, CDI and state directories. PIDs therefore cannot tell them apart, and
neither can "is the process still there". Each process takes an instance token (derived
from its pod UID, or random) and holds an exclusive flock on `<state>/instances/<token>`
for its whole life; the kernel drops the lock when the process dies, even on SIGKILL.

That one mechanism answers three questions:
* private file names: temp files and staging sockets carry the token, so two instances
  never write the same temp file;
* start-up sweeps: a leftover carrying a token whose lock file is there but free belongs
  to a dead instance and may go; one whose lock is held belongs to the other pod and
  stays; a token with no lock file is a writer we do not know (another state directory
  writing into the same CDI directory), left to an age rule (driver/state/atomic.py);
* who publishes: the newest live instance (latest start) writes ResourceSlices, an older
  one stands by, so two versions with different inventories do not take turns rewriting.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_LENGTH = 12


def token_for(pod_uid: str | None) -> str:
    """Short and file-name safe: socket paths have 107 bytes, a pod UID alone takes 36."""
    if pod_uid:
        return hashlib.sha256(pod_uid.encode()).hexdigest()[:TOKEN_LENGTH]
    return secrets.token_hex(TOKEN_LENGTH // 2)


@dataclass(frozen=True)
class Peer:
    token: str
    started_ns: int


@dataclass
class Instance:
    """This process's entry in the registry of live instances under `directory`."""

    directory: Path
    token: str
    started_ns: int = field(default_factory=time.time_ns)
    _fd: int | None = field(default=None, repr=False)

    @classmethod
    def register(cls, state_dir: Path, pod_uid: str | None) -> "Instance":
        instance = cls(state_dir / "instances", token_for(pod_uid))
        instance._take()
        return instance

    def _lock_path(self, token: str) -> Path:
        return self.directory / token

    def _take(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Lock under a private name, then rename into place: any visible lock file is
        # already locked by its creator, so a peer testing it never mistakes a starting
        # instance for a dead one.
        staging = self.directory / f".{self.token}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{self.started_ns} {os.getpid()}\n".encode())
            target = self._lock_path(self.token)
            if self._held(target):
                raise RuntimeError(f"another live driver process already uses instance token "
                                   f"{self.token} ({target}); is the same pod UID used twice?")
            os.replace(staging, target)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        self._fd = fd

    def release(self) -> None:
        """At a clean stop: drop the entry (a crash leaves it, and peers sweep it)."""
        if self._fd is None:
            return
        try:
            self._lock_path(self.token).unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _held(path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)  # closing drops a shared lock we may have taken
        return False

    def owner_state(self, token: str) -> str:
        """"alive", "dead" (an instance of this state directory that is gone) or "unknown"."""
        if token == self.token:
            return "alive"
        if not token or "/" in token or token.startswith("."):
            return "unknown"
        path = self._lock_path(token)
        if self._held(path):
            return "alive"
        return "dead" if path.exists() else "unknown"

    def alive(self, token: str) -> bool:
        """Is the instance that owns `token` still running (on this node)?"""
        return self.owner_state(token) == "alive"

    def forget_dead(self) -> int:
        """Remove the entries of dead instances; call once their leftovers are swept."""
        removed = 0
        for entry in self._entries():
            if entry.name != self.token and not self._held(entry):
                entry.unlink(missing_ok=True)
                removed += 1
        return removed

    def _entries(self) -> list[Path]:
        try:
            return list(self.directory.iterdir())
        except FileNotFoundError:
            return []

    def peers(self) -> list[Peer]:
        """Other live instances, oldest first."""
        found = []
        for entry in self._entries():
            name = entry.name
            if name == self.token or name.startswith(".") or not self._held(entry):
                continue
            try:
                started = int(entry.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                started = 0
            found.append(Peer(name, started))
        return sorted(found, key=lambda p: (p.started_ns, p.token))

    def newer_peer(self) -> Peer | None:
        """The newest live instance that started after this one, if any."""
        newer = [p for p in self.peers() if (p.started_ns, p.token) > (self.started_ns, self.token)]
        return newer[-1] if newer else None

    def private_name(self, stem: str) -> str:
        """A file name no other instance can produce: `<stem><token>`."""
        return f"{stem}{self.token}"
