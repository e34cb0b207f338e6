"""CDI spec checks as the reference parser applies them: the JSON schema from
../shared/cdi-schema plus the rules the schema lacks (names, unknown fields, minimum
cdiVersion for the fields used, non-empty device edits)."""

from __future__ import annotations

import json
import re
from functools import lru_cache

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests.conftest import SHARED

VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
EDIT_FIELDS = {"env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices"}
NODE_FIELDS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}


@lru_cache(maxsize=1)
def validator() -> jsonschema.Draft7Validator:
    folder = SHARED / "cdi-schema"
    schema = json.loads((folder / "schema.json").read_text())
    defs = json.loads((folder / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def check_spec(spec: dict) -> None:
    validator().validate(spec)
    assert set(spec) <= {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}, spec.keys()
    vendor, _, cls = spec["kind"].partition("/")
    assert VENDOR_CLASS.match(vendor) and VENDOR_CLASS.match(cls), spec["kind"]
    assert spec["devices"], "at least one device"
    names = [d["name"] for d in spec["devices"]]
    assert len(set(names)) == len(names), "device names unique"
    needed = (0, 3, 0)
    for device in spec["devices"]:
        assert set(device) <= {"name", "annotations", "containerEdits"}
        assert DEVICE.match(device["name"]), device["name"]
        edits = device["containerEdits"]
        assert edits and set(edits) <= EDIT_FIELDS, edits
        if device["name"][0].isdigit():
            needed = max(needed, (0, 5, 0))
        for node in edits.get("deviceNodes", []):
            assert set(node) <= NODE_FIELDS and set(node.get("permissions", "")) <= set("rwm")
            if "hostPath" in node:
                needed = max(needed, (0, 5, 0))
        if "netDevices" in edits:
            needed = max(needed, (1, 1, 0))
    if "." in cls:
        needed = max(needed, (0, 6, 0))
    assert _version(spec["cdiVersion"]) == needed, f"cdiVersion {spec['cdiVersion']}, minimum {needed}"
