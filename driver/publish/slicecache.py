"""This node's ResourceSlices as the API server has them, kept by list-then-watch.

The publisher used to LIST its slices on every reconcile: on a node with 2,048 devices
that is a megabyte the server encodes and we decode, and it was most of a no-change
reconcile. Instead the watch that wakes the publisher also keeps this copy: one LIST,
then a watch from its resourceVersion, resumed from the last version seen when it ends
(the server ends every watch after `timeoutSeconds`). A LIST happens again only when the
watch cannot resume (410 Expired, or a failed watch).

Our own writes go in as soon as the server answers them, so that a reconcile right after
one does not see the slice as it was (and send an update with a stale resourceVersion);
events the watch delivers later for an older version are then ignored. Versions are
compared as integers where both are, which is what every API server hands out; the API
calls them opaque, so where they are not integers the newest arrival wins.
"""

from __future__ import annotations

import threading


def _newer(incoming: str | None, known: str | None) -> bool:
    if known is None or incoming is None:
        return True
    if incoming.isdigit() and known.isdigit():
        return int(incoming) > int(known)
    return incoming != known


def _version(obj: dict) -> str | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return value if isinstance(value, str) else None


class SliceCache:
    """Thread-safe: the watch thread writes, the reconciling thread reads snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slices: dict[str, dict] = {}
        # name -> resourceVersion of the newest thing we know about it, deletions included
        self._seen: dict[str, str | None] = {}
        self._synced = False
        self.resource_version: str | None = None  # where the watch resumes
        self.lists = 0  # LISTs it was filled from

    @property
    def synced(self) -> bool:
        return self._synced

    def snapshot(self) -> dict[str, dict] | None:
        """name -> slice, or None when the copy cannot be trusted (not listed yet, or the
        watch broke): the caller LISTs then."""
        with self._lock:
            return dict(self._slices) if self._synced else None

    def replace(self, items: list[dict], resource_version: str | None) -> None:
        """After a LIST: its items are the truth as of `resource_version`."""
        with self._lock:
            self._slices = {s["metadata"]["name"]: s for s in items}
            self._seen = {name: _version(s) for name, s in self._slices.items()}
            self.resource_version = resource_version
            self._synced = True
            self.lists += 1

    def invalidate(self) -> None:
        """The watch broke or expired: trust nothing until the next LIST."""
        with self._lock:
            self._synced = False

    def event(self, kind: str, obj: dict) -> None:
        """One watch event (ADDED, MODIFIED, DELETED or BOOKMARK)."""
        version = _version(obj)
        with self._lock:
            if version is not None:
                self.resource_version = version
            if kind == "BOOKMARK":
                return
            name = (obj.get("metadata") or {}).get("name")
            if not isinstance(name, str) or not _newer(version, self._seen.get(name)):
                return  # an echo of a write we already hold, or older
            self._seen[name] = version
            if kind == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = obj

    def stored(self, obj: dict) -> None:
        """The server's answer to our create or update."""
        name = obj["metadata"]["name"]
        version = _version(obj)
        with self._lock:
            if _newer(version, self._seen.get(name)):
                self._seen[name] = version
                self._slices[name] = obj

    def removed(self, obj: dict) -> None:
        """We deleted the slice `obj` (with its uid and resourceVersion as preconditions)
        or found it gone. Events up to its version are from before the delete and must not
        bring it back; its DELETED event, and a re-creation by someone else, come later."""
        name = obj["metadata"]["name"]
        version = _version(obj)
        with self._lock:
            if _newer(version, self._seen.get(name)):
                self._seen[name] = version
            self._slices.pop(name, None)
