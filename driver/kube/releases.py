"""What each Kubernetes release offers of the DRA features this driver uses: the release a
feature appears in, its feature gate, and the release from which that gate is on by default.

One table, so that the start-up line (`cluster_support`), `dra-driver status` and `explain`
say the same thing about a cluster. Facts from the upstream KEPs and the v1.37 feature-gate
page (summarised with sources in the project's dra-features notes); the local cluster's
per-release gates (hack/local-cluster/cluster.py RELEASE_GATES) follow the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

Release = tuple[int, int]  # (major, minor), as /version gives it


def text(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


def parse(version: object) -> Release | None:
    """A component's version as Kubernetes reports it ("v1.32.13", "v1.33.0-rc.1+k3s1") as a
    release; None when it is not one."""
    found = re.match(r"v?(\d+)\.(\d+)", str(version or ""))
    return (int(found.group(1)), int(found.group(2))) if found else None


@dataclass(frozen=True)
class Feature:
    name: str  # in the user's words
    option: str  # what asks for it ("" when the driver always uses it)
    needs: Release  # the first release the driver can use it on
    gate: str | None  # its feature gate; None: none (on wherever it exists)
    default_on: Release | None  # the first release its gate is on by default
    instead: str  # what the driver does (or what happens) where the release lacks it
    component: str = "Kubernetes"  # "kubelet": a node-side feature
    runtime_config: str = ""  # the API to enable with the gate (DRA itself before 1.34)
    # The resource.k8s.io versions whose ResourceSlices carry it (empty: any).
    apis: tuple[str, ...] = ()

    def judged_by(self, release: Release, kubelet: Release | None) -> Release:
        """A node-side feature is the kubelet's to offer: its own release where it is known
        (kubelets may be up to three minors older than the control plane)."""
        return kubelet if self.component == "kubelet" and kubelet is not None else release

    def available(self, release: Release, resource_api: str | None = None) -> bool:
        return release >= self.needs and (not self.apis or resource_api is None or resource_api in self.apis)

    def off_by_default(self, release: Release, resource_api: str | None = None) -> bool:
        return (self.available(release, resource_api) and self.gate is not None
                and (self.default_on is None or release < self.default_on))

    def _aside(self, *more: str) -> str:
        return "(" + ", ".join(([self.option] if self.option else []) + list(more)) + ")"

    def missing(self, release: Release, resource_api: str | None = None) -> str:
        """That it is not there, and what the driver does instead."""
        if release < self.needs:
            needs = text(self.needs) if self.component == "Kubernetes" else f"{self.component} {text(self.needs)}"
        else:
            needs = f"resource.k8s.io {' or '.join(self.apis)}"
        return f"{self.name} {self._aside(f'needs {needs}: {self.instead}')}"

    def gated(self) -> str:
        """Its gate, off by default on the release asked about."""
        more = [f"with --runtime-config={self.runtime_config}"] if self.runtime_config else []
        if self.default_on:
            more.append(f"on by default from {text(self.default_on)}")
        return f"{self.gate} for {self.name} {self._aside(*more)}"


DRA = Feature("Dynamic Resource Allocation", "", (1, 32), "DynamicResourceAllocation", (1, 34),
              "the driver cannot run", runtime_config="resource.k8s.io/v1beta1=true")
# KEP-5075: alpha 1.34 (off), beta 1.36 (on).
CONSUMABLE_CAPACITY = Feature(
    "consumable GPU shares", "--gpu-sharing=consumable", (1, 34), "DRAConsumableCapacity", (1, 36),
    "the driver publishes whole GPUs, one claim each")
# KEP-4815 is alpha from 1.33, but its 1.33 API is not the one the driver writes: the
# driver's shared counters need 1.34 (beside the devices; in slices of their own from 1.35).
DYNAMIC_MIG = Feature(
    "dynamic MIG", "--mig-mode=dynamic", (1, 34), "DRAPartitionableDevices", (1, 36),
    "the driver publishes the MIG devices that exist, as static MIG")
# KEP-5055: alpha 1.33, beta 1.36 (on); v1beta1 slices have no taints field.
DEVICE_TAINTS = Feature(
    "taints on unhealthy devices", "", (1, 33), "DRADeviceTaints", (1, 36),
    "unhealthy devices are published without taints and can still be allocated",
    apis=("v1", "v1beta2"))
# KEP-4817: in 1.32 behind its gate, which 1.33 turns on.
CLAIM_STATUS = Feature(
    "claim device status", "--claim-status", (1, 32), "DRAResourceClaimDeviceStatus", (1, 33),
    "claims' status.devices stay empty")
# KEP-5004: alpha 1.34, beta 1.36, GA 1.37 (on by default from 1.36).
EXTENDED_RESOURCES = Feature(
    "extended resource names", "--extended-resource-names", (1, 34), "DRAExtendedResource", (1, 36),
    "pods asking for these names are not given this driver's devices")
# The implicit name `deviceclass.resource.kubernetes.io/<class>` of every class: the
# scheduler and kubelet of 1.34 take it for a native resource (their IsExtendedResourceName
# rejects "*kubernetes.io/" names), so a pod asking for it is scheduled without a claim and
# runs without a device; both accept it from 1.35 (kubernetes#133363, IsDRAExtendedResourceName).
IMPLICIT_EXTENDED_NAMES = Feature(
    "implicit extended resource names (deviceclass.resource.kubernetes.io/<class>)", "", (1, 35),
    EXTENDED_RESOURCES.gate, EXTENDED_RESOURCES.default_on,
    "a pod asking for one is scheduled without a claim and runs without the device")
# KEP-4680: the kubelet asks DRA drivers for health from 1.34; beta 1.36 (on).
POD_HEALTH = Feature(
    "device health in pod status", "", (1, 34), "ResourceHealthStatus", (1, 36),
    "pods' status does not show their devices' health", component="kubelet")
# The kubelet keeps two instances of a plugin apart from 1.33 (no gate).
SEAMLESS_UPGRADE = Feature(
    "seamless upgrades with per-pod sockets", "--pod-uid", (1, 33), None, None,
    "the kubelet can lose the driver when an old pod ends: set the chart's "
    "kubelet.seamlessUpgrade=false (one instance at a time, maxSurge 0)", component="kubelet")


@dataclass(frozen=True)
class Support:
    """What one cluster offers of the features one configuration uses."""

    kubernetes: Release
    resource_api: str | None
    missing: tuple[str, ...]  # unavailable there, each with what the driver does instead
    gated: tuple[str, ...]  # there, but behind a gate that is off by default there
    kubelet: Release | None = None  # this node's kubelet, where it is known

    def line(self) -> str | None:
        """One line for people; None when everything used is on by default."""
        if not (self.missing or self.gated):
            return None
        api = f" (resource.k8s.io {self.resource_api})" if self.resource_api else ""
        kubelet = (f" with a {text(self.kubelet)} kubelet"
                   if self.kubelet is not None and self.kubelet != self.kubernetes else "")
        parts = [f"lacks {', '.join(self.missing)}"] if self.missing else []
        if self.gated:
            parts.append(f"gates off by default there: {', '.join(self.gated)}")
        return f"Kubernetes {text(self.kubernetes)}{api}{kubelet} " + "; ".join(parts)

    def fields(self) -> dict:
        """For the structured log line and the state file."""
        return {"kubernetes": text(self.kubernetes), "resource_api": self.resource_api,
                "kubelet": text(self.kubelet) if self.kubelet is not None else None,
                "unavailable": list(self.missing), "gate_off_by_default": list(self.gated),
                "line": self.line()}


def support(release: Release, resource_api: str | None, used: Iterable[Feature],
            kubelet: Release | None = None) -> Support:
    used = tuple((f, f.judged_by(release, kubelet)) for f in used)
    return Support(release, resource_api,
                   tuple(f.missing(at, resource_api) for f, at in used if not f.available(at, resource_api)),
                   tuple(f.gated() for f, at in used if f.off_by_default(at, resource_api)),
                   kubelet)


# The namespace label a claim with adminAccess needs (KEP-5018), checked by the API server
# when the claim is made: none in 1.32, `resource.k8s.io/admin-access` in 1.33, renamed
# from 1.34 (each release's pkg/apis/resource DRAAdminNamespaceLabelKey; the matrix met the
# 1.33 name as a 422 on claim creation).
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


def admin_access_label(release: Release | None) -> str | None:
    """The label's key on `release` (None: the release is unknown, the current key); None
    where no label is needed."""
    if release is None or release >= (1, 34):
        return ADMIN_ACCESS_LABEL
    return "resource.k8s.io/admin-access" if release >= (1, 33) else None


def dra_requirement() -> str:
    """What a cluster must have for DRA at all (explain's message for one without it)."""
    return (f"Dynamic Resource Allocation needs Kubernetes {text(DRA.needs)} or newer, with gate "
            f"{DRA.gate} and --runtime-config={DRA.runtime_config} before {text(DRA.default_on)}")
