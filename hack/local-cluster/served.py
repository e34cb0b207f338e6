"""resource.k8s.io objects in the version a release serves.

The cluster tier writes its claims, templates, classes and the odd slice in
resource.k8s.io/v1, as the examples and docs do. A release that does not serve v1 (1.32
serves v1beta1, 1.33 also v1beta2) gets them in the newest version it serves, as a user
of that release writes them, and what the tests read back is read as v1 again:

- v1beta2 (1.33) has v1's shape: only the apiVersion differs.
- v1beta1 (1.32, 1.33) nests a request's fields in the request itself where v1 has
  `exactly: {...}`, and a device's fields under `basic: {...}` where v1 has them flat.

Only the tests' manifests and reads go through this; what the driver publishes and writes
is its own (it negotiates the version itself, driver/kube/client.py), and the tests that
check it read the server's objects as v1 through this same conversion, which keeps every
field. Nothing here exists for 1.34 on: v1 is served there.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

GROUP = "resource.k8s.io"
V1 = f"{GROUP}/v1"
# fields of a v1 DeviceRequest that are not under `exactly`
_REQUEST_OWN = ("name", "exactly", "firstAvailable")
# fields of a v1 Device that stay beside `basic` in v1beta1
_DEVICE_OWN = ("name",)


def _requests_down(spec: dict) -> None:
    devices = spec.get("devices") or {}
    for i, request in enumerate(devices.get("requests") or []):
        if "exactly" in request:
            flat = {k: v for k, v in request.items() if k != "exactly"}
            flat.update(request["exactly"])
            devices["requests"][i] = flat


def _requests_up(spec: dict) -> None:
    devices = spec.get("devices") or {}
    for i, request in enumerate(devices.get("requests") or []):
        if "exactly" in request or "firstAvailable" in request:
            continue
        own = {k: v for k, v in request.items() if k in _REQUEST_OWN}
        own["exactly"] = {k: v for k, v in request.items() if k not in _REQUEST_OWN}
        devices["requests"][i] = own


def _devices_down(spec: dict) -> None:
    for i, device in enumerate(spec.get("devices") or []):
        if "basic" not in device:
            spec["devices"][i] = {**{k: device[k] for k in _DEVICE_OWN if k in device},
                                  "basic": {k: v for k, v in device.items() if k not in _DEVICE_OWN}}


def _devices_up(spec: dict) -> None:
    for i, device in enumerate(spec.get("devices") or []):
        if "basic" in device:
            spec["devices"][i] = {**{k: v for k, v in device.items() if k != "basic"}, **device["basic"]}


def _spec(obj: dict) -> dict:
    return obj.get("spec") or {}


def _template_spec(obj: dict) -> dict:
    return _spec(obj).get("spec") or {}


# kind -> the part of it that differs in v1beta1, and its conversion down from v1 and up
_V1BETA1: dict[str, tuple[Callable[[dict], dict], Callable[[dict], None], Callable[[dict], None]]] = {
    "ResourceClaim": (_spec, _requests_down, _requests_up),
    "ResourceClaimTemplate": (_template_spec, _requests_down, _requests_up),
    "ResourceSlice": (_spec, _devices_down, _devices_up),
}


def down(obj: Any, version: str) -> Any:
    """A v1 object (or list, or anything else, left as it is) in `version`."""
    if not isinstance(obj, dict) or version == "v1":
        return obj
    if obj.get("kind", "").endswith("List") and isinstance(obj.get("items"), list):
        return {**obj, "items": [down(o, version) for o in obj["items"]]}
    if obj.get("apiVersion") != V1:
        return obj
    obj = copy.deepcopy(obj)
    obj["apiVersion"] = f"{GROUP}/{version}"
    if version == "v1beta1" and obj.get("kind") in _V1BETA1:
        part, convert, _ = _V1BETA1[obj["kind"]]
        convert(part(obj))
    return obj


def up(obj: Any) -> Any:
    """What the server answered, in v1 (nested objects of a List too)."""
    if isinstance(obj, list):
        return [up(o) for o in obj]
    if not isinstance(obj, dict):
        return obj
    version = str(obj.get("apiVersion", ""))
    if isinstance(obj.get("items"), list):
        # the API server's lists leave kind and apiVersion out of their items
        kind = str(obj.get("kind", "")).removesuffix("List")
        own = {"apiVersion": version, "kind": kind} if version.startswith(f"{GROUP}/") else {}
        obj = {**obj, "items": [up({**own, **o} if isinstance(o, dict) else o) for o in obj["items"]]}
    if not version.startswith(f"{GROUP}/") or version == V1:
        return obj
    old = version.split("/", 1)[1]
    obj = copy.deepcopy(obj)
    obj["apiVersion"] = V1
    if old == "v1beta1" and obj.get("kind") in _V1BETA1:
        part, _, convert = _V1BETA1[obj["kind"]]
        convert(part(obj))
    return obj


_PATH = re.compile(rf"^(/apis/{re.escape(GROUP)}/)v1(/|\?|$)")


def path(p: str, version: str) -> str:
    """/apis/resource.k8s.io/v1/... in `version`."""
    return p if version == "v1" else _PATH.sub(rf"\g<1>{version}\g<2>", p)
