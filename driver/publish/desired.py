"""What this node's ResourceSlices should be, and whether a listed slice already is.

The publisher (driver/publish/publisher.py) decides what to write; this module builds the
desired slices from the inventory and compares the listed ones with them, keeping what
did not change from one pass to the next: a device's entry while the device is the same
object, the whole build while its inputs are the same, a listed slice's normalized form
while its resourceVersion is the same. A no-change reconcile on a node of 2,048 devices
therefore neither builds, decodes nor normalizes them again.

Quantities are compared by value: the API server stores `40960Mi` as `40Gi`, and a
string comparison would rewrite such a slice on every pass. A taint already published on
the same device keeps its timeAdded, so an unchanged condition rewrites nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from driver.devices.model import Device, Inventory
from driver.kube import quantity
from driver.publish import slices
from driver.publish.slices import PoolIdentity

# The device fields this driver writes. Anything else in a listed slice (defaults a newer
# API server adds) is not ours and must not look like a difference: otherwise every
# reconcile would rewrite the slice and its watch event would trigger the next rewrite.
_DEVICE_FIELDS = ("attributes", "capacity", "taints", "allowMultipleAllocations", "consumesCounters")


def _quantity(value: Any) -> Any:
    try:
        return quantity.parse(value)[0]
    except quantity.QuantityError:
        return value  # not a quantity (someone else's edit): compared as it is


def _device(device: dict) -> dict:
    body = device.get("basic", device)  # v1beta1 nests the fields under `basic`
    fields = {k: body[k] for k in _DEVICE_FIELDS if body.get(k)}
    if isinstance(fields.get("capacity"), dict):
        fields["capacity"] = {
            name: (_capacity(c) if isinstance(c, dict) else c)
            for name, c in fields["capacity"].items()
        }
    return {"name": device.get("name"), **fields}


def _capacity(capacity: dict) -> dict:
    """A capacity entry with every quantity (value and request policy) compared by value."""
    out = {**capacity, "value": _quantity(capacity.get("value"))}
    policy = capacity.get("requestPolicy")
    if isinstance(policy, dict):
        policy = dict(policy)
        if "default" in policy:
            policy["default"] = _quantity(policy["default"])
        if isinstance(policy.get("validRange"), dict):
            policy["validRange"] = {k: _quantity(v) for k, v in policy["validRange"].items()}
        if isinstance(policy.get("validValues"), list):
            policy["validValues"] = [_quantity(v) for v in policy["validValues"]]
        out["requestPolicy"] = policy
    return out


def node_owners(obj: dict) -> list:
    """Our owner reference (the Node); references others added are theirs to keep."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return [r for r in refs if isinstance(r, dict) and r.get("kind") == "Node"]


def _content(obj: dict, device: Callable[[dict], dict] = _device) -> dict:
    """What we own in a slice, normalized: everything but the pool generation."""
    spec = obj.get("spec") or {}
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    return {
        "driver": spec.get("driver"),
        "nodeName": spec.get("nodeName"),
        "pool": pool,
        "devices": [device(d) for d in spec.get("devices") or []],
        "sharedCounters": spec.get("sharedCounters") or [],
        "owners": node_owners(obj),
    }


def _partition(objects: Sequence[dict]) -> dict[str, tuple[str, ...]]:
    return {o["metadata"]["name"]: tuple(d.get("name") for d in o.get("spec", {}).get("devices") or [])
            for o in objects}


@dataclass
class _Desired:
    """One build of the desired slices, with what a reconcile compares of them."""

    inputs: tuple
    slices: list[dict]
    contents: dict[str, dict]  # name -> normalized content
    partition: dict[str, tuple[str, ...]]
    before: "_Desired | None" = None  # the build this one replaced
    kept: frozenset[str] = frozenset()  # slices whose content is the same as in `before`


def _same_content(old: dict | None, new: dict) -> bool:
    """Whether a slice's content is unchanged from one build to the next, told cheaply:
    its devices' normalized entries are the same objects (`Publisher._build` keeps a
    device's entry while the device is unchanged), and the few other fields are equal."""
    if old is None or len(old["devices"]) != len(new["devices"]):
        return False
    return (all(a is b for a, b in zip(old["devices"], new["devices"]))
            and all(old[key] == new[key] for key in new if key != "devices"))


@dataclass
class _Listed:
    """A listed slice at one resourceVersion, normalized once."""

    version: str | None
    content: dict
    devices: tuple[str, ...]
    equal_to: _Desired | None = None  # the build it was found equal to


def _taint_key(taint: dict) -> tuple:
    """What makes two taints the same one (the server leaves out an empty value)."""
    return taint.get("key"), taint.get("value") or "", taint.get("effect")


class DesiredSlices:
    """The desired slices of one publisher, built again only when an input changed, and
    the listed slices normalized once per resourceVersion."""

    def __init__(self) -> None:
        self._desired: _Desired | None = None  # the last build
        # device name -> (device, how it was published, its entry, the entry normalized):
        # after one VF changed, a build makes one entry, not 2,048.
        self._entries: dict[str, tuple[Device, tuple, dict, dict]] = {}
        self._listed: dict[str, _Listed] = {}
        # (the listed slices' names and versions, device -> {taint: timeAdded} in them)
        self._taint_times: tuple[tuple, dict[str, dict[tuple, str]]] | None = None

    def forget(self) -> None:
        """The last build is not the next pass's (it was for an older generation)."""
        self._desired = None

    def listed(self, obj: dict) -> _Listed:
        """A listed slice normalized, once per resourceVersion."""
        name = obj["metadata"]["name"]
        version = obj["metadata"].get("resourceVersion")
        known = self._listed.get(name)
        if known is not None and version is not None and known.version == version:
            return known
        listed = _Listed(version, _content(obj), _partition([obj])[name])
        if version is not None:
            self._listed[name] = listed
        return listed

    def unchanged(self, have: dict, desired: _Desired, name: str) -> bool:
        listed = self.listed(have)
        if listed.equal_to is desired:
            return True  # compared at this resourceVersion with this build already
        if listed.equal_to is not None and listed.equal_to is desired.before and name in desired.kept:
            # Equal to the last build, which this one did not change here (one VF added
            # leaves 15 of 16 slices so): no need to compare 128 devices again.
            listed.equal_to = desired
            return True
        if listed.content != desired.contents[name]:
            return False
        listed.equal_to = desired
        return True

    def build(self, inventory: Inventory, pool: PoolIdentity, current: int, api_version: str,
              taints: Mapping, sharing: str, layout: str | None) -> _Desired:
        """The desired slices; rebuilt only when an input changed. Rediscovery replaces
        the inventory object only when it changed, so the same object means the same
        devices."""
        inputs = (inventory, pool, current, api_version, dict(taints), sharing, layout)
        built = self._desired
        if built is not None and built.inputs[0] is inventory and built.inputs[1:] == inputs[1:]:
            return built
        entries: dict[str, tuple[Device, tuple, dict, dict]] = {}
        normalized: dict[int, dict] = {}

        def entry(device: Device, api_version: str, device_taints: Sequence[dict], how: str) -> dict:
            key = (api_version, how, copy.deepcopy(list(device_taints)) if device_taints else [])
            known = self._entries.get(device.name)
            if known is None or known[0] is not device or known[1] != key:
                body = slices.device_body(device, api_version, device_taints, how)
                known = (device, key, body, _device(body))
            entries[device.name] = known
            normalized[id(known[2])] = known[3]
            return known[2]

        desired = slices.build(inventory, pool, current, api_version, taints, sharing, layout, entry)
        self._entries = entries  # devices gone are forgotten

        def device(body: dict) -> dict:
            return normalized.get(id(body)) or _device(body)

        contents = {o["metadata"]["name"]: _content(o, device) for o in desired}
        before = self._desired
        kept: frozenset[str] = frozenset()
        if before is not None:
            before.before = None  # one build back is all a comparison uses
            kept = frozenset(name for name, c in contents.items() if _same_content(before.contents.get(name), c))
        self._desired = _Desired(inputs, desired, contents, _partition(desired), before, kept)
        return self._desired

    def keep_time_added(self, taints: Mapping[str, Sequence[dict]],
                         existing: Mapping[str, dict]) -> Mapping[str, Sequence[dict]]:
        """Our taints, each with the timeAdded of the same taint (key, value, effect) on the
        same device in the slices already published: the condition has held since then
        (a restart or an upgrade finds it again, with a later time), and a new time would
        rewrite an unchanged slice. A taint that is new or changed keeps its own time."""
        if not taints:
            return taints
        published = self._published_taints(existing)
        out: dict[str, Sequence[dict]] | None = None
        for device, wanted in taints.items():
            before = published.get(device)
            if not before:
                continue
            kept = []
            for taint in wanted:
                since = before.get(_taint_key(taint))
                kept.append({**taint, "timeAdded": since}
                            if since is not None and since != taint.get("timeAdded") else taint)
            if any(a is not b for a, b in zip(kept, wanted)):
                if out is None:
                    out = dict(taints)
                out[device] = kept
        return taints if out is None else out

    def _published_taints(self, existing: Mapping[str, dict]) -> dict[str, dict[tuple, str]]:
        """device -> {(key, value, effect): timeAdded} in the listed slices; read again only
        when a slice changed (its resourceVersion)."""
        versions = tuple(sorted((name, (obj.get("metadata") or {}).get("resourceVersion"))
                                for name, obj in existing.items()))
        if self._taint_times is not None and self._taint_times[0] == versions:
            return self._taint_times[1]
        index: dict[str, dict[tuple, str]] = {}
        for obj in existing.values():
            for device in (obj.get("spec") or {}).get("devices") or []:
                body = device.get("basic", device) if isinstance(device, dict) else None
                if not isinstance(body, dict):
                    continue  # someone else's malformed entry: nothing to keep from it
                found = body.get("taints")
                if not isinstance(found, list):
                    continue
                times = {_taint_key(t): t["timeAdded"] for t in found
                         if isinstance(t, dict) and isinstance(t.get("timeAdded"), str)}
                if times:
                    index[str(device.get("name"))] = times
        self._taint_times = (versions, index)
        return index
