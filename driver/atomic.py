"""Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync
the directory. A reader (the container runtime, the next driver process) sees the old
file or the new one, never half of one.

Temp files are named after the writing instance (driver/instance.py), not its PID: two
driver pods during an upgrade are both PID 1 and write into the same directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

TEMP_MARK = ".tmp-"


def write(path: Path, data: bytes, mode: int = 0o644, owner: str | None = None) -> None:
    """`owner`: the writing instance's token (default: this PID, for one-off tools)."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    # A dot name with no .json/.yaml suffix: CDI runtimes ignore it while it is incomplete.
    temp = directory / f".{path.name}{TEMP_MARK}{owner or os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
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


def sweep_temp_files(directory: Path, alive: Callable[[str], bool], prefix: str = "") -> list[Path]:
    """Remove temp files that dead writers left behind. `alive(owner)` says whether the
    instance named in a temp file still runs: its files may be in the middle of a write
    (the other pod of an upgrade) and are left alone."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(f".{prefix}") or TEMP_MARK not in name:
            continue
        if alive(name.rsplit(TEMP_MARK, 1)[1]):
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed
