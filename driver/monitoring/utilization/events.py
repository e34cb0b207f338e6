"""Kubernetes Events on a ResourceClaim (events.k8s.io/v1), where `kubectl describe
resourceclaim` and `kubectl events --for resourceclaim/NAME` show them.

The API server validates an events.k8s.io/v1 Event strictly (k8s.io/kubernetes
pkg/apis/core/validation ValidateEventCreate): eventTime, reportingController,
reportingInstance, action and reason are required, each of the last four at most 128
characters; the note at most 1 KiB; type Normal or Warning; `regarding` in the event's
namespace. RBAC: `create` on `events` in `events.k8s.io`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from driver.kube.client import Kube

GROUP = "events.k8s.io"
CLAIM_API = "resource.k8s.io"
FIELD_MAX = 128
NOTE_MAX = 1024


@dataclass(frozen=True)
class ClaimEvent:
    namespace: str
    claim_name: str
    claim_uid: str
    reason: str  # UpperCamelCase: DeviceIdle
    action: str  # what the driver did or saw: Idle
    note: str
    type: str = "Normal"


def micro_time(when: float) -> str:
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(event: ClaimEvent, claim_version: str, driver: str, node: str,
               when: float) -> dict:
    # Named like the kubelet's and kubectl's events: <object>.<hex nanoseconds>.
    suffix = f".{time.time_ns():x}"
    name = event.claim_name[:253 - len(suffix)] + suffix
    note = event.note.encode()[:NOTE_MAX].decode(errors="ignore")
    return {
        "apiVersion": f"{GROUP}/v1", "kind": "Event",
        "metadata": {"name": name, "namespace": event.namespace},
        "eventTime": micro_time(when),
        "reportingController": driver[:FIELD_MAX],
        "reportingInstance": f"{driver}/{node}"[:FIELD_MAX],
        "action": event.action, "reason": event.reason, "note": note, "type": event.type,
        "regarding": {"apiVersion": f"{CLAIM_API}/{claim_version}", "kind": "ResourceClaim",
                      "namespace": event.namespace, "name": event.claim_name,
                      "uid": event.claim_uid},
    }


@dataclass
class EventRecorder:
    kube: Kube
    driver: str
    node: str

    def post(self, event: ClaimEvent, when: float | None = None) -> None:
        """Raises ApiError; the caller decides what a failed event costs."""
        body = event_body(event, self.kube.resource_version(), self.driver, self.node,
                          time.time() if when is None else when)
        self.kube.request("POST", f"/apis/{GROUP}/v1/namespaces/{event.namespace}/events",
                          body=body)
