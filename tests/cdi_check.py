"""CDI spec checks as the reference parser applies them, written from the CDI specification
(SPEC.md of the container-device-interface project): field names and types, name rules,
non-empty device edits, and the minimum cdiVersion for the fields used.

The upstream JSON schema is an extra check where `../shared/cdi-schema/` exists
(`schema_errors`); these rules are what every test uses, so the suite needs nothing outside
the repository.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from tests.conftest import SHARED

SCHEMA_DIR = SHARED / "cdi-schema"
VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
SEMVER = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
KNOWN_VERSIONS = {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"}

STR, INT, STRS, INTS = "string", "integer", "list of strings", "list of integers"
# Per object: field -> type. Anything else is an unknown field, which the parser rejects.
EDITS = {"env": STRS, "deviceNodes": "deviceNodes", "mounts": "mounts", "hooks": "hooks",
         "additionalGids": INTS, "intelRdt": "object", "netDevices": "netDevices"}
NODE = {"path": STR, "hostPath": STR, "type": STR, "major": INT, "minor": INT, "fileMode": INT,
        "permissions": STR, "uid": INT, "gid": INT}
MOUNT = {"hostPath": STR, "containerPath": STR, "type": STR, "options": STRS}
HOOK = {"hookName": STR, "path": STR, "args": STRS, "env": STRS, "timeout": INT}
NET = {"hostInterfaceName": STR, "name": STR}
HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}


def _typed(value: Any, kind: str) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == STRS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == INTS:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _fields(obj: Any, allowed: dict[str, str], where: str, required: tuple[str, ...] = ()) -> None:
    assert isinstance(obj, dict), f"{where}: must be an object"
    unknown = set(obj) - set(allowed)
    assert not unknown, f"{where}: unknown field(s) {sorted(unknown)}"
    for name in required:
        assert name in obj, f"{where}: {name} is required"
    for name, value in obj.items():
        assert _typed(value, allowed[name]), f"{where}.{name}: must be a {allowed[name]}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def check_edits(edits: Any, where: str) -> tuple[int, int, int]:
    """Checks one containerEdits object; returns the minimum cdiVersion its fields need."""
    _fields(edits, EDITS, where)
    needed = (0, 3, 0)
    for i, env in enumerate(edits.get("env", [])):
        assert "=" in env and not env.startswith("="), f"{where}.env[{i}]: {env!r} is not KEY=VALUE"
    for i, node in enumerate(edits.get("deviceNodes", [])):
        at = f"{where}.deviceNodes[{i}]"
        _fields(node, NODE, at, required=("path",))
        assert node["path"].startswith("/"), f"{at}.path must be absolute"
        assert node.get("type", "c") in ("b", "c", "u", "p"), f"{at}.type"
        assert set(node.get("permissions", "")) <= set("rwm"), f"{at}.permissions"
        if "hostPath" in node:
            needed = max(needed, (0, 5, 0))
    for i, mount in enumerate(edits.get("mounts", [])):
        at = f"{where}.mounts[{i}]"
        _fields(mount, MOUNT, at, required=("hostPath", "containerPath"))
        if "type" in mount:
            needed = max(needed, (0, 4, 0))
    for i, hook in enumerate(edits.get("hooks", [])):
        at = f"{where}.hooks[{i}]"
        _fields(hook, HOOK, at, required=("hookName", "path"))
        assert hook["hookName"] in HOOK_NAMES, f"{at}.hookName"
    for i, net in enumerate(edits.get("netDevices", [])):
        _fields(net, NET, f"{where}.netDevices[{i}]", required=("hostInterfaceName", "name"))
    if "netDevices" in edits:
        needed = max(needed, (1, 1, 0))
    if "intelRdt" in edits or "additionalGids" in edits:
        needed = max(needed, (0, 7, 0))
    return needed


def check_spec(spec: dict) -> None:
    _fields(spec, {"cdiVersion": STR, "kind": STR, "annotations": "object", "devices": "devices",
                   "containerEdits": "object"}, "spec", required=("cdiVersion", "kind", "devices"))
    assert SEMVER.match(spec["cdiVersion"]) and spec["cdiVersion"] in KNOWN_VERSIONS, spec["cdiVersion"]
    vendor, _, cls = spec["kind"].partition("/")
    assert VENDOR_CLASS.match(vendor) and VENDOR_CLASS.match(cls), spec["kind"]
    assert spec["devices"], "at least one device"
    names = [d.get("name") for d in spec["devices"]]
    assert len(set(names)) == len(names), "device names unique"
    needed = (0, 3, 0)
    if "annotations" in spec:
        needed = max(needed, (0, 6, 0))
    if "containerEdits" in spec:
        needed = max(needed, check_edits(spec["containerEdits"], "spec.containerEdits"))
    for i, device in enumerate(spec["devices"]):
        where = f"spec.devices[{i}]"
        _fields(device, {"name": STR, "annotations": "object", "containerEdits": "object"}, where,
                required=("name", "containerEdits"))
        assert DEVICE.match(device["name"]), f"{where}.name {device['name']!r}"
        assert device["containerEdits"], f"{where}: containerEdits must not be empty"
        needed = max(needed, check_edits(device["containerEdits"], f"{where}.containerEdits"))
        if device["name"][0].isdigit():
            needed = max(needed, (0, 5, 0))
        if "annotations" in device:
            needed = max(needed, (0, 6, 0))
    if "." in cls:
        needed = max(needed, (0, 6, 0))
    assert _version(spec["cdiVersion"]) == needed, f"cdiVersion {spec['cdiVersion']}, minimum {needed}"


@lru_cache(maxsize=1)
def _validator():
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def schema_errors(spec: dict) -> list[str]:
    """Messages from the upstream JSON schema; only call where SCHEMA_DIR exists."""
    return [e.message for e in _validator().iter_errors(spec)]
