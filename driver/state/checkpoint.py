"""Crash-safe record of prepared claims: one JSON file per claim under <state-dir>/claims.

One file per claim keeps every prepare O(1) however many claims are prepared, and a
corrupt file costs one claim, not all. Each record carries the boot id: after a reboot
/var/run/cdi is empty and device minors may differ, so the spec is rebuilt from current
hardware instead of trusting the record.

Two driver instances share the directory during an upgrade and change it only under the
cross-process prepare lock. Each keeps the records in memory (the exclusivity check needs
every claim's devices) and re-reads them only when the other instance changed something:
`.changes` holds "<instance token> <nonce> <counter>" of the last change, rewritten on
every change (the nonce is new in every process: a container restarted in the same pod
keeps its token but starts counting again). It needs no fsync: after a crash every process
starts by reading all records. It is read and rewritten in place through a descriptor
held open (one pread, one pwrite): opening, truncating and rewriting it cost ~0.15 ms of
every put and remove on ext4. In place is safe because every read and write of it
happens under the cross-process lock, so no reader sees half a write; an older version
that truncates and rewrites the same file is read as well as before. Inside a process,
claims are removed and written in parallel threads while another thread reads: the cache
and its marker change together under one lock, or a record read just before its removal
could outlive it in the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Iterator

from driver.state import atomic

from driver.kube import names
from driver.state.instance import Instance

FORMAT_VERSION = 1
# The `.changes` marker's width: "<token> <nonce> <counter>" is ~35 characters.
MARKER_BYTES = 128


class CheckpointError(Exception):
    """A record is unreadable or of an unknown format; the message names the file."""


class State(str, Enum):
    # Only Completed is written now (see driver/prepare.py); Started is still understood
    # as "not prepared" so that a record from an older version is redone, not trusted.
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class PreparedDevice:
    request: str  # full request name from the allocation (may be "request/subrequest")
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    config: dict = field(default_factory=dict)  # the decoded opaque config that applied
    share_id: str | None = None
    admin_access: bool = False  # allocated with adminAccess: may sit beside another claim
    # consumedCapacity of a share (canonical quantities): its limits, and what the
    # capacity check of the next share on the device adds up.
    consumed: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: State
    boot_id: str
    devices: tuple[PreparedDevice, ...] = ()
    # The pods the claim was reserved for when last prepared (for `dra-driver status`;
    # older versions ignore the field, so it needs no new format version).
    pods: tuple[str, ...] = ()
    # The UIDs its pods run as, recorded for claims that use MPS (driver/prepare/mpsusers.py:
    # one MPS server serves one UID at a time); optional like `pods`.
    run_as: tuple[int, ...] = ()

    def to_json(self) -> bytes:
        # Field by field rather than dataclasses.asdict, which deep-copies every config
        # only for json to walk it again: one record is written per prepare.
        data = {name: getattr(self, name) for name in _RECORD_FIELDS}
        if not self.run_as:
            del data["run_as"]  # most claims: the record stays as it was
        data["devices"] = [{name: getattr(d, name) for name in _DEVICE_FIELDS}
                           for d in self.devices]
        data["state"] = self.state.value
        data["version"] = FORMAT_VERSION
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: Path) -> "ClaimRecord":
        try:
            data = json.loads(raw)
            if data.get("version") != FORMAT_VERSION:
                raise CheckpointError(f"{source}: unknown checkpoint format {data.get('version')!r}")
            devices = tuple(
                PreparedDevice(
                    request=d["request"], pool=d["pool"], device=d["device"],
                    cdi_ids=tuple(d["cdi_ids"]), config=dict(d.get("config") or {}),
                    share_id=d.get("share_id"), admin_access=bool(d.get("admin_access", False)),
                    consumed=dict(d.get("consumed") or {}),
                )
                for d in data["devices"]
            )
            return cls(uid=data["uid"], namespace=data["namespace"], name=data["name"],
                       state=State(data["state"]), boot_id=data["boot_id"], devices=devices,
                       pods=tuple(str(p) for p in data.get("pods") or ()),
                       run_as=tuple(int(u) for u in data.get("run_as") or ()))
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{source}: corrupt checkpoint record: {err}") from err


_RECORD_FIELDS = tuple(f.name for f in fields(ClaimRecord))
_DEVICE_FIELDS = tuple(f.name for f in fields(PreparedDevice))


class Checkpoint:
    def __init__(self, state_dir: Path, instance: Instance) -> None:
        self.directory = state_dir / "claims"
        self.instance = instance
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic.sweep_temp_files(self.directory, instance.owner_state)
        self._changes = self.directory / ".changes"
        self._marker: int | None = None  # its descriptor, opened on first use
        self._counter = 0
        self._nonce = secrets.token_hex(4)
        self._lock = threading.Lock()  # the cache and _seen change together
        self._seen: str | None = None  # the .changes content our cache reflects
        self._cache: dict[str, ClaimRecord] = {}
        self._groups = threading.local()  # the write group open on a thread, if any

    def path(self, uid: str) -> Path:
        if not names.is_dns_label(uid):
            # UIDs become file names: anything but a plain label could escape the directory.
            raise CheckpointError(f"claim UID {uid!r} is not a valid UID")
        return self.directory / f"{uid}.json"

    def get(self, uid: str) -> ClaimRecord | None:
        path = self.path(uid)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return ClaimRecord.from_json(raw, path)

    def put(self, record: ClaimRecord) -> None:
        """Durable when it returns; inside `group()`, durable when the group commits."""
        group = getattr(self._groups, "open", None)
        if group is not None:
            group.write(self.path(record.uid), record.to_json(), mode=0o600)
        else:
            atomic.write(self.path(record.uid), record.to_json(), mode=0o600,
                         owner=self.instance.token)
        self._changed(record.uid, record)

    def remove(self, uid: str) -> bool:
        group = getattr(self._groups, "open", None)
        removed = (group.remove(self.path(uid)) if group is not None
                   else atomic.remove(self.path(uid)))
        if removed:
            self._changed(uid, None)
        return removed

    @contextlib.contextmanager
    def group(self) -> Iterator[atomic.WriteGroup]:
        """Puts and removes of this thread inside the block are staged in one
        atomic.WriteGroup, durable only after its `commit()` (the caller's, before it
        tells anyone). The cache sees staged records at once, so later claims of the
        group are checked against them; a group that is left without a commit, or whose
        commit fails, makes the next `records()` read the disk again."""
        group = atomic.WriteGroup(self.instance.token)
        self._groups.open = group
        committed = False
        try:
            yield group
            committed = len(group) == 0
        finally:
            self._groups.open = None
            if not committed:
                group.abandon()
                with self._lock:
                    self._seen = None  # what the cache holds may not be on the disk

    def commit(self, group: atomic.WriteGroup, parallel: Executor | None = None) -> None:
        """Make a group's records durable (see `group`; `parallel`: atomic.WriteGroup.commit)."""
        try:
            group.commit(parallel)
        except BaseException:
            with self._lock:
                self._seen = None
            raise

    # -- all records, for cross-claim checks (call under the cross-process lock) ---------
    def records(self, fresh: bool = False) -> Iterator[ClaimRecord]:
        """Every readable record; unreadable ones are skipped (their claim's own prepare
        quarantines them). `fresh` re-reads the directory whatever the marker says: the
        periodic reconcile trusts the disk, not the cache."""
        with self._lock:
            current = self._read_changes()
            if fresh or current is None or current != self._seen:
                self._cache, self._seen = read_records(self.directory), current
            return iter(list(self._cache.values()))

    def _marker_fd(self) -> int:
        if self._marker is None:
            self._marker = os.open(self._changes, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._marker

    def _read_changes(self) -> str | None:
        """The marker without its padding; None before anything was ever changed."""
        return os.pread(self._marker_fd(), MARKER_BYTES, 0).decode(errors="replace").rstrip() or None

    def _changed(self, uid: str, record: ClaimRecord | None) -> None:
        with self._lock:
            stale = self._read_changes() != self._seen
            self._counter += 1
            marker = f"{self.instance.token} {self._nonce} {self._counter}"
            # Padded to a fixed width: each write covers the whole of the last one (an
            # older version's, unpadded, is shorter), so nothing needs truncating.
            os.pwrite(self._marker_fd(), marker.ljust(MARKER_BYTES).encode(), 0)
            if stale:
                self._seen = None  # someone else changed records too: re-read next time
                return
            if record is None:
                self._cache.pop(uid, None)
            else:
                self._cache[uid] = record
            self._seen = marker

    def uids(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.json"))

    def close(self) -> None:
        """Close the marker's descriptor (a later change opens it again)."""
        with self._lock:
            if self._marker is not None:
                os.close(self._marker)
                self._marker = None

    def quarantine(self, uid: str) -> Path:
        """Move an unreadable record aside (kept for a human) so the claim can be redone."""
        path = self.path(uid)
        target = path.with_suffix(".json.corrupt")
        path.replace(target)
        atomic.fsync_dir(self.directory)
        return target


def read_records(directory: Path, problems: list[str] | None = None) -> dict[str, ClaimRecord]:
    """Every readable record of a claims directory, by UID; an unreadable one is skipped
    (and said in `problems`). Reads only: `dra-driver status` uses it beside the driver."""
    found = {}
    for path in directory.glob("*.json"):
        try:
            found[path.stem] = ClaimRecord.from_json(path.read_bytes(), path)
        except (OSError, CheckpointError) as err:
            if problems is not None:
                problems.append(str(err))
    return found


def read_boot_id(proc: Path) -> str:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return "unknown"
