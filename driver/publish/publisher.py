"""Keeps this node's ResourceSlices in the API server equal to the inventory.

Reconciliation compares the desired slices with what the API server has (listed with the
field selectors spec.nodeName and spec.driver) and writes only the difference:

* Same device partition (same slice names holding the same device names) at one
  generation: update only slices whose content changed, generation unchanged. Nothing
  changed: zero writes.
* Devices added to or removed from one slice only (a VF of a PF; driver/publish/slices.py keeps a
  PF and its VFs in one slice), the other slices holding the same devices: that slice is
  updated in place, generation unchanged. One update is atomic, so no consumer can see a
  device twice or miss one that stays.
* Otherwise (a device moving between slices, a slice added or removed, a slice split by
  the taint limit) or when the pool is inconsistent: write every desired slice at
  generation+1, then delete the rest. The scheduler trusts a pool only when all slices of
  its highest generation are there, so it never mixes old and new device sets.

What the slices should be, and whether a listed one already is, comes from
driver/publish/desired.py (quantities compared by value, builds kept while their inputs
are unchanged). Updates start from the live object, so labels, annotations, finalizers and owner references others added survive;
deletes carry the UID and resourceVersion we saw, so a slice re-created meanwhile stays.

During a seamless upgrade two instances run; only the newest live one writes
(`newer_instance`), the older stands by and takes over again if the newer one goes. With
an unchanged inventory neither writes anything, unhealthy devices included: a starting
instance publishes nothing before its first health pass (`health_ready`), and a taint that
is already published on the same device keeps its timeAdded.

A watch on our slices triggers a reconcile whenever someone else deletes or edits one
(the kubelet deletes a driver's slices at its start and after the driver disconnects), and
keeps the copy of them a reconcile compares with (driver/publish/slicecache.py): while the watch
runs, a reconcile makes no LIST. API errors are retried with capped
exponential backoff and jitter, and the reconcile after a failed one LISTs; prepare calls
do not depend on any of this.

A fleet starting at once meets API Priority and Fairness: the driver's ServiceAccount
lands in a limited priority level (workload-low unless a FlowSchema says otherwise), and
when its queues are full the server answers 429 with Retry-After before doing anything.
Such a request is sent again (a write too: it was never executed) after the server's
Retry-After, grown exponentially and spread by jitter so that the throttled nodes do not
come back in step, up to THROTTLE_RETRIES times; only then does the pass fail and the
reconcile backoff above take over. Retrying the one request keeps what the pass did
so far: failing the pass would re-LIST and resend every slice.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import structlog
from driver.aio import wait_event
from driver.devices.model import Inventory
from driver.kube import releases
from driver.kube.client import API_GROUP, ApiError, Kube, NotFound
from driver.publish import slices
from driver.publish.desired import DesiredSlices, node_owners
from driver.publish.slicecache import SliceCache
from driver.publish.slices import PoolIdentity

BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0
RESYNC_SECONDS = 300.0
WATCH_SECONDS = 240
STANDBY_RECHECK_SECONDS = 5.0  # how soon a standing-by instance notices the newer one gone
# 429s in a row on one request before the pass gives up (with APF's Retry-After of 1, waits
# of at least 1, 1, 2, 4, 8, 16, 30, 30 s, each stretched by up to 2x: a throttled node keeps
# trying for 1.5 to 3 minutes before the run loop's backoff takes over).
THROTTLE_RETRIES = 8


@dataclass
class PublishStats:
    writes: int = 0
    failures: int = 0
    reconciles: int = 0
    published: bool = False  # the first complete publish is done (readiness)
    deferred: int = 0  # writes left to a newer instance
    lists: int = 0  # LISTs a reconcile made (none while the watch keeps the copy)
    throttled: int = 0  # 429s answered to a reconcile's requests (each then sent again)
    throttle_wait: float = 0.0  # seconds waited before sending them again, in all
    throttle_wait_max: float = 0.0  # the longest of those waits


def _uses(obj: dict | None, device_field: str, spec_field: str | None = None) -> bool:
    spec = (obj or {}).get("spec") or {}
    return bool(spec_field and spec.get(spec_field)) or any(
        d.get(device_field) for d in spec.get("devices") or [])


def _dropped(sent: dict, stored: dict | None, device_field: str, spec_field: str | None = None) -> bool:
    """We sent the field and the server did not keep it (its feature gate is off)."""
    return _uses(sent, device_field, spec_field) and not _uses(stored, device_field, spec_field)


def _one_slice_regrouped(known: Mapping[str, tuple], want: Mapping[str, tuple], have: Mapping) -> bool:
    """The device set changed within one existing slice only (a VF added to or removed from
    its PF's slice). One update is atomic: every consumer sees each device once, in the old
    slice or the new one, so the generation may stay, as the upstream slice controller keeps
    it when one update suffices. A device moving between slices changes two of them, and
    a slice created or deleted changes the count: both take a new generation."""
    if not (set(known) == set(want) == set(have)):
        return False
    return sum(known[name] != devices for name, devices in want.items()) == 1


def _pool(obj: dict, field_name: str) -> int | None:
    """A pool field of a listed slice; None when someone else's edit left it unusable."""
    value = ((obj.get("spec") or {}).get("pool") or {}).get(field_name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class Publisher:
    kube: Kube
    driver: str
    node: str
    inventory: Callable[[], Inventory]
    taints: Callable[[], Mapping[str, Sequence[dict]]] = lambda: {}
    resync_seconds: float = RESYNC_SECONDS
    stats: PublishStats = field(default_factory=PublishStats)
    api_version: str | None = None
    node_uid: str | None = None
    metrics: Any = None  # driver.metrics.Metrics, optional
    taints_supported: bool = True
    # --gpu-sharing; falls back to exclusive where the server drops the consumable-capacity
    # fields (gate DRAConsumableCapacity off, or a server older than 1.34).
    sharing: str = slices.EXCLUSIVE
    sharing_supported: bool = True
    # Partitionable devices (dynamic MIG): their counters' layout follows the server's
    # version; where it has none, or drops them (gate off), `counters_unsupported` is called
    # once (the plugin then rediscovers in static MIG mode).
    counters_layout: str | None = None
    counters_supported: bool = True
    counters_unsupported: Callable[[], None] = lambda: None
    # The newest live instance of this driver on the node that started after us, if any
    # (driver/state/instance.py); while there is one, it publishes and we do not.
    newer_instance: Callable[[], Any] = lambda: None
    watch_seconds: int = WATCH_SECONDS  # the server ends each watch after this; we resume
    # Whether the first health pass is done (HealthState.probed). Until it is, nothing is
    # published: slices written earlier would offer unhealthy devices without their taints,
    # and the taints added a moment later would cost a second write (issue 28.13).
    health_ready: Callable[[], bool] = lambda: True
    # Told the server's release, the resource.k8s.io version and this node's kubelet release
    # (None: unknown) once they are known (the start-up `cluster_support` line,
    # driver/service/support.py); the release is asked only then.
    negotiated: Callable[[tuple[int, int], str, tuple[int, int] | None], None] | None = None
    server: tuple[int, int] | None = None
    kubelet: tuple[int, int] | None = None  # from the Node's status.nodeInfo.kubeletVersion

    def __post_init__(self) -> None:
        self.log = structlog.get_logger(component="publisher", node=self.node)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._rng = random.Random()
        self._published: tuple[int, dict] | None = None  # (generation, partition) we wrote
        self._standing_by: Any = None  # the newer instance we leave writes to
        self.cache = SliceCache()
        self._relist = False  # the last reconcile failed: do not trust the copy
        self.desired = DesiredSlices()
        self._waiting_for_health = False

    # -- triggers ------------------------------------------------------------------------
    def trigger(self) -> None:
        """Ask for a reconcile soon; safe from any thread."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:
            pass  # the loop closed while we were stopping: nothing left to wake

    # -- API -----------------------------------------------------------------------------
    def _base(self) -> str:
        return f"/apis/{API_GROUP}/{self.api_version}/resourceslices"

    def _selector(self) -> dict:
        return {"fieldSelector": f"spec.nodeName={self.node},spec.driver={self.driver}"}

    def negotiate(self) -> str:
        if self.api_version is None:
            version = self.kube.resource_version()
            if self.negotiated is not None:
                self.server = self.kube.server_version()
            self.api_version = version
            self.log.info("resource_api_version", version=self.api_version)
            if self.negotiated is not None and self.server is not None:
                self._owner()  # the Node: its kubelet's release
                self.negotiated(self.server, version, self.kubelet)
        return self.api_version

    def _layout(self, wanted: bool) -> str | None:
        """Where counters go: beside the devices (1.34), in slices of their own (1.35+)."""
        if not wanted or not self.counters_supported:
            return None
        if self.counters_layout is None:
            server = self.server = self.server or self.kube.server_version()
            if self.api_version == "v1beta1" or server < (1, 34):
                self._drop_counters(f"the API server is {server[0]}.{server[1]}; shared counters "
                                    "need 1.34 or newer")
                return None
            self.counters_layout = slices.COMBINED if server < (1, 35) else slices.SPLIT
            self.log.info("shared_counters_layout", layout=self.counters_layout,
                          server=f"{server[0]}.{server[1]}")
        return self.counters_layout

    def _drop_counters(self, reason: str) -> None:
        if self.counters_supported:
            self.counters_supported = False
            self.log.warning("partitionable_devices_unsupported", reason=reason,
                             publishing="static MIG devices")
            self.counters_unsupported()

    def _owner(self) -> None:
        if self.node_uid is not None:
            return
        try:
            node = self._request("GET", f"/api/v1/nodes/{self.node}")
            self.node_uid = node["metadata"]["uid"]
            self.kubelet = releases.parse(((node.get("status") or {}).get("nodeInfo") or {})
                                          .get("kubeletVersion"))
        except ApiError as err:
            # Slices still work without the owner reference; garbage collection of a
            # deleted node's slices is what we lose, so keep trying on later passes.
            self.log.warning("node_lookup_failed", error=str(err))

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """kube.request, sent again after a 429 (see the module's docstring)."""
        for attempt in range(1, THROTTLE_RETRIES + 2):
            try:
                return self.kube.request(method, path, **kwargs)
            except ApiError as err:
                if err.status != 429 or attempt > THROTTLE_RETRIES:
                    raise
                delay = self.throttle_delay(err.retry_after, attempt)
                self.stats.throttled += 1
                self.stats.throttle_wait += delay
                self.stats.throttle_wait_max = max(self.stats.throttle_wait_max, delay)
                self.log.info("publish_throttled", method=method, path=path, attempt=attempt,
                              retry_after=err.retry_after, retry_in=round(delay, 2))
                if self._stop.wait(delay):
                    raise
        raise AssertionError("unreachable")

    def throttle_delay(self, retry_after: float | None, attempt: int) -> float:
        """How long to wait before the `attempt`th resend: never sooner than the server
        asked, doubling from BACKOFF_BASE per attempt, then spread over up to twice that
        (the nodes a full queue turned away at one moment come back over a second or more,
        not all at once after exactly Retry-After)."""
        floor = max(retry_after or 0.0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (attempt - 1)))
        return floor * self._rng.uniform(1.0, 2.0)

    def _ours(self, obj: dict) -> bool:
        spec = obj.get("spec") or {}
        return spec.get("driver") == self.driver and spec.get("nodeName") == self.node

    def _list(self) -> tuple[list[dict], str | None]:
        listing = self._request("GET", self._base(), query=self._selector()) or {}
        version = (listing.get("metadata") or {}).get("resourceVersion")
        return [s for s in listing.get("items") or [] if self._ours(s)], version

    def list_existing(self) -> list[dict]:
        return self._list()[0]

    def _existing(self) -> dict[str, dict]:
        """The slices the server has: the watch's copy while it is trusted, else a LIST."""
        snapshot = None if self._relist else self.cache.snapshot()
        if snapshot is None:
            self.stats.lists += 1
            snapshot = {s["metadata"]["name"]: s for s in self.list_existing()}
            self._relist = False
        return snapshot

    # -- reconcile -----------------------------------------------------------------------
    def reconcile(self) -> int:
        """One pass; returns the number of writes. Raises ApiError on failure."""
        try:
            return self._reconcile()
        except Exception:
            # A stale copy shows as a conflict; whatever it was, the next pass LISTs.
            self._relist = True
            raise

    def _reconcile(self) -> int:
        if not self.health_ready():
            if not self._waiting_for_health:
                self._waiting_for_health = True
                self.log.info("publish_waits_for_health")
            return 0  # the first health pass triggers the next reconcile
        self.negotiate()
        self._owner()
        self.stats.reconciles += 1
        existing = self._existing()
        pool = PoolIdentity(self.driver, self.node, self.node_uid)
        generations = {_pool(s, "generation") for s in existing.values()}
        current = max((g for g in generations if g is not None), default=0)
        # v1beta1 (1.32) has no device taints; where the server drops them (feature gate
        # off) we stop sending them rather than rewriting the slice forever.
        taints = self.taints() if self.taints_supported and self.api_version != "v1beta1" else {}
        taints = self.desired.keep_time_added(taints, existing)
        sharing = self.sharing if self.sharing_supported else slices.EXCLUSIVE
        inventory = self.inventory()
        layout = self._layout(bool(inventory.counter_sets))
        built = self.desired.build(inventory, pool, current, self.api_version, taints, sharing, layout)
        desired, want = built.slices, built.partition
        have = {name: self.desired.listed(obj).devices for name, obj in existing.items()}
        # What we last published, if this process published: then an external edit or
        # delete is repaired in place. A fresh process trusts the API server's partition.
        known = self._published if self._published and self._published[0] == current else (current, have)
        in_place = (
            len(generations) == 1
            and None not in generations
            and all(_pool(s, "resourceSliceCount") == len(desired) for s in existing.values())
            and (known[1] == want and set(have) <= set(want) or _one_slice_regrouped(known[1], want, have))
        )
        writes = 0
        changed = [o for o in desired if o["metadata"]["name"] not in existing
                   or not self.desired.unchanged(existing[o["metadata"]["name"]], built, o["metadata"]["name"])]
        if self._defer(bool(changed) or not in_place):
            return 0
        if in_place:
            for obj in changed:
                writes += self._put(obj, existing.get(obj["metadata"]["name"]))
            generation = current
            for name in (n for n, devices in want.items() if known[1].get(n) != devices):
                self.log.info("pool_slice_devices_changed", generation=generation, slice=name,
                              devices=len(want[name]), before=len(known[1].get(name) or ()))
        else:
            generation = current + 1
            self.desired.forget()  # built for the old generation: not the next pass's
            for obj in desired:
                obj["spec"]["pool"]["generation"] = generation
                writes += self._put(obj, existing.get(obj["metadata"]["name"]))
            keep = {o["metadata"]["name"] for o in desired}
            for name in sorted(set(existing) - keep):
                writes += self._delete(existing[name])
            self.log.info("pool_generation_published", generation=generation, slices=len(desired),
                          devices=sum(len(o["spec"].get("devices", [])) for o in desired))
        self._published = (generation, want)
        self.stats.writes += writes
        self._mark_published(writes, generation)
        return writes

    def _mark_published(self, writes: int, generation: int | None) -> None:
        """Readiness: the first complete pass is done (the node's slices are what they
        should be, written by us or kept by a newer instance)."""
        if not self.stats.published:
            self.log.info("slices_in_sync", writes=writes, generation=generation)
        self.stats.published = True

    def _defer(self, would_write: bool) -> bool:
        """True while a newer instance publishes: then this one writes nothing."""
        newer = self.newer_instance()
        if newer is None:
            if self._standing_by is not None:
                self.log.info("publishing_resumed", newer_instance=self._standing_by.token)
                self._standing_by = None
            return False
        if self._standing_by != newer:
            self.log.info("publishing_left_to_newer_instance", newer_instance=newer.token)
            self._standing_by = newer
        self._published = None  # the newer instance may change the partition
        self._mark_published(0, None)  # the node's slices are kept: not a reason to be unready
        if would_write:
            self.stats.deferred += 1
        return True

    def _put(self, obj: dict, have: dict | None) -> int:
        name = obj["metadata"]["name"]
        if have is None:
            stored = self._request("POST", self._base(), body=obj)
            self.log.debug("slice_created", slice=name)
        else:
            stored = self._request("PUT", f"{self._base()}/{name}", body=_updated(have, obj))
            self.log.debug("slice_updated", slice=name)
        # Fields of a disabled feature gate are dropped by the server without an error:
        # stop sending them rather than rewriting the slice forever.
        if _dropped(obj, stored, "taints") and self.taints_supported:
            self.taints_supported = False
            self.log.warning("device_taints_unsupported",
                             hint="enable the DRADeviceTaints feature gate to publish unhealthy devices as taints")
        if _dropped(obj, stored, "consumesCounters", "sharedCounters"):
            self._drop_counters("the API server dropped sharedCounters/consumesCounters: enable "
                                "the DRAPartitionableDevices feature gate (on by default from 1.36)")
        if _dropped(obj, stored, "allowMultipleAllocations") and self.sharing_supported:
            self.sharing_supported = False
            self.log.warning("consumable_capacity_unsupported", publishing="exclusive",
                             hint="the API server dropped allowMultipleAllocations: enable the "
                                  "DRAConsumableCapacity feature gate (on by default from 1.36)")
        if isinstance(stored, dict) and isinstance(stored.get("metadata"), dict):
            self.cache.stored(stored)
        if self.metrics is not None:
            self.metrics.publish_writes.inc()
        return 1

    def _delete(self, have: dict) -> int:
        """Delete the slice we listed, and only that one: a slice re-created or changed
        since (another instance, a restarted kubelet) fails the preconditions and stays."""
        meta = have["metadata"]
        name = meta["name"]
        options = {"apiVersion": "v1", "kind": "DeleteOptions",
                   "preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}}
        try:
            self._request("DELETE", f"{self._base()}/{name}", body=options)
        except NotFound:
            self.cache.removed(have)
            return 0
        except ApiError as err:
            if err.status != 409:
                raise
            self.log.info("slice_delete_skipped", slice=name, reason="changed since listed")
            self.trigger()
            return 0
        self.cache.removed(have)
        self.log.debug("slice_deleted", slice=name)
        if self.metrics is not None:
            self.metrics.publish_writes.inc()
        return 1

    def delete_all(self) -> int:
        """`dra-driver cleanup`: remove this node's slices on purpose."""
        self.negotiate()
        return sum(self._delete(s) for s in self.list_existing())

    # -- loops ---------------------------------------------------------------------------
    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        watcher = threading.Thread(target=self._watch_loop, name="slice-watch", daemon=True)
        watcher.start()
        failures = 0
        try:
            while True:
                try:
                    await asyncio.to_thread(self.reconcile)
                    failures = 0
                    delay = self.resync_seconds
                    if self._standing_by is not None:
                        delay = min(delay, STANDBY_RECHECK_SECONDS)
                except Exception as err:  # ApiError, and anything a bad slice of someone else's causes
                    failures += 1
                    self.stats.failures += 1
                    if self.metrics is not None:
                        self.metrics.publish_failures.inc()
                    delay = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1))
                    delay *= self._rng.uniform(0.5, 1.0)  # jitter: nodes must not retry in step
                    delay = max(delay, getattr(err, "retry_after", None) or 0.0)  # never before the server asked
                    log = self.log.warning if isinstance(err, ApiError) else self.log.error
                    log("publish_failed", error=str(err) or repr(err), retry_in=round(delay, 2),
                        attempt=failures)
                if await wait_event(self._wake, delay):
                    # Coalesce bursts (our own writes echo back through the watch).
                    await asyncio.sleep(0.05)
                self._wake.clear()
        finally:
            self._stop.set()
            self.cache.invalidate()  # nothing keeps it true now

    def _watch_loop(self) -> None:
        """Blocking list-then-watch in a thread: keeps `cache` and wakes the reconciler on
        every change to our slices."""
        failures = 0
        while not self._stop.is_set():
            if self.api_version is None:
                self._stop.wait(0.2)
                continue
            try:
                if not self.cache.synced:
                    items, version = self._list()
                    self.cache.replace(items, version)
                    self.trigger()
                query = {**self._selector(), "watch": "1", "timeoutSeconds": str(self.watch_seconds),
                         "allowWatchBookmarks": "true"}
                if self.cache.resource_version:
                    query["resourceVersion"] = self.cache.resource_version
                for event in self.kube.stream(self._base(), query, timeout=self.watch_seconds + 10):
                    failures = 0
                    if self._stop.is_set():
                        return
                    if self._watched(event):
                        self.trigger()
                # Ended by the server (timeoutSeconds) or by an ERROR event: resume from the
                # version seen last, or LIST again when the copy was invalidated.
            except Exception as err:  # noqa: BLE001 - this thread must outlive any one event
                # An ApiError is routine (the server restarts, a watch times out). Anything
                # else is a bug or an event we cannot read; ending the thread over it would
                # leave the copy looking current while nothing updates it.
                failures += 1
                self.cache.invalidate()
                delay = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** failures) * self._rng.uniform(0.5, 1.0)
                delay = max(delay, getattr(err, "retry_after", None) or 0.0)
                if isinstance(err, ApiError):
                    self.log.debug("slice_watch_failed", error=str(err), retry_in=round(delay, 2))
                else:
                    self.log.error("slice_watch_failed", error=repr(err), retry_in=round(delay, 2))
                self._stop.wait(delay)
                self.trigger()

    def _watched(self, event: Any) -> bool:
        """Apply one watch event to the copy; True when it is about one of our slices."""
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            return False
        if kind == "ERROR":
            # 410 Expired: the version we resume from is older than the server keeps.
            self.log.info("slice_watch_expired", reason=obj.get("reason"), code=obj.get("code"))
            self.cache.invalidate()
            self.trigger()
            return False
        if kind == "BOOKMARK":
            self.cache.event(kind, obj)
            return False
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not self._ours(obj):
            return False
        self.cache.event(kind, obj)
        return True


def _updated(live: dict, desired: dict) -> dict:
    """The PUT body: the live object (resourceVersion, labels, annotations, finalizers and
    what else others keep there) with our spec and our Node owner reference."""
    # Our spec replaces theirs whole: only the rest is copied (a deep copy of a listed
    # slice's 128 devices was a third of a one-VF publish's CPU).
    body = copy.deepcopy({k: v for k, v in live.items() if k != "spec"})
    body["apiVersion"] = desired["apiVersion"]
    body["kind"] = desired["kind"]
    body["spec"] = desired["spec"]
    meta = body.setdefault("metadata", {})
    theirs = [r for r in meta.get("ownerReferences") or [] if r not in node_owners(live)]
    ours = desired["metadata"].get("ownerReferences") or []
    if ours or theirs:
        meta["ownerReferences"] = ours + theirs
    else:
        meta.pop("ownerReferences", None)
    return body
