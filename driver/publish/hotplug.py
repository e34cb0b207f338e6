"""Follows hardware changes: kernel uevents (pci, net) and a periodic rediscovery.

Events are debounced: creating 64 SR-IOV VFs is a burst of a few hundred uevents, and it
must cost one rediscovery and one republish, not hundreds. Without pyudev/libudev, or
without permission to open the netlink socket, polling alone keeps the inventory true.

Both cost what changed, not what the node has (with `incremental` and `scan` given, as
the plugin does): a burst's uevents name the PCI functions and interfaces to read again,
and the periodic pass first takes a fingerprint (driver/devices/fingerprint.py) and reads
again only what differs from the last one. A notify without a name (the health prober's
"a device is gone", a change of MIG mode) asks for a full discovery.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from driver.aio import wait_event
from driver.devices.discovery import Changes, DiscoveryResult, log_result

DEBOUNCE_QUIET = 1.0  # rediscover once no event came for this long...
DEBOUNCE_MAX = 5.0  # ...or at the latest this long after the first event of a burst


@dataclass
class Rediscovery:
    """Runs discovery when asked (debounced) or periodically; reports changed inventories."""

    discover: Callable[[], DiscoveryResult]  # a full discovery
    on_change: Callable[[DiscoveryResult], None]
    current: DiscoveryResult
    interval: float = 60.0
    quiet: float = DEBOUNCE_QUIET
    max_delay: float = DEBOUNCE_MAX
    # (previous result, what changed) -> result; None: every run is a full discovery
    incremental: Callable[[DiscoveryResult, Changes], DiscoveryResult] | None = None
    scan: Callable[[], Any] | None = None  # the fingerprint, for the periodic pass
    diff: Callable[[Any, Any], Changes] | None = None  # two fingerprints -> Changes
    baseline: Any = None  # the fingerprint taken before `current` was discovered
    release: Callable[[], None] | None = None  # frees what `scan` holds open, when run() ends
    runs: int = 0
    full_runs: int = 0
    events: int = 0
    last_changes: Changes | None = None  # what the last incremental run read again
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _poke: asyncio.Event | None = field(default=None, repr=False)
    _first_event: float | None = field(default=None, repr=False)
    _last_event: float = field(default=0.0, repr=False)
    _pending: Changes = field(default_factory=Changes, repr=False)
    _full: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.log = structlog.get_logger(component="hotplug")

    def notify(self, subsystem: str = "", action: str = "", name: str = "") -> None:
        """A uevent for the PCI function or interface `name` (or, without one, anything
        else that suggests a change); safe from any thread."""
        now = time.monotonic()
        if self._loop is None or self._poke is None:
            return
        if name and subsystem == "pci":
            changed: Changes | None = Changes(functions=frozenset({name}))
        elif name and subsystem == "net":
            changed = Changes(interfaces=frozenset({name}))
        else:
            changed = None

        def mark() -> None:
            self.events += 1
            if changed is None:
                self._full = True
            else:
                self._pending = self._pending | changed
            self._last_event = now
            if self._first_event is None:
                self._first_event = now
            self._poke.set()

        try:
            self._loop.call_soon_threadsafe(mark)
        except RuntimeError:
            pass  # loop closed: we are stopping

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._poke = asyncio.Event()
        next_periodic = time.monotonic() + self.interval
        try:
            while True:
                timeout = max(0.0, next_periodic - time.monotonic())
                await wait_event(self._poke, timeout)
                periodic = self._first_event is None
                if self._first_event is not None:
                    # Debounce: wait for quiet, but not beyond max_delay after the burst began.
                    while True:
                        now = time.monotonic()
                        wait = min(self._last_event + self.quiet, self._first_event + self.max_delay) - now
                        if wait <= 0:
                            break
                        self._poke.clear()
                        await wait_event(self._poke, wait)
                    self._first_event = None
                elif time.monotonic() < next_periodic:
                    self._poke.clear()
                    continue
                self._poke.clear()
                try:
                    await self.rediscover(periodic)
                except Exception as err:  # keep following hardware after a discovery bug
                    self.log.error("rediscovery_failed", error=repr(err))
                next_periodic = time.monotonic() + self.interval
        finally:
            if self.release is not None:
                self.release()

    async def rediscover(self, periodic: bool = False) -> bool:
        pending, full = self._pending, self._full
        self._pending, self._full = Changes(), False
        try:
            result = await asyncio.to_thread(self._discover, pending, full, periodic)
        except BaseException:
            # What this run was to read again is lost with it (and a periodic pass has
            # already moved its fingerprint past the change): the next run reads it all.
            self._full = True
            raise
        self.runs += 1
        previous, self.current = self.current, result
        log_result(result, structlog.get_logger(component="discovery"), previous)
        if result.inventory == previous.inventory:
            return False
        old = {d.name for d in previous.inventory.devices}
        new = {d.name for d in result.inventory.devices}
        self.log.info("inventory_changed", added=sorted(new - old)[:20], removed=sorted(old - new)[:20],
                      added_count=len(new - old), removed_count=len(old - new))
        self.on_change(result)
        return True

    def _discover(self, pending: Changes, full: bool, periodic: bool) -> DiscoveryResult:
        if self.incremental is None or full:
            return self._full_discovery()
        if periodic:
            if self.scan is None or self.diff is None or self.baseline is None:
                return self._full_discovery()
            now = self.scan()
            pending = pending | self.diff(self.baseline, now)
            self.baseline = now
        self.last_changes = pending
        return self.incremental(self.current, pending)

    def _full_discovery(self) -> DiscoveryResult:
        self.full_runs += 1
        self.last_changes = None
        if self.scan is not None:
            self.baseline = self.scan()  # before reading: a change after it shows next time
        return self.discover()


class UeventMonitor:
    """Kernel uevents through pyudev, in a daemon thread feeding Rediscovery.notify."""

    def __init__(self, notify: Callable[[str, str], None]) -> None:
        self.notify = notify
        self.log = structlog.get_logger(component="hotplug")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        try:
            import pyudev  # noqa: PLC0415 - optional: polling works without it

            context = pyudev.Context()
            # source="kernel": in a container no udevd runs, so "udev" events never come.
            monitor = pyudev.Monitor.from_netlink(context, source="kernel")
            monitor.filter_by(subsystem="pci")
            monitor.filter_by(subsystem="net")
            monitor.start()
        except (ImportError, OSError, Exception) as err:  # libudev missing, netlink denied
            self.log.info("uevents_unavailable_polling_only", reason=str(err))
            return False
        self._thread = threading.Thread(target=self._run, args=(monitor,), name="uevents", daemon=True)
        self._thread.start()
        self.log.info("uevents_watching", subsystems=["pci", "net"])
        return True

    def _run(self, monitor) -> None:
        while not self._stop.is_set():
            try:
                device = monitor.poll(timeout=1.0)
            except OSError as err:
                self.log.warning("uevent_read_failed", error=str(err))
                self._stop.wait(5)
                continue
            if device is not None:
                # sys_name: the PCI address or the interface name the event is about
                self.notify(device.subsystem or "", device.action or "", device.sys_name or "")

    def stop(self) -> None:
        self._stop.set()
