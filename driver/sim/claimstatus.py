"""The API server's part for ResourceClaim `status.devices` (KEP-4817), as strict as the
real one where a driver can get it wrong.

- Only server-side apply (`PATCH .../resourceclaims/NAME/status`, content type
  `application/apply-patch+yaml`, a `fieldManager`) is accepted here: that is what lets
  several drivers write entries of one claim without overwriting each other.
- `status.devices` is a map list keyed by (driver, device, pool, shareID): an apply owns
  the entries it sends; an entry it sent before and omits now is removed unless another
  manager also owns it; an entry owned by another manager is a conflict unless `force`.
- `metadata.uid` in the body is a precondition (409 when the claim was re-created).
- Validation (k8s.io/kubernetes pkg/apis/resource/validation): each entry must name an
  allocation result of the claim; ≤ 8 conditions, each a valid metav1.Condition; `data`
  ≤ 10 KiB; `networkData.interfaceName` ≤ 256 bytes, `ips` ≤ 16, unique, CIDR notation,
  `hardwareAddress` ≤ 128 bytes.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MAX_CONDITIONS = 8
MAX_DATA_BYTES = 10 * 1024
MAX_INTERFACE_NAME = 256
MAX_IPS = 16
MAX_HARDWARE_ADDRESS = 128
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


class ApplyError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def key_of(entry: dict) -> tuple[str, str, str, str]:
    return (entry.get("driver", ""), entry.get("device", ""), entry.get("pool", ""),
            entry.get("shareID") or "")


def apply(claim: dict, owners: dict[tuple, set[str]], body: Any, manager: str | None,
          force: bool, content_type: str) -> dict:
    """Apply `body` to the stored claim in place; returns the claim. `owners`: entry key ->
    field managers, kept by the caller beside the claim."""
    if not content_type.startswith(APPLY_CONTENT_TYPE):
        raise ApplyError(415, "UnsupportedMediaType",
                         f"the body of the request was in an unknown format - accepted media types "
                         f"include: application/apply-patch+yaml (got {content_type!r})")
    if not manager:
        raise ApplyError(400, "BadRequest", "PATCH requests with apply must have a fieldManager")
    if not isinstance(body, dict):
        raise ApplyError(400, "BadRequest", "the apply body is not an object")
    meta = claim["metadata"]
    sent = body.get("metadata") or {}
    if sent.get("name") not in (None, meta["name"]):
        raise ApplyError(400, "BadRequest", "the name of the object does not match the URL")
    if sent.get("uid") not in (None, meta.get("uid")):
        raise ApplyError(409, "Conflict", f"Precondition failed: UID in precondition: {sent['uid']}, "
                                          f"UID in object meta: {meta.get('uid')}")
    entries = ((body.get("status") or {}).get("devices")) or []
    if not isinstance(entries, list):
        raise ApplyError(422, "Invalid", "status.devices: must be a list")
    errors = validate(claim, entries)
    if errors:
        raise ApplyError(422, "Invalid", f"ResourceClaim.resource.k8s.io {meta['name']!r} is invalid: "
                                         + "; ".join(errors))
    status = claim.setdefault("status", {})
    current = {key_of(e): e for e in status.get("devices") or []}
    wanted = {key_of(e): e for e in entries}
    for key in wanted:
        others = owners.get(key, set()) - {manager}
        if others and not force:
            raise ApplyError(409, "Conflict", f"Apply failed with 1 conflict: conflict with "
                                              f"{sorted(others)[0]!r}: .status.devices{list(key)}")
    for key, holders in list(owners.items()):
        if manager in holders and key not in wanted:
            holders.discard(manager)
            if not holders:
                del owners[key]
                current.pop(key, None)
    for key, entry in wanted.items():
        owners[key] = {manager}
        current[key] = entry
    if current:
        status["devices"] = list(current.values())
    else:
        status.pop("devices", None)
    return claim


def validate(claim: dict, entries: list) -> list[str]:
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
               .get("results") or [])
    allocated = {(r.get("driver"), r.get("device"), r.get("pool"), r.get("shareID") or "") for r in results}
    errors = []
    seen = set()
    for index, entry in enumerate(entries):
        where = f"status.devices[{index}]"
        if not isinstance(entry, dict):
            errors.append(f"{where}: must be an object")
            continue
        for field in ("driver", "pool", "device"):
            if not entry.get(field):
                errors.append(f"{where}.{field}: Required value")
        key = key_of(entry)
        if key in seen:
            errors.append(f"{where}: Duplicate value: {list(key)}")
        seen.add(key)
        if key not in allocated:
            errors.append(f"{where}: Invalid value: {list(key)}: must be an allocated device in the claim")
        conditions = entry.get("conditions") or []
        if len(conditions) > MAX_CONDITIONS:
            errors.append(f"{where}.conditions: Too many: {len(conditions)}: must have at most {MAX_CONDITIONS} items")
        for c_index, condition in enumerate(conditions):
            errors += _condition_errors(f"{where}.conditions[{c_index}]", condition)
        if "data" in entry and len(json.dumps(entry["data"], separators=(",", ":"))) > MAX_DATA_BYTES:
            errors.append(f"{where}.data: Too long: must have at most {MAX_DATA_BYTES} bytes")
        network = entry.get("networkData")
        if network is not None:
            errors += _network_errors(f"{where}.networkData", network)
    return errors


def _condition_errors(where: str, condition: Any) -> list[str]:
    if not isinstance(condition, dict):
        return [f"{where}: must be an object"]
    errors = []
    if not condition.get("type"):
        errors.append(f"{where}.type: Required value")
    if condition.get("status") not in ("True", "False", "Unknown"):
        errors.append(f"{where}.status: Unsupported value: {condition.get('status')!r}")
    if not isinstance(condition.get("reason"), str) or not _REASON.match(condition["reason"]):
        errors.append(f"{where}.reason: Invalid value: {condition.get('reason')!r}")
    if not isinstance(condition.get("lastTransitionTime"), str) or not _TIME.match(condition["lastTransitionTime"]):
        errors.append(f"{where}.lastTransitionTime: Required value")
    if not isinstance(condition.get("message"), str):
        errors.append(f"{where}.message: Required value")
    elif len(condition["message"]) > 32768:
        errors.append(f"{where}.message: Too long")
    return errors


def _network_errors(where: str, network: Any) -> list[str]:
    if not isinstance(network, dict):
        return [f"{where}: must be an object"]
    errors = []
    if len(str(network.get("interfaceName", "")).encode()) > MAX_INTERFACE_NAME:
        errors.append(f"{where}.interfaceName: Too long")
    if len(str(network.get("hardwareAddress", "")).encode()) > MAX_HARDWARE_ADDRESS:
        errors.append(f"{where}.hardwareAddress: Too long")
    ips = network.get("ips") or []
    if len(ips) > MAX_IPS:
        errors.append(f"{where}.ips: Too many: {len(ips)}: must have at most {MAX_IPS} items")
    if len(set(ips)) != len(ips):
        errors.append(f"{where}.ips: Duplicate value")
    for ip in ips:
        try:
            if "/" not in str(ip):
                raise ValueError
            ipaddress.ip_interface(ip)
        except ValueError:
            errors.append(f"{where}.ips: Invalid value: {ip!r}: must be a valid address in CIDR form")
    return errors


def modified_drivers(old: dict, new: dict) -> set[str]:
    """The drivers whose status.devices entries differ between two versions of a claim:
    added, removed or changed (k8s.io/kubernetes pkg/registry/resource, getModifiedDrivers)."""
    def entries(claim: dict) -> dict[tuple, dict]:
        return {key_of(e): e for e in ((claim.get("status") or {}).get("devices") or [])}
    before, after = entries(old), entries(new)
    return {key[0] for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


def driver_forbidden(claim: str, driver: str, namespace: str,
                     user: str = "system:serviceaccount:dra-system:dra-dra-accel-driver") -> str:
    """The real server's message for a status.devices change without the driver grant."""
    return (f'ResourceClaim.resource.k8s.io "{claim}" is invalid: status.devices: Forbidden: changing '
            'status.devices requires resource="resourceclaims/driver", verb="[associated-node:patch '
            f'arbitrary-node:patch]" permission: resourceclaims.resource.k8s.io "{driver}" is forbidden: '
            f'User "{user}" cannot associated-node:patch resource "resourceclaims/driver" in API group '
            f'"resource.k8s.io" in the namespace "{namespace}"')
