"""Cheap reads of sysfs and /dev by string path, for the loops that touch every device
again and again (the health probe every 5 s, NIC counters every 10 s, the rediscovery
fingerprint every 60 s).

On a node of 2,048 VFs, building pathlib objects and text-mode file objects cost more CPU
than the reads themselves (75 ms a health probe, most of it pathlib), so these take
strings made once per inventory and make the fewest system calls a read can.

The fewest is one: an attribute read again and again is kept open (`HeldFiles`) and read
with pread at offset 0, which makes sysfs produce the value afresh. Opening, reading and
closing a sysfs attribute costs ~7.7 µs; a pread of an open one ~0.8 µs (measured on this
kernel: the open allocates the kernel's per-open state, the close frees it).
"""

from __future__ import annotations

import os
import resource
import threading
import weakref
from typing import Callable, Generic, TypeVar

from driver.devices.model import Inventory

T = TypeVar("T")


class PerInventory(Generic[T]):
    """What `make` derives from an inventory (each device's paths, say), made again only
    when the inventory changes: rediscovery replaces it whole, so its identity says when."""

    def __init__(self, make: Callable[[Inventory], T],
                 retire: Callable[[T], None] | None = None) -> None:
        self._make = make
        self._retire = retire  # what to do with a value no longer current (close files)
        self._for: Inventory | None = None
        self._value: T | None = None

    def of(self, inventory: Inventory) -> T:
        if inventory is not self._for or self._value is None:
            self.clear()
            self._value, self._for = self._make(inventory), inventory
        return self._value

    def clear(self) -> None:
        if self._value is not None and self._retire is not None:
            self._retire(self._value)
        self._value, self._for = None, None


class HeldFiles:
    """Attribute files opened on their first read and kept open, each later read one pread
    at offset 0.

    What a held file reads is the attribute of the kernel object it was opened on: a renamed
    interface's file still reads that interface, and a removed device's files fail with
    ENODEV, upon which the path is opened again (a device that came back under the same
    name) or reported unreadable. The callers hold one of these per inventory and close it
    when rediscovery replaces the inventory, so paths always follow the current names.

    Each open file is a descriptor and, in sysfs, a page of kernel memory charged to the
    pod (2,048 VFs × 3 attributes: ~25 MiB). Past `limit` held files a read opens, reads
    and closes; `limit` (see held_file_budget) leaves the rest of the process its
    descriptors.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = held_file_budget() if limit is None else limit
        self._fds: dict[str, int] = {}
        # close() may come from another thread while a read is under way (a probe thread
        # outlives its cancelled task): a descriptor closed under a read could be reused
        # by a socket, and the read's error handling would then close that socket.
        self._lock = threading.Lock()
        self._closed = False
        # Closed when closed explicitly, and otherwise when this object is collected:
        # descriptors are not garbage, and a test making many probers must not leak them.
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def read(self, path: str, limit: int = 256) -> bytes | None:
        """The first `limit` bytes of the attribute at `path`; None when it cannot be read."""
        with self._lock:
            if self._closed:
                return read_small(path, limit)
            return self._read(path, limit)

    def read_many(self, paths: list[str], limit: int = 256) -> list[bytes | None]:
        """`read` of each path, in order, under one taking of the lock."""
        with self._lock:
            if self._closed:
                return [read_small(path, limit) for path in paths]
            return [self._read(path, limit) for path in paths]

    def _read(self, path: str, limit: int) -> bytes | None:
        fd = self._fds.get(path)
        if fd is not None:
            try:
                return os.pread(fd, limit, 0)
            except OSError:
                # ENODEV: its device is gone; whatever is at the path now is read below.
                del self._fds[path]
                os.close(fd)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            data = os.pread(fd, limit, 0)
        except OSError:
            os.close(fd)
            return None
        if len(self._fds) < self.limit:
            self._fds[path] = fd
        else:
            os.close(fd)
        return data

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


# Descriptors left for everything else (sockets, claims' files, gRPC) whatever is held.
DESCRIPTOR_RESERVE = 1024


def held_file_budget() -> int:
    """How many attribute files one HeldFiles may keep open: a third of what the descriptor
    limit leaves beyond the reserve (the prober and the sampler each hold one)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, (soft - DESCRIPTOR_RESERVE) // 3)


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one, as the Go runtime does for every
    Go program: container runtimes often start processes with a soft limit of 1,024 and a
    hard one far above. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # refused (a seccomp profile, say): keep what we have
            return soft, soft
        return soft, target
    return soft, soft


def read_small(path: str, limit: int = 256) -> bytes | None:
    """The first `limit` bytes of a sysfs attribute; None when it cannot be read (gone,
    EINVAL for the speed of a link that is down, EACCES)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def split(path: str) -> tuple[str, str]:
    """'/a/b/c' -> ('/a/b', 'c'): a path as the directory to list and the name to find."""
    directory, _, name = path.rpartition("/")
    return directory or "/", name
