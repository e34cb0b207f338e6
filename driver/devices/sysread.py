"""Cheap reads of sysfs and /dev by string path, for the loops that touch every device
again and again (the health probe every 5 s, NIC counters at every metrics scrape, the
rediscovery fingerprint every 60 s).

On a node of 2,048 VFs, building pathlib objects and text-mode file objects cost more CPU
than the reads themselves (75 ms a health probe, most of it pathlib), so these take
strings made once per inventory and make the fewest system calls a read can.

The fewest is one: an attribute read again and again is kept open (`HeldFiles`) and read
with pread at offset 0, which makes sysfs produce the value afresh. Opening, reading and
closing a sysfs attribute costs ~7.7 µs; a pread of an open one ~0.8 µs (measured on this
kernel: the open allocates the kernel's per-open state, the close frees it). What is read
too seldom to keep open is opened relative to its directory, kept open (`HeldDirs`).
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


class _Held:
    """Descriptors kept open by path, up to `limit` (see held_file_budget), until `close`
    or until this object is collected: what HeldFiles and HeldDirs share."""

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

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()


class HeldFiles(_Held):
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


class HeldDirs(_Held):
    """Directories kept open (O_PATH), so that an attribute in one is opened by its name
    alone. sysfs paths are long and go through symlinks (/sys/class/net/X leads into
    /sys/devices/pci..., ten components and more), and the kernel walks all of it on every
    open: open, read and close of an attribute cost 7.3 µs on this kernel's sysfs by path,
    4.2 µs relative to its open directory. For reads that come too seldom to keep each
    attribute open (the rediscovery fingerprint, every 60 s): an O_PATH descriptor holds
    no page of kernel memory, where an open attribute holds one.

    A held directory is the kernel object it was opened on, wherever it has moved since
    (a renamed interface). The caller passes a `key` that says which object the path leads
    to now (the fingerprint: its entry's inode and link target): a different key opens the
    path again. A read that finds no such file (ENOENT: the directory removed, perhaps
    back under the same name) opens the path again and tries once more. Directories not
    read between two `sweep`s are closed.
    """

    def __init__(self, limit: int | None = None) -> None:
        super().__init__(limit)
        self._keys: dict[str, object] = {}  # path -> the key its descriptor was opened for
        self._seen: set[str] = set()

    def read(self, directory: str, key: object, names: tuple[str, ...],
             limit: int = 256) -> tuple[bytes | None, ...]:
        """The first `limit` bytes of each attribute `names` in `directory`, None for one
        that cannot be read. `key` None: read by path, holding nothing."""
        with self._lock:
            if self._closed or key is None:
                return tuple(read_small(f"{directory}/{name}", limit) for name in names)
            self._seen.add(directory)
            fd = self._fds.get(directory)
            if fd is None or self._keys.get(directory) != key:
                fd = self._open(directory, key)
            out = []
            for name in names:
                if fd is None:
                    out.append(read_small(f"{directory}/{name}", limit))
                    continue
                data = _read_at(fd, name, limit)
                if data is _MISSING:
                    fd = self._open(directory, key)
                    data = _read_at(fd, name, limit) if fd is not None else None
                out.append(None if data is _MISSING else data)
            return tuple(out)

    def _open(self, directory: str, key: object) -> int | None:
        self._forget(directory)
        if len(self._fds) >= self.limit:
            return None
        try:
            fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        self._fds[directory], self._keys[directory] = fd, key
        return fd

    def _forget(self, directory: str) -> None:
        fd = self._fds.pop(directory, None)
        self._keys.pop(directory, None)
        if fd is not None:
            os.close(fd)

    def sweep(self) -> None:
        """Close the directories not read since the last sweep (devices gone, renamed)."""
        with self._lock:
            for directory in [d for d in self._fds if d not in self._seen]:
                self._forget(directory)
            self._seen.clear()


_MISSING = object()  # no such file: the directory may have gone


def _read_at(fd: int, name: str, limit: int) -> bytes | None | object:
    try:
        handle = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
    except FileNotFoundError:
        return _MISSING
    except OSError:
        return None
    try:
        return os.read(handle, limit)
    except OSError:  # EINVAL: the speed of a link that is down
        return None
    finally:
        os.close(handle)


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
    """How many files one holder may keep open: a third of what the descriptor limit leaves
    beyond the reserve (the prober, the sampler and the fingerprint each have one)."""
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
