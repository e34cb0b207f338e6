"""The API server's validation rules for ResourceSlices (reference.md §4), written
independently of the driver's own checks so that a bug there cannot hide itself.

Used by the discovery tests and by the API emulator, which rejects writes exactly where
the real API server would.
"""

from __future__ import annotations

import re

from driver.kube.quantity import QuantityError
from driver.kube.quantity import value as size

LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEMVER = re.compile(
    r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$"
)


LABEL_KEY_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _label_key(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    if prefix and not _subdomain(prefix):
        return False
    return len(name) <= 63 and bool(LABEL_KEY_NAME.match(name))


def _subdomain(value: str) -> bool:
    return 0 < len(value) <= 253 and all(LABEL.match(p) and len(p) <= 63 for p in value.split("."))


def _qualified(value: str) -> bool:
    if "/" in value:
        domain, ident = value.split("/", 1)
        if not (_subdomain(domain) and len(domain) <= 63):
            return False
    else:
        ident = value
    return len(ident) <= 32 and bool(C_IDENT.match(ident))


def slice_errors(obj: dict, has_taint_limit: bool = True, server: tuple[int, int] = (1, 36)) -> list[str]:
    """`server`: the API server's (major, minor); the shared-counter layout changed in 1.35."""
    errors: list[str] = []
    spec = obj.get("spec", {})
    errors += counter_errors(spec, server)
    version = obj.get("apiVersion", "").rsplit("/", 1)[-1]
    name = obj.get("metadata", {}).get("name", "")
    if not _subdomain(name):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    driver = spec.get("driver", "")
    if not (_subdomain(driver) and len(driver) <= 63):
        errors.append(f"spec.driver {driver!r} invalid")
    pool = spec.get("pool", {})
    pool_name = pool.get("name", "")
    if not pool_name or len(pool_name) > 253 or not all(_subdomain(p) for p in pool_name.split("/")):
        errors.append(f"spec.pool.name {pool_name!r} invalid")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errors.append("spec.pool.generation must be a non-negative integer")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        errors.append("spec.pool.resourceSliceCount must be >= 1")
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(selectors) != 1:
        errors.append(f"exactly one of nodeName/nodeSelector/allNodes/perDeviceNodeSelection, got {selectors}")
    devices = spec.get("devices", [])
    tainted = any((d.get("basic", d)).get("taints") for d in devices)
    counted = any((d.get("basic", d)).get("consumesCounters") for d in devices)
    limit = 64 if (tainted and has_taint_limit) or (counted and server >= (1, 35)) else 128
    if len(devices) > limit:
        errors.append(f"{len(devices)} devices, limit {limit}")
    seen = set()
    for i, device in enumerate(devices):
        where = f"spec.devices[{i}]"
        dname = device.get("name", "")
        if not (LABEL.match(dname) and len(dname) <= 63):
            errors.append(f"{where}.name {dname!r} is not a DNS label")
        if dname in seen:
            errors.append(f"{where}.name {dname!r} duplicated")
        seen.add(dname)
        body = device.get("basic", {}) if version == "v1beta1" else device
        if version == "v1beta1" and set(device) - {"name", "basic"}:
            errors.append(f"{where}: v1beta1 devices nest fields under basic")
        attrs = body.get("attributes", {}) or {}
        caps = body.get("capacity", {}) or {}
        if len(attrs) + len(caps) > 32:
            errors.append(f"{where}: {len(attrs) + len(caps)} attributes+capacities > 32")
        for key, value in attrs.items():
            if not _qualified(key):
                errors.append(f"{where}.attributes[{key}]: invalid name")
            if not isinstance(value, dict) or len(value) != 1:
                errors.append(f"{where}.attributes[{key}]: exactly one value required")
                continue
            (kind, v), = value.items()
            if kind in ("string", "version") and (not isinstance(v, str) or len(v) > 64):
                errors.append(f"{where}.attributes[{key}]: value longer than 64")
            if kind == "version" and not SEMVER.match(str(v)):
                errors.append(f"{where}.attributes[{key}]: {v!r} is not semver")
            if kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                errors.append(f"{where}.attributes[{key}]: not an int")
            if kind == "bool" and not isinstance(v, bool):
                errors.append(f"{where}.attributes[{key}]: not a bool")
            if kind not in ("string", "version", "int", "bool"):
                errors.append(f"{where}.attributes[{key}]: unknown type {kind}")
        multiple = body.get("allowMultipleAllocations")
        if multiple is not None and not isinstance(multiple, bool):
            errors.append(f"{where}.allowMultipleAllocations must be a boolean")
        for key, value in caps.items():
            if not _qualified(key):
                errors.append(f"{where}.capacity[{key}]: invalid name")
            if not isinstance(value, dict) or not isinstance(value.get("value"), str):
                errors.append(f"{where}.capacity[{key}]: value must be a quantity string")
                continue
            if "requestPolicy" in value:
                if multiple is not True:
                    errors.append(f"{where}.capacity[{key}].requestPolicy: may only be set when "
                                  "allowMultipleAllocations is true")
                errors += request_policy_errors(f"{where}.capacity[{key}].requestPolicy",
                                                value["requestPolicy"], value["value"])
        taints = body.get("taints", []) or []
        if len(taints) > 4:
            errors.append(f"{where}: {len(taints)} taints > 4")
        for t in taints:
            if t.get("effect") not in ("NoSchedule", "NoExecute"):
                errors.append(f"{where}: taint effect {t.get('effect')!r}")
            if not _label_key(t.get("key", "")):
                errors.append(f"{where}: taint key {t.get('key')!r}")
    return errors


def request_policy_errors(where: str, policy: object, capacity: str) -> list[str]:
    """CapacityRequestPolicy rules (KEP-5075, resource/v1 validation): validValues xor
    validRange; a default inside them; validValues ascending, at most 10, containing the
    default; validRange min required, max and default on the min + n*step grid."""
    if not isinstance(policy, dict):
        return [f"{where}: must be an object"]
    unknown = set(policy) - {"default", "validValues", "validRange"}
    if unknown:
        return [f"{where}: unknown field(s) {sorted(unknown)}"]
    errors: list[str] = []
    try:
        total = size(capacity)
        default = size(policy["default"]) if policy.get("default") is not None else None
        values = [size(v) for v in policy.get("validValues") or []]
        bounds = policy.get("validRange")
        low = size(bounds["min"]) if isinstance(bounds, dict) and "min" in bounds else None
        high = size(bounds["max"]) if isinstance(bounds, dict) and bounds.get("max") else None
        step = size(bounds["step"]) if isinstance(bounds, dict) and bounds.get("step") else None
    except (QuantityError, TypeError) as err:
        return [f"{where}: {err}"]
    if values and bounds is not None:
        errors.append(f"{where}: validValues and validRange are mutually exclusive")
    if (values or bounds is not None) and default is None:
        errors.append(f"{where}.default: required with validValues or validRange")
    if default is not None and default > total:
        errors.append(f"{where}.default: larger than the capacity value {capacity}")
    if values:
        if len(values) > 10:
            errors.append(f"{where}.validValues: {len(values)} entries > 10")
        if values != sorted(set(values)):
            errors.append(f"{where}.validValues: must be ascending without duplicates")
        if default is not None and default not in values:
            errors.append(f"{where}.validValues: must contain the default")
    if bounds is not None:
        if low is None:
            errors.append(f"{where}.validRange.min: required")
        elif default is not None:
            if default < low or (high is not None and default > high):
                errors.append(f"{where}.default: outside validRange")
            if step is not None and (default - low) % step:
                errors.append(f"{where}.default: not min + n*step")
            if step is not None and high is not None and (high - low) % step:
                errors.append(f"{where}.validRange.max: not min + n*step")
        if step is not None and step <= 0:
            errors.append(f"{where}.validRange.step: must be positive")
    return errors


def counter_errors(spec: dict, server: tuple[int, int]) -> list[str]:
    """Shared counters (KEP-4815, resource/v1 validation). 1.34: counter sets live beside
    the devices that consume them, at most 32 counters in all sets of a slice. 1.35 and
    later: a slice holds devices or counter sets, never both; at most 8 sets of at most 32
    counters; a device consumes from at most 2 sets, each at most once. References across
    slices cannot be checked here (the allocator checks the pool): see pool_counter_errors."""
    errors: list[str] = []
    sets = spec.get("sharedCounters") or []
    devices = spec.get("devices") or []
    names_seen: set[str] = set()
    for i, counter_set in enumerate(sets):
        name = counter_set.get("name", "")
        if not (LABEL.match(name) and len(name) <= 63):
            errors.append(f"spec.sharedCounters[{i}].name {name!r} is not a DNS label")
        if name in names_seen:
            errors.append(f"spec.sharedCounters[{i}].name {name!r} duplicated")
        names_seen.add(name)
        counters = counter_set.get("counters") or {}
        if not counters:
            errors.append(f"spec.sharedCounters[{i}].counters: Required value")
        if len(counters) > 32:
            errors.append(f"spec.sharedCounters[{i}]: {len(counters)} counters > 32")
        for key, counter in counters.items():
            if not (LABEL.match(key) and len(key) <= 63):
                errors.append(f"spec.sharedCounters[{i}].counters[{key}]: not a DNS label")
            if not isinstance(counter, dict) or not isinstance(counter.get("value"), str):
                errors.append(f"spec.sharedCounters[{i}].counters[{key}].value must be a quantity")
    if server >= (1, 35):
        if sets and devices:
            errors.append("spec: only one of devices and sharedCounters may be set")
        if len(sets) > 8:
            errors.append(f"spec.sharedCounters: {len(sets)} counter sets > 8")
    elif sum(len(c.get("counters") or {}) for c in sets) > 32:
        errors.append("spec.sharedCounters: more than 32 counters in all sets")
    for i, device in enumerate(devices):
        uses = (device.get("basic", device)).get("consumesCounters") or []
        where = f"spec.devices[{i}].consumesCounters"
        if server >= (1, 35) and len(uses) > 2:
            errors.append(f"{where}: {len(uses)} entries > 2")
        referenced = [u.get("counterSet") for u in uses]
        if len(set(referenced)) != len(referenced):
            errors.append(f"{where}: a counter set referenced twice")
        for j, use in enumerate(uses):
            if server < (1, 35) and use.get("counterSet") not in names_seen:
                errors.append(f"{where}[{j}].counterSet {use.get('counterSet')!r} is not a "
                              "counter set of this slice")
            for key, counter in (use.get("counters") or {}).items():
                if not isinstance(counter, dict) or not isinstance(counter.get("value"), str):
                    errors.append(f"{where}[{j}].counters[{key}].value must be a quantity")
    return errors


def pool_counter_errors(slices: list[dict]) -> list[str]:
    """What the allocator checks of a whole pool: every consumed counter exists in a counter
    set of the pool at the same generation, and no set is defined twice."""
    errors: list[str] = []
    generation = max((s["spec"]["pool"]["generation"] for s in slices), default=0)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
    sets: dict[str, dict] = {}
    for obj in current:
        for counter_set in obj["spec"].get("sharedCounters") or []:
            if counter_set["name"] in sets:
                errors.append(f"counter set {counter_set['name']!r} defined twice in the pool")
            sets[counter_set["name"]] = counter_set.get("counters") or {}
    for obj in current:
        for device in obj["spec"].get("devices") or []:
            for use in device.get("consumesCounters") or []:
                known = sets.get(use.get("counterSet"))
                if known is None:
                    errors.append(f"device {device['name']}: counter set {use.get('counterSet')!r} "
                                  "not in the pool")
                    continue
                for key, counter in (use.get("counters") or {}).items():
                    if key not in known:
                        errors.append(f"device {device['name']}: counter {key!r} not in set "
                                      f"{use['counterSet']!r}")
                    elif size(counter["value"]) > size(known[key]["value"]):
                        errors.append(f"device {device['name']}: consumes more {key} than the set has")
    return errors
