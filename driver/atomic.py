"""Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync
the directory. A reader (the container runtime, the next driver process) sees the old
file or the new one, never half of one.

Temp files are named after the writing instance (driver/instance.py), not its PID: two
driver pods during an upgrade are both PID 1 and write into the same directories."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

# A temp file lives for milliseconds. One younger than this may belong to a writer we do
# not know about (another driver with its own state directory writing into the same
# /var/run/cdi, such as `dra-driver demo` beside a real installation): never swept.
SWEEP_MIN_AGE_SECONDS = 60.0

TEMP_MARK = ".tmp-"


def write(path: Path, data: bytes, mode: int = 0o644, owner: str | None = None,
          durable: bool = True) -> None:
    """`owner`: the writing instance's token (default: this PID, for one-off tools).
    `durable=False`: still all or nothing for readers, but no fsync, for files that are
    rebuilt after a reboot anyway (a process crash loses nothing that is in the page
    cache; only a power loss would, and then the rebuild follows)."""
    directory = path.parent
    # A dot name with no .json/.yaml suffix: CDI runtimes ignore it while it is incomplete.
    temp = directory / f".{path.name}{TEMP_MARK}{owner or os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(temp, flags, mode)
    except FileNotFoundError:  # the first file of its directory: make it, once
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(temp, flags, mode)
    # Plain descriptor calls, no file object: each system call here lets another thread
    # take the interpreter lock, and a buffered file adds four of them (fstat, ioctl,
    # two lseeks) that a whole-file write does not need.
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(directory)


def remove(path: Path) -> bool:
    """Delete a file durably; False when it was not there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep_temp_files(directory: Path, owner_state: Callable[[str], str], prefix: str = "",
                     min_age: float = SWEEP_MIN_AGE_SECONDS) -> list[Path]:
    """Remove temp files that dead writers left behind. `owner_state(owner)` (see
    driver/instance.py) says what became of the instance named in a temp file: "alive" (it
    may be in the middle of a write: the other pod of an upgrade) keeps the file, "dead"
    removes it, "unknown" removes it only once it is older than `min_age`."""
    removed = []
    now = time.time()
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(f".{prefix}") or TEMP_MARK not in name:
            continue
        state = owner_state(name.rsplit(TEMP_MARK, 1)[1])
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
