"""What a killed demo run (`kill -9`) leaves in its work folder, removed at the next start.

Besides CDI specs and containers (driver/demo/__init__.py, driver/demo/podman.py), a demo
killed while an MPS share ran leaves three things that nothing else ever removes:
- the GPU's MPS control daemon: the emulated kubelet (driver/sim/pods.py) runs it as a
  local process in its own session, because a pod outlives the driver; so it outlives the
  killed demo too, and keeps serving a GPU that nobody claims;
- the GPU's shm tmpfs, which the driver mounted under the work folder
  (driver/prepare/shm.py) and unmounts only when it stops the daemon;
- the work folder itself, /tmp/dra-demo-<pid>-*/ (its rmtree fails on the mount anyway).

Only what provably belongs to a dead run is touched: a folder named after a PID that is
not this process, whose demo `alive(pid)` says is gone, and which got as far as taking its
RUNNING lock where that PID still exists (a demo run inside another program takes it a few
statements after making the folder); a process only when an argument of its command line
lies in such a folder, or when it runs in a session whose leader's does (the MPS server
that a control daemon starts names no path). A folder whose demo ended and kept it for
its driver log (KEPT) stays: the user was told to read it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from driver.prepare import shm

PREFIX = "dra-demo-"  # /tmp/dra-demo-<pid>-<random>: a demo's work folder
RUNNING = ".running"  # in the work folder, locked while that demo runs
KEPT = ".kept"  # in the work folder: the demo ended and kept it for its driver log
# How long the processes get to end on SIGTERM (the MPS wrapper `quit`s its daemon, as on a
# pod's deletion) before SIGKILL; bounded, so that a start is never held up for long.
TERM_SECONDS = 5.0
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Process:
    pid: int
    start: str  # /proc/<pid>/stat starttime: the same process, not a recycled PID
    command: str  # what to call it in the start's line

    def describe(self) -> str:
        return f"{self.pid} {self.command}"


@dataclass(frozen=True)
class Removed:
    folder: Path
    processes: tuple[Process, ...]
    mounts: tuple[str, ...]  # relative to the folder
    folder_removed: bool

    def anything(self) -> bool:
        return bool(self.processes or self.mounts or self.folder_removed)

    def describe(self) -> str:
        """One line, naming the run, what ran, what was mounted, and the folder."""
        parts = []
        if self.processes:
            parts.append(f"{len(self.processes)} process(es) ("
                         + ", ".join(p.describe() for p in self.processes) + ")")
        if self.mounts:
            parts.append(f"{len(self.mounts)} mount(s) ({', '.join(self.mounts)})")
        if self.folder_removed:
            parts.append(f"its folder {self.folder}")
        pid = _pid(self.folder.name)
        return f"removed what demo run {pid} (no longer running) left: {'; '.join(parts)}"


def remove(alive: Callable[[int], bool], tmp: Path = Path("/tmp"),
           proc: Path = Path("/proc")) -> list[Removed]:
    """Stop the processes, unmount the mounts and remove the work folders of every dead
    demo run under `tmp`; what was removed, folder by folder (those with nothing left out)."""
    removed = []
    for folder in sorted(tmp.glob(f"{PREFIX}*")):
        pid = _pid(folder.name)
        if pid is None or folder.is_symlink() or not folder.is_dir() or not _dead(folder, pid, alive, proc):
            continue
        processes = _stop(folder, proc)
        # After the processes: a daemon's open segments would keep nothing mounted anyway
        # (a lazy unmount), but a daemon still running would write into the bare folder.
        mounts = tuple(os.path.relpath(m, folder) for m in shm.release_all_under(folder))
        folder_removed = False
        if not (folder / KEPT).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder_removed = not folder.exists()
        done = Removed(folder, processes, mounts, folder_removed)
        if done.anything():
            removed.append(done)
    return removed


def _pid(name: str) -> int | None:
    pid = name.removeprefix(PREFIX).split("-", 1)[0]
    return int(pid) if name.startswith(PREFIX) and pid.isdigit() else None


def _dead(folder: Path, pid: int, alive: Callable[[int], bool], proc: Path) -> bool:
    if pid == os.getpid() or alive(pid):
        return False
    # The PID exists but its demo took no lock yet: a demo inside another program between
    # making its folder and locking it, or a recycled PID; not provably dead either way.
    return not (proc / str(pid)).exists() or (folder / RUNNING).exists()


def _stat(proc: Path, pid: int) -> tuple[str, int, str] | None:
    """(state, session, starttime) of a process, None when it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[3]), fields[19]


def _argv(proc: Path, pid: int) -> list[str]:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _command(argv: list[str]) -> str:
    """`dra-driver mps-control-daemon`, `driver.devices.mock.tools`: the program, without
    the interpreter that runs it, and its subcommand."""
    args = [a for a in argv if a]
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
        if args[:1] == ["-m"]:
            return " ".join(args[1:2])
    words = [os.path.basename(a) for a in args[:1]]
    if len(args) > 1 and not args[1].startswith(("-", "/")):
        words.append(args[1])
    return " ".join(words) or "?"


def _processes(folder: Path, proc: Path) -> dict[int, Process]:
    inside = str(folder).rstrip("/")
    leaders: set[int] = set()
    found: dict[int, Process] = {}
    sessions: dict[int, tuple[int, str]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        stat = _stat(proc, pid)
        if stat is None or stat[0] == "Z":  # a zombie is dead already
            continue
        sessions[pid] = (stat[1], stat[2])
        argv = _argv(proc, pid)
        if any(a == inside or a.startswith(inside + "/") for a in argv):
            found[pid] = Process(pid, stat[2], _command(argv))
            if stat[1] == pid:
                leaders.add(pid)
    for pid, (session, start) in sessions.items():
        if session in leaders and pid not in found:
            found[pid] = Process(pid, start, _command(_argv(proc, pid)))
    return found


def _signal(process: Process, signum: int, proc: Path) -> None:
    stat = _stat(proc, process.pid)
    if stat is None or stat[2] != process.start:  # gone, or its PID is another's now
        return
    try:
        os.kill(process.pid, signum)
    except ProcessLookupError:
        pass


def _stop(folder: Path, proc: Path) -> tuple[Process, ...]:
    """SIGTERM, and SIGKILL for what is still there after TERM_SECONDS; every process seen,
    also those started meanwhile in a session being stopped (the wrapper's `quit`)."""
    seen: dict[int, Process] = {}
    signalled: set[int] = set()
    deadline = time.monotonic() + TERM_SECONDS
    while True:
        running = _processes(folder, proc)
        seen.update(running)
        if not running:
            break
        late = time.monotonic() > deadline
        for process in running.values():
            if late or process.pid not in signalled:
                _signal(process, signal.SIGKILL if late else signal.SIGTERM, proc)
                signalled.add(process.pid)
        if late and time.monotonic() > deadline + TERM_SECONDS:
            break  # unkillable (uninterruptible sleep): said, and left
        time.sleep(POLL_SECONDS)
    return tuple(sorted(seen.values(), key=lambda p: p.pid))
