"""Locks that keep Prepare and Unprepare of one claim from interleaving.

Inside the process: one asyncio lock per claim UID, so different claims run in parallel.
Across processes (two driver pods during a seamless upgrade): an flock on a file in the
state directory, held while this process has any claim operation in flight.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]  # no unbounded growth with claim churn
            else:
                self._locks[key] = (lock, users - 1)


class ProcessLock:
    """A shared-by-count flock: the first operation in takes it, the last one out drops it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._users = 0
        self._guard = asyncio.Lock()

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        async with self._guard:
            if self._users == 0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    try:
                        # Usually free: take it without leaving the loop.
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        # Another driver process holds it: wait in a thread.
                        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None
