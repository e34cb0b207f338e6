"""Linux inotify through libc, for the emulated kubelet's plugin watcher: the real one
(fsnotify) acts on each create event of its folder, which polling cannot see for a file
that exists for a millisecond."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct

IN_CREATE = 0x00000100
IN_MOVED_TO = 0x00000080
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)


class Watch:
    """Names created in (or moved into) one directory, as they happen."""

    def __init__(self, directory: str, mask: int = IN_CREATE | IN_MOVED_TO) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory}")

    def read(self, timeout: float) -> list[str]:
        """The names of the events that arrived within `timeout` seconds (maybe none)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        names, offset = [], 0
        while offset < len(data):
            _, _, _, length = _HEADER.unpack_from(data, offset)
            offset += _HEADER.size
            names.append(data[offset:offset + length].rstrip(b"\0").decode(errors="replace"))
            offset += length
        return names

    def close(self) -> None:
        os.close(self.fd)
