"""The API server's part for events.k8s.io/v1 Events, as strict as the real one
(k8s.io/kubernetes pkg/apis/core/validation/events.go, ValidateEventCreate for v1):
eventTime, reportingController (a qualified name), reportingInstance, action and reason
are required, the last three at most 128 characters; note at most 1024 bytes; type Normal
or Warning; `regarding` of a namespaced object in the event's namespace; the name a DNS
subdomain; the namespace that of the URL."""

from __future__ import annotations

import re
from typing import Any

LIMIT = 128
NOTE_LIMIT = 1024
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")


def errors(event: Any, namespace: str) -> list[str]:
    if not isinstance(event, dict):
        return ["the body is not an object"]
    found = []
    meta = event.get("metadata") or {}
    name = meta.get("name") or ""
    if not name or len(name) > 253 or not _SUBDOMAIN.match(name):
        found.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
    if meta.get("namespace") not in (None, namespace):
        found.append("metadata.namespace: Invalid value: does not match the namespace of the URL")
    if not isinstance(event.get("eventTime"), str) or not _MICRO_TIME.match(event["eventTime"]):
        found.append("eventTime: Required value")
    controller = event.get("reportingController") or ""
    if not controller:
        found.append("reportingController: Required value")
    elif not _QUALIFIED.match(controller) or len(controller) > 316:
        found.append(f"reportingController: Invalid value: {controller!r}: not a qualified name")
    for field in ("reportingInstance", "action", "reason"):
        value = event.get(field) or ""
        if not value:
            found.append(f"{field}: Required value")
        elif len(value) > LIMIT:
            found.append(f"{field}: Too long: may not be longer than {LIMIT}")
    if len(str(event.get("note") or "").encode()) > NOTE_LIMIT:
        found.append(f"note: Too long: may not be longer than {NOTE_LIMIT}")
    if event.get("type") not in ("Normal", "Warning"):
        found.append(f"type: Unsupported value: {event.get('type')!r}: supported values: "
                     "\"Normal\", \"Warning\"")
    regarding = event.get("regarding") or {}
    if regarding.get("namespace") not in (None, "", namespace):
        found.append("regarding.namespace: Invalid value: does not match event.namespace")
    return found
