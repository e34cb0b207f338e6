"""Claims' local changes, one after another on one thread, made durable in groups.

A batch of claims used to write on as many threads as claims in flight: every system
call of every write handed the interpreter lock to another of 32 threads (half of the
driver's CPU in a batch, in perf), and every checkpoint record cost its own directory
fsync. Here a claim's local change (checks against the other claims, spec, record)
is queued to one thread, which runs whatever is queued as a group: each change in turn,
with the checkpoint's puts and removes staged (driver/state/checkpoint.py `group`), then one
commit for all of them (each record's fsync, its rename, one directory fsync), and only
then the answers. Under load the groups grow by themselves (what arrives while a group
commits forms the next one); a lone claim is a group of one and costs what it did.

Only changes that touch no device go here: a claim that sets up sharing or creates a
MIG partition waits on other claims' device work (an MPS daemon starts in ~0.5 s) and
would hold up everyone behind it, so it runs on a pool thread as before.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from driver.state.checkpoint import Checkpoint

# At most this many changes share one commit: bounds the descriptors a group holds open
# and how long the first claim of a group waits for the last.
MAX_GROUP = 64
# The records of a group are fsynced this many at a time: on a journaled ext4 with a
# write cache, 64 fsyncs took 21 ms one after another and 5 ms eight at a time, for less
# CPU (bench/RESULTS.md).
FSYNC_THREADS = 8
# The thread stops after this long without a claim (and starts again with the next).
IDLE_SECONDS = 60.0


@dataclass
class _Change:
    run: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class GroupCommitter:
    def __init__(self, checkpoint: Checkpoint, max_group: int = MAX_GROUP) -> None:
        self.checkpoint = checkpoint
        self.max_group = max_group
        self._queue: deque[_Change] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._fsyncs: ThreadPoolExecutor | None = None  # made with the thread
        self._closed = False
        self.groups = 0  # commits so far (tests, and the average group size in a bench)
        self.changes = 0
        self.log = structlog.get_logger(component="prepare")

    async def run(self, change: Callable[..., Any], *args: Any) -> Any:
        """`change(*args)` on the committer's thread; its result once its checkpoint
        writes are durable. Its exception, or the group commit's, is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the claim committer is closed")
            self._queue.append(_Change(lambda: change(*args), loop, future))
            if self._thread is None:
                self._fsyncs = ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="fsync")
                self._thread = threading.Thread(target=self._serve, name="claim-commits",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()
        return await future

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued, then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        with self._wake:
            fsyncs, self._fsyncs = self._fsyncs, None
        if fsyncs is not None:
            fsyncs.shutdown(wait=False)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    if not self._wake.wait(IDLE_SECONDS) and not self._queue:
                        # Idle: the thread and its fsync pool go; the next run() makes
                        # new ones (a claim after a quiet spell pays a thread start).
                        self._thread, fsyncs, self._fsyncs = None, self._fsyncs, None
                        if fsyncs is not None:
                            fsyncs.shutdown(wait=False)
                        return
                if not self._queue:
                    return
                group = [self._queue.popleft() for _ in range(min(self.max_group, len(self._queue)))]
            self._run_group(group)

    def _run_group(self, group: list[_Change]) -> None:
        outcomes: list[tuple[bool, Any]] = []
        try:
            with self.checkpoint.group() as writes:
                for change in group:
                    try:
                        outcomes.append((True, change.run()))
                    except BaseException as err:  # noqa: BLE001 - the claim's own error, to its caller
                        outcomes.append((False, err))
                try:
                    self.checkpoint.commit(writes, self._fsyncs)
                except OSError as err:
                    # Nothing of the group is known durable: every claim in it fails and
                    # the kubelet retries it (the record may be there or not; a retry
                    # finds out and writes it again).
                    self.log.error("checkpoint_commit_failed", error=str(err),
                                   claims=len(group))
                    outcomes = [(False, err)] * len(group)
        except BaseException as err:  # noqa: BLE001 - never leave a caller waiting
            outcomes = [(False, err)] * len(group)
        self.groups += 1
        self.changes += len(group)
        for change, (ok, value) in zip(group, outcomes):
            try:
                change.loop.call_soon_threadsafe(_settle, change.future, ok, value)
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():  # its caller was cancelled (a gRPC deadline): nobody to tell
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
