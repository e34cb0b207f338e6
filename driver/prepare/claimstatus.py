"""ResourceClaim `status.devices` (KEP-4817): what this driver prepared, written back to
the claim so that users, controllers and other tools see it without node access.

Entries are written with server-side apply under the driver's name as field manager:
`status.devices` is a map list keyed by (driver, device, pool, shareID), so an apply owns
exactly the entries it sends and other drivers' entries in the same claim stay as they
are; an apply with no entries removes ours (unprepare). `metadata.uid` in the body makes
the write a precondition: a claim deleted and re-created under the same name is not
touched.

Each kind of status has its own source: Ready (and `data`) come from prepare and
unprepare (`StatusWriter.publish`); the `Idle` condition from the utilization monitor
(driver/prepare/idlestatus.py), as an overlay applied to every state written for that
device until it is cleared. Ready keeps its lastTransitionTime when only Idle changes.

Writes run on threads of their own, off the prepare path: a prepare never waits for one
and never fails because of one. Up to WRITERS claims are written at once (one claim's
states one after another, in order): a node's burst of pods (64 one-claim prepares) was
64 applies in a row on one thread and one connection, ~5 ms each against a real
kube-apiserver, so the last claim's status landed ~0.35 s after the first
(bench/RESULTS.md, issue 42 item 5). A state known while other claims are in hand waits
for them (0.2 s at most): the burst's writes go when its prepares are done; a newer state
within that time replaces it (a claim prepared and unprepared at once costs one write). A failed write is retried with backoff (0.5 s doubling to
30 s, given up after 10 tries: the next prepare or unprepare of the claim writes again) and
counted; a newer state of the claim replaces a pending one, and the state last written is
not written again (its condition keeps its lastTransitionTime). Gone (404) and re-created
(409 on the UID) claims are dropped.

RBAC: `patch` on `resourceclaims/status`; from Kubernetes 1.36 also
`associated-node:patch` on `resourceclaims/driver` for `resourceNames: [<driver>]`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator, Protocol

import structlog

from driver.prepare.claims import ClaimRef
from driver.kube.client import ApiError, Kube, NotFound
from driver.kube.client import API_GROUP

APPLY = "application/apply-patch+yaml"
FIRST_RETRY, MAX_RETRY, MAX_ATTEMPTS = 0.5, 30.0, 10
# A state published while claims are being prepared or unprepared (a burst: many pods
# starting at once) waits until none is, this long at most: its write then does not take
# the CPU and connections the burst's prepares need, and a claim unprepared within it is
# written once. A state published when no claim is in hand is written at once.
DELAY = 0.2
# Claims written at once (threads, each on a kept-alive connection of the client's pool,
# which holds --claim-workers + 4). A write is mostly waiting for the API server; more
# would only queue there on a small control plane, and each thread is one more taking
# the interpreter lock from the event loop.
WRITERS = 8


@dataclass(frozen=True)
class DeviceStatus:
    pool: str
    device: str
    share_id: str | None
    ready: bool
    reason: str  # a metav1.Condition reason: Prepared, PrepareFailed
    message: str = ""
    data: dict | None = None
    network: dict | None = None  # networkData: interfaceName, ips, hardwareAddress
    idle: tuple[str, str] | None = None  # (message, since): the Idle condition, if any
    # (message, since): the NetworkReady condition, set once the NIC is in the pod's
    # network namespace (driver/nri/status.py)
    network_ready: tuple[str, str] | None = None


IDLE, IDLE_REASON = "Idle", "DeviceIdle"
NETWORK_READY, NETWORK_READY_REASON = "NetworkReady", "InterfaceMoved"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def entry(driver: str, status: DeviceStatus, when: str) -> dict:
    body: dict = {"driver": driver, "pool": status.pool, "device": status.device}
    if status.share_id:
        body["shareID"] = status.share_id
    body["conditions"] = [{"type": "Ready", "status": "True" if status.ready else "False",
                           "reason": status.reason, "message": status.message[:32768],
                           "lastTransitionTime": when}]
    if status.idle is not None:
        body["conditions"].append({"type": IDLE, "status": "True", "reason": IDLE_REASON,
                                   "message": status.idle[0][:32768],
                                   "lastTransitionTime": status.idle[1]})
    if status.network_ready is not None:
        body["conditions"].append({"type": NETWORK_READY, "status": "True",
                                   "reason": NETWORK_READY_REASON,
                                   "message": status.network_ready[0][:32768],
                                   "lastTransitionTime": status.network_ready[1]})
    if status.data:
        body["data"] = status.data
    if status.network:
        body["networkData"] = status.network
    return body


def apply_body(ref: ClaimRef, driver: str, devices: list[DeviceStatus], version: str,
               when: str | Callable[[DeviceStatus], str]) -> dict:
    """`when`: the Ready condition's lastTransitionTime, or a function of the entry."""
    at = when if callable(when) else (lambda _: when)
    return {"apiVersion": f"{API_GROUP}/{version}", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": [entry(driver, d, at(d)) for d in devices]}}


def key(status: DeviceStatus) -> tuple[str, str, str | None]:
    return status.pool, status.device, status.share_id


def ours(claim: dict, driver: str) -> tuple[list[DeviceStatus], dict]:
    """This driver's entries of a claim as the server has them, and when each entry's
    Ready condition last changed: {key: (ready, reason, time)}."""
    found, times = [], {}
    for item in ((claim.get("status") or {}).get("devices") or []):
        if item.get("driver") != driver:
            continue
        conditions = {c.get("type"): c for c in item.get("conditions") or []}
        ready = conditions.get("Ready") or {}
        idle = conditions.get(IDLE)
        network = conditions.get(NETWORK_READY)
        status = DeviceStatus(item.get("pool", ""), item.get("device", ""), item.get("shareID"),
                              ready.get("status") == "True", ready.get("reason", ""),
                              ready.get("message", ""), item.get("data"), item.get("networkData"),
                              (idle.get("message", ""), idle.get("lastTransitionTime", ""))
                              if idle and idle.get("status") == "True" else None,
                              (network.get("message", ""), network.get("lastTransitionTime", ""))
                              if network and network.get("status") == "True" else None)
        found.append(status)
        times[key(status)] = (status.ready, status.reason, ready.get("lastTransitionTime") or now())
    return found, times


class Overlay(Protocol):
    """A kind of status kept apart from prepare's (the Idle condition): given the entries
    about to be written for a claim, the entries with its part added."""

    def __call__(self, ref: ClaimRef, devices: list[DeviceStatus]) -> list[DeviceStatus]: ...


@dataclass
class _Pending:
    ref: ClaimRef
    devices: list[DeviceStatus]
    attempt: int = 0
    due: float = 0.0


@dataclass
class StatusWriter:
    kube: Kube
    driver: str
    on_failure: Callable[[], None] = lambda: None  # a metric's inc
    clock: Callable[[], float] = time.monotonic
    _pending: dict[str, _Pending] = field(default_factory=dict)
    # uid -> what was last written: the kubelet repeats prepares (after a restart, for
    # every pod of a claim); the same state is not written again with a new timestamp.
    _written: dict[str, list[DeviceStatus]] = field(default_factory=dict)
    # uid -> what is being written now: between taking a state off `_pending` and remembering
    # it as written, it is still the claim's current state (an overlay's change in that
    # window, e.g. a NIC moved into the pod, must build on it; seen on the cluster tier)
    _writing: dict[str, list[DeviceStatus]] = field(default_factory=dict)
    # the other kinds of status, applied to every state written (driver/prepare/idlestatus.py)
    overlays: list[Overlay] = field(default_factory=list)
    # uid -> (pool, device, share) -> (ready, reason, time): Ready's lastTransitionTime
    _times: dict[str, dict[tuple, tuple[bool, str, str]]] = field(default_factory=dict)
    writers: int = WRITERS
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stopped: bool = False
    _busy: int = 0
    # claims being prepared or unprepared now (`in_hand`)
    _in_hand: int = 0

    def __post_init__(self) -> None:
        self.log = structlog.get_logger(component="claim_status")

    def publish(self, ref: ClaimRef, devices: list[DeviceStatus]) -> None:
        """Make the claim's entries of this driver these (none: remove them). Returns at once."""
        with self._cv:
            if self._stopped:
                return
            for overlay in self.overlays:
                devices = overlay(ref, devices)
            pending = self._pending.get(ref.uid)
            last = self._writing.get(ref.uid, self._written.get(ref.uid))
            if pending is None and last == list(devices):
                return
            if pending is not None and pending.attempt == 0:
                due = pending.due
            else:
                due = self.clock() + (DELAY if self._in_hand else 0.0)
            self._pending[ref.uid] = _Pending(ref, list(devices), 0, due)
            # one more thread while there are claims for it (made once, kept)
            if len(self._threads) < min(self.writers, len(self._pending) + self._busy):
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"claim-status-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            self._cv.notify()

    @contextlib.contextmanager
    def in_hand(self) -> Iterator[None]:
        """Held while one claim is prepared or unprepared. When the last claim in hand is
        done, the states that wait for the burst to end are due at once: in a burst of 64
        one-claim prepares against a real API server the fixed DELAY after each claim put
        the last status ~0.45 s after the burst's start, against ~0.15 s for the same API
        calls alone (bench/RESULTS.md, "One node's burst")."""
        with self._cv:
            self._in_hand += 1
        try:
            yield
        finally:
            with self._cv:
                self._in_hand -= 1
                if not self._in_hand:
                    now = self.clock()
                    for pending in self._pending.values():
                        if pending.attempt == 0 and pending.due > now:
                            pending.due = now
                    self._cv.notify_all()

    def current(self, uid: str) -> list[DeviceStatus] | None:
        """The entries pending or last written for a claim; None when this process has
        written none (a claim prepared before a restart)."""
        with self._cv:
            pending = self._pending.get(uid)
            if pending is not None:
                return list(pending.devices)
            writing = self._writing.get(uid)
            return list(writing) if writing is not None else self._written.get(uid)

    def read_back(self, ref: ClaimRef) -> list[DeviceStatus]:
        """This driver's entries of the claim as the server has them, remembered as written."""
        try:
            version = self.kube.resource_version()
            claim = self.kube.request("GET", f"/apis/{API_GROUP}/{version}/namespaces/"
                                             f"{ref.namespace}/resourceclaims/{ref.name}")
        except ApiError as err:
            self.log.info("claim_status_read_failed", claim_uid=ref.uid, error=str(err))
            return []
        if (claim.get("metadata") or {}).get("uid") != ref.uid:
            return []
        found, times = ours(claim, self.driver)
        with self._cv:
            if found and ref.uid not in self._written:
                self._written[ref.uid] = found
                self._times[ref.uid] = times
        return found

    def wait_idle(self, timeout: float) -> bool:
        """Tests and shutdown: True once nothing is pending or being written."""
        deadline = self.clock() + timeout
        with self._cv:
            while self._pending or self._busy:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Write what is due within `timeout`, then stop (the rest is rewritten by the next
        prepare or unprepare of those claims)."""
        self.wait_idle(timeout)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped:
                    # a claim being written waits for that write: its states land in order
                    ready = [p for p in self._pending.values() if p.ref.uid not in self._writing]
                    due = [p for p in ready if p.due <= self.clock()]
                    if due:
                        break
                    wait = min((p.due for p in ready), default=self.clock() + 1) - self.clock()
                    self._cv.wait(max(wait, 0.01))
                if self._stopped:
                    return
                item = min(due, key=lambda p: p.due)
                del self._pending[item.ref.uid]
                self._writing[item.ref.uid] = item.devices
                self._busy += 1
            try:
                self._write(item)
            finally:
                with self._cv:
                    self._writing.pop(item.ref.uid, None)
                    self._busy -= 1
                    self._cv.notify_all()

    def _write(self, item: _Pending) -> None:
        log = self.log.bind(claim_uid=item.ref.uid, claim_namespace=item.ref.namespace,
                            claim_name=item.ref.name)
        try:
            version = self.kube.resource_version()
            path = (f"/apis/{API_GROUP}/{version}/namespaces/{item.ref.namespace}/resourceclaims/"
                    f"{item.ref.name}/status")
            stamp = now()
            times = self._times.get(item.ref.uid, {})

            def ready_since(d: DeviceStatus) -> str:
                known = times.get(key(d))
                return known[2] if known and known[:2] == (d.ready, d.reason) else stamp

            body = apply_body(item.ref, self.driver, item.devices, version, ready_since)
            self.kube.request("PATCH", path, query={"fieldManager": self.driver, "force": "true"},
                              body=json.dumps(body), content_type=APPLY)
        except NotFound:
            log.debug("claim_status_claim_gone")
            self._remember(item.ref.uid, None)
            return
        except ApiError as err:
            if err.status == 409 and "UID" in str(err):
                log.info("claim_status_claim_recreated", error=str(err))
                self._remember(item.ref.uid, None)
                return
            self.on_failure()
            item.attempt += 1
            if item.attempt >= MAX_ATTEMPTS:
                log.warning("claim_status_write_abandoned", attempts=item.attempt, error=str(err))
                return
            delay = min(FIRST_RETRY * 2 ** (item.attempt - 1), MAX_RETRY)
            log.warning("claim_status_write_failed", attempt=item.attempt, retry_in_s=delay, error=str(err))
            with self._cv:
                # A newer state queued meanwhile wins over this retry.
                if item.ref.uid not in self._pending and not self._stopped:
                    item.due = self.clock() + delay
                    self._pending[item.ref.uid] = item
                    self._cv.notify()
            return
        self._remember(item.ref.uid, item.devices or None,
                       {key(d): (d.ready, d.reason, ready_since(d)) for d in item.devices})
        log.debug("claim_status_written", devices=len(item.devices))

    def _remember(self, uid: str, devices: list[DeviceStatus] | None, times: dict | None = None) -> None:
        with self._cv:
            if devices is None:
                self._written.pop(uid, None)
                self._times.pop(uid, None)
            else:
                self._written[uid] = devices
                self._times[uid] = times or {}
