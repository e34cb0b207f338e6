"""Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync
the directory. A reader (the container runtime, the next driver process) sees the old
file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path

TEMP_MARK = ".tmp-"


def write(path: Path, data: bytes, mode: int = 0o644) -> None:
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    # A dot name with no .json/.yaml suffix: CDI runtimes ignore it while it is incomplete.
    temp = directory / f".{path.name}{TEMP_MARK}{os.getpid()}"
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


def sweep_temp_files(directory: Path, prefix: str = "") -> list[Path]:
    """Remove temp files a killed process left behind (call at start-up, before serving)."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(f".{prefix}") and TEMP_MARK in entry.name:
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
