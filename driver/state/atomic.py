"""Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync
the directory. A reader (the container runtime, the next driver process) sees the old
file or the new one, never half of one.

Temp files are named after the writing instance (driver/state/instance.py), not its PID: two
driver pods during an upgrade are both PID 1 and write into the same directories."""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor
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
    fd, temp = _temp_file(path, mode, owner)
    try:
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def _temp_file(path: Path, mode: int, owner: str | None) -> tuple[int, Path]:
    directory = path.parent
    # A dot name with no .json/.yaml suffix: CDI runtimes ignore it while it is incomplete.
    temp = directory / f".{path.name}{TEMP_MARK}{owner or os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        return os.open(temp, flags, mode), temp
    except FileNotFoundError:  # the first file of its directory: make it, once
        directory.mkdir(parents=True, exist_ok=True)
        return os.open(temp, flags, mode), temp


def _write_all(fd: int, data: bytes) -> None:
    # Plain descriptor calls, no file object: each system call here lets another thread
    # take the interpreter lock, and a buffered file adds four of them (fstat, ioctl,
    # two lseeks) that a whole-file write does not need.
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class WriteGroup:
    """Durable writes and removals made durable together: N files cost N file fsyncs
    and one fsync per directory instead of one each (group commit; see
    docs/crash-safety.md). A staged file is written to its temp name at once and
    renamed into place only at `commit`, after its fsync, so no reader ever sees it
    unsynced; a removal is done at once and its directory synced at `commit`. Nothing
    is durable, and a caller must not say it is, before `commit` returns."""

    def __init__(self, owner: str | None = None) -> None:
        self.owner = owner
        self._staged: dict[Path, tuple[int, Path]] = {}  # target -> (descriptor, temp)
        self._directories: set[Path] = set()

    def __len__(self) -> int:
        return len(self._staged) + len(self._directories)

    def write(self, path: Path, data: bytes, mode: int = 0o644) -> None:
        self._drop(path)  # staged twice: the later content wins
        fd, temp = _temp_file(path, mode, self.owner)
        try:
            _write_all(fd, data)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        self._staged[path] = (fd, temp)

    def remove(self, path: Path) -> bool:
        """Delete `path` now (durable at `commit`); False when it was not there. A write
        of it staged in this group is dropped."""
        staged = self._drop(path)
        try:
            path.unlink()
        except FileNotFoundError:
            return staged
        self._directories.add(path.parent)
        return True

    def commit(self, parallel: Executor | None = None) -> None:
        """fsync every staged file, rename it into place, fsync each directory touched.
        `parallel`: the files' fsyncs run on its threads (on a disk with a write cache
        each is a cache flush of its own, and several in flight at once take a fraction
        of the time one after another does). On an error nothing staged is left behind
        (temp files removed) and the error is raised: what was not renamed is not there."""
        try:
            descriptors = [fd for fd, _ in self._staged.values()]
            if parallel is not None and len(descriptors) > 1:
                for _ in parallel.map(os.fsync, descriptors):
                    pass  # an fsync's error is raised here
            else:
                for fd in descriptors:
                    os.fsync(fd)
            for path, (fd, temp) in list(self._staged.items()):
                os.close(fd)
                del self._staged[path]
                os.replace(temp, path)
                self._directories.add(path.parent)
            for directory in sorted(self._directories):
                fsync_dir(directory)
            self._directories.clear()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Forget what is staged (temp files removed); removals already done stay done."""
        for path in list(self._staged):
            self._drop(path)
        self._directories.clear()

    def _drop(self, path: Path) -> bool:
        staged = self._staged.pop(path, None)
        if staged is None:
            return False
        fd, temp = staged
        os.close(fd)
        temp.unlink(missing_ok=True)
        return True


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
    driver/state/instance.py) says what became of the instance named in a temp file: "alive" (it
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
