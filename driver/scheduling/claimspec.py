"""A claim as the API server takes it: decoded strictly for its apiVersion, converted to
v1, defaulted and validated, with the server's own field errors.

explain and the demo judge what the scheduler would do, and the scheduler only ever sees
claims the API server accepted, in its internal (v1) form. A v1 claim written in v1beta1's
layout (a request's `deviceClassName` beside its name instead of under `exactly:`, the usual
slip when moving to v1) is refused by the server; judging it anyway answered "fits" for a
claim `kubectl apply` rejects, and the demo's allocator stopped on a KeyError. Facts from
Kubernetes v1.37.2: pkg/apis/resource/v1beta1/conversion.go (any request-level field makes
an `exactly`), defaults.go (ExactCount, count 1), validation/validation.go (the messages).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from driver.kube import names

GROUP = "resource.k8s.io"
SERVED = ("v1", "v1beta2", "v1beta1")  # what 1.37 serves for claims, all converted to v1
CLAIM_KINDS = ("ResourceClaim", "ResourceClaimTemplate")

# The fields of a v1 ExactDeviceRequest, which v1beta1 puts on the request itself.
EXACT_FIELDS = frozenset({"deviceClassName", "selectors", "allocationMode", "count", "adminAccess",
                          "tolerations", "capacity", "derivedAttributes"})
REQUEST_FIELDS = {
    "v1": frozenset({"name", "exactly", "firstAvailable"}),
    "v1beta2": frozenset({"name", "exactly", "firstAvailable"}),
    "v1beta1": frozenset({"name", "firstAvailable"}) | EXACT_FIELDS,
}
SUBREQUEST_FIELDS = (EXACT_FIELDS - {"adminAccess"}) | {"name"}
MODES = ("All", "ExactCount")

LABEL_MESSAGE = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                 "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
                 "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
SUBDOMAIN_MESSAGE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                     "'-' or '.', and must start and end with an alphanumeric character (e.g. "
                     "'example.com', regex used for validation is "
                     "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")


class ClaimSpecError(ValueError):
    """The API server would refuse the object; the message is the server's."""


@dataclass(frozen=True)
class Converted:
    kind: str
    name: str
    version: str  # the apiVersion's version part, as written
    spec: dict  # the claim's spec (for a template, its spec.spec), in v1 form, defaulted


def convert(obj: dict) -> Converted:
    """The claim of a ResourceClaim or ResourceClaimTemplate object in v1 form, or
    ClaimSpecError with what `kubectl apply` would have printed."""
    kind = obj.get("kind")
    name = str((obj.get("metadata") or {}).get("name") or "")
    api_version = obj.get("apiVersion") or f"{GROUP}/v1"
    group, _, version = api_version.rpartition("/")
    if group != GROUP or version not in SERVED:
        raise ClaimSpecError(f'no matches for kind "{kind}" in version "{api_version}" '
                             f"(Kubernetes 1.37 serves {', '.join(f'{GROUP}/{v}' for v in SERVED)})")
    spec = copy.deepcopy(obj.get("spec") or {})
    prefix = "spec"
    if kind == "ResourceClaimTemplate":
        spec, prefix = copy.deepcopy((obj.get("spec") or {}).get("spec") or {}), "spec.spec"
    devices = spec.get("devices")
    requests = devices.get("requests") if isinstance(devices, dict) else None
    if isinstance(requests, list):
        unknown = _unknown_fields(requests, version, f"{prefix}.devices.requests")
        if unknown:
            hint = ""
            if version != "v1beta1" and any(f.rsplit(".", 1)[1] in EXACT_FIELDS for f in unknown):
                hint = (f" ({version} puts a request's deviceClassName, selectors, count and the like "
                        "under `exactly:`; beside the name is v1beta1's layout)")
            raise ClaimSpecError(f'{kind} in version "{version}" cannot be handled as a {kind}: '
                                 "strict decoding error: "
                                 + ", ".join(f'unknown field "{f}"' for f in unknown) + hint)
        devices["requests"] = [_to_v1(r, version) if isinstance(r, dict) else r for r in requests]
        errors = _validate(devices["requests"], f"{prefix}.devices.requests")
        if errors:
            listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            raise ClaimSpecError(f'{kind}.{GROUP} "{name}" is invalid: {listed}')
    return Converted(kind, name, version, spec)


def _unknown_fields(requests: list, version: str, path: str) -> list[str]:
    unknown = []
    for i, request in enumerate(requests):
        if not isinstance(request, dict):
            continue
        where = f"{path}[{i}]"
        unknown += [f"{where}.{k}" for k in request if k not in REQUEST_FIELDS[version]]
        if isinstance(request.get("exactly"), dict):
            unknown += [f"{where}.exactly.{k}" for k in request["exactly"] if k not in EXACT_FIELDS]
        for j, sub in enumerate(request.get("firstAvailable") or []):
            if isinstance(sub, dict):
                unknown += [f"{where}.firstAvailable[{j}].{k}" for k in sub if k not in SUBREQUEST_FIELDS]
    return unknown


def _to_v1(request: dict, version: str) -> dict:
    out = dict(request)
    if version == "v1beta1":
        # Any request-level field makes an `exactly`, valid or not (validation judges it).
        main = {k: out.pop(k) for k in list(out) if k in EXACT_FIELDS}
        if main:
            out["exactly"] = main
    if isinstance(out.get("exactly"), dict):
        out["exactly"] = _defaulted(out["exactly"])
    if isinstance(out.get("firstAvailable"), list):
        out["firstAvailable"] = [_defaulted(s) if isinstance(s, dict) else s for s in out["firstAvailable"]]
    return out


def _defaulted(exact: dict) -> dict:
    out = dict(exact)
    out.setdefault("allocationMode", "ExactCount")
    if out["allocationMode"] == "ExactCount" and not out.get("count"):
        out["count"] = 1
    return out


def _validate(requests: list, path: str) -> list[str]:
    errors: list[str] = []
    seen: set[str] = set()
    for i, request in enumerate(requests):
        where = f"{path}[{i}]"
        if not isinstance(request, dict):
            errors.append(f"{where}: Invalid value: {request!r}: must be an object")
            continue
        errors += _name(request.get("name"), f"{where}.name")
        if request.get("name") in seen:
            errors.append(f'{where}.name: Duplicate value: "{request["name"]}"')
        seen.add(request.get("name"))
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if exactly is None and not first:
            errors.append(f"{where}: Required value: exactly one of `exactly` or `firstAvailable` is required")
        elif exactly is not None and first:
            errors.append(f"{where}: Invalid value: null: exactly one of `exactly` or `firstAvailable` is "
                          "required, but multiple fields are set")
        elif first:
            sub_seen: set[str] = set()
            for j, sub in enumerate(first):
                sub_where = f"{where}.firstAvailable[{j}]"
                errors += _name(sub.get("name"), f"{sub_where}.name")
                if sub.get("name") in sub_seen:
                    errors.append(f'{sub_where}.name: Duplicate value: "{sub["name"]}"')
                sub_seen.add(sub.get("name"))
                errors += _exact(sub, sub_where)
        else:
            errors += _exact(exactly, f"{where}.exactly")
    return errors


def _name(name: object, where: str) -> list[str]:
    if not name:
        return [f"{where}: Required value"]
    if not isinstance(name, str) or not names.is_dns_label(name):
        return [f"{where}: Invalid value: {_quoted(name)}: {LABEL_MESSAGE}"]
    return []


def _exact(exact: dict, where: str) -> list[str]:
    errors = []
    cls = exact.get("deviceClassName")
    if not cls:
        errors.append(f"{where}.deviceClassName: Required value")
    elif not isinstance(cls, str) or not names.is_dns_subdomain(cls):
        errors.append(f"{where}.deviceClassName: Invalid value: {_quoted(cls)}: {SUBDOMAIN_MESSAGE}")
    mode, count = exact.get("allocationMode"), exact.get("count", 0)
    if mode == "All":
        if count:
            errors.append(f"{where}.count: Invalid value: {count}: must not be specified when "
                          "allocationMode is 'All'")
    elif mode == "ExactCount":
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            errors.append(f"{where}.count: Invalid value: {count!r}: must be greater than zero")
    else:
        errors.append(f"{where}.allocationMode: Unsupported value: {_quoted(mode)}: supported values: "
                      + ", ".join(f'"{m}"' for m in MODES))
    return errors + _selector_errors(exact.get("selectors"), f"{where}.selectors")


def _selector_errors(selectors: object, where: str) -> list[str]:
    """The server's compile errors of a list of CEL selectors (a claim's or a class's)."""
    errors = []
    for k, selector in enumerate(selectors if isinstance(selectors, list) else []):
        expression = (selector.get("cel") or {}).get("expression") if isinstance(selector, dict) else None
        if isinstance(expression, str):
            problem = compile_problem(expression)
            if problem:
                errors.append(f"{where}[{k}].cel.expression: Invalid value: {_quoted(expression)}: {problem}")
    return errors


def _quoted(value: object) -> str:
    """A value as Go's %q writes it in a field error (escaped quotes, no line breaks)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def compile_problem(expression: str) -> str | None:
    """What the API server's CEL compiler says of a selector that does not compile or does
    not return a bool (checked once, at apply, never per device); None when it compiles."""
    from driver.scheduling import cel

    try:
        cel.check_selector(expression)
    except cel.CelError as err:
        return err.message
    return None


def check_class(obj: dict) -> None:
    """A DeviceClass as the API server validates its selectors when it is written:
    ClaimSpecError with the server's message for one that does not compile."""
    name = str((obj.get("metadata") or {}).get("name") or "")
    errors = _selector_errors((obj.get("spec") or {}).get("selectors"), "spec.selectors")
    if errors:
        listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        raise ClaimSpecError(f'DeviceClass.{GROUP} "{name}" is invalid: {listed}')
