"""What explain finds, as data: a verdict per device (fits, or the first reason it is out),
per alternative of a request, per node, and the whole explanation. The engine computes
them, `suggest` reads them for fixes, `render` prints them."""

from __future__ import annotations

from dataclasses import dataclass, field

FITS = "fits"
# Reason codes, in the order they are checked.
CLASS, SELECTOR, CEL_ERROR, ADMIN, TAINT, ALLOCATED, CAPACITY_ERROR, CAPACITY, COUNTERS = (
    "class", "selector", "cel-error", "admin-access", "taint", "allocated", "capacity-error", "capacity",
    "counters")


class ClaimError(ValueError):
    """A claim that is not a valid claim spec; the message names the claim and field."""


@dataclass(frozen=True)
class Alternative:
    request: str  # "gpu", or "gpu/h100" for a firstAvailable subrequest
    device_class: str
    selectors: tuple[str, ...]
    count: int | None  # None: allocationMode All
    tolerations: tuple[dict, ...] = ()
    capacity: dict = field(default_factory=dict)
    admin: bool = False


@dataclass
class DeviceVerdict:
    device: str
    driver: str
    pool: str
    code: str
    reason: str
    seen: dict[str, str] = field(default_factory=dict)  # what the failing selector read
    expression: str | None = None


@dataclass
class AlternativeReport:
    request: str
    device_class: str
    selectors: list[dict]  # {"from": "class X" | "request", "index": i, "expression": e}
    count: int | None
    devices: list[DeviceVerdict]

    @property
    def fitting(self) -> list[str]:
        return [d.device for d in self.devices if d.code == FITS]


@dataclass
class NodeReport:
    node: str
    fits: bool
    why: str
    allocation: list[dict] = field(default_factory=list)
    alternatives: list[AlternativeReport] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    # Whether the claim would fit with no claim allocated on the node: false where no
    # removal of other claims' allocations can help (a request larger than any device).
    fits_when_free: bool | None = None


@dataclass
class Explanation:
    claim: str  # namespace/name
    source: str
    nodes: list[NodeReport]
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a pod's extended resources: the claim the scheduler makes for them, {"requests": [...],
    # "mappings": [...]} as in the claim's spec and the pod's extendedResourceClaimStatus
    scheduled: dict | None = None
    # what the cluster's Kubernetes release cannot do of the claim (driver/explain/cluster_release.py)
    release: str | None = None

    @property
    def fits(self) -> bool:
        return any(n.fits for n in self.nodes)
