"""The one line explain adds under a claim's verdict when the claim (or a pod's extended
resources) asks for something the cluster's Kubernetes release cannot do (the release
table: driver/kube/releases.py). Only where the cluster was read: files and mock nodes have
no release."""

from __future__ import annotations

from driver.explain import engine, extended
from driver.kube import releases


def claim_line(ref: str, spec: dict, release: releases.Release | None) -> str | None:
    if release is None:
        return None
    try:
        requests = engine.requests(ref, spec)
    except engine.ClaimError:
        return None  # explain said so already
    feature = releases.CONSUMABLE_CAPACITY
    for _, alternatives in requests:
        for alt in alternatives:
            if alt.capacity and not feature.available(release):
                return (f"Kubernetes {releases.text(release)} cannot allocate it: request {alt.request} asks "
                        f"for capacity ({feature.name}), which needs Kubernetes {releases.text(feature.needs)}")
    return None


def pod_line(pod: extended.PodResources, mapping: dict[str, str],
             release: releases.Release | None) -> str | None:
    """For a pod's extended resources that DeviceClasses serve (`mapping`: name -> class)."""
    served = sorted(name for name in pod.names() if name in mapping)
    if release is None or not served:
        return None
    names, version = ", ".join(served), releases.text(release)
    feature = releases.EXTENDED_RESOURCES
    if not feature.available(release):
        return (f"Kubernetes {version} cannot serve {names} from a DeviceClass: {feature.name} need "
                f"Kubernetes {releases.text(feature.needs)}; the pod stays Pending there")
    feature = releases.IMPLICIT_EXTENDED_NAMES
    implicit = [name for name in served if name.startswith(extended.IMPLICIT_PREFIX)]
    if implicit and not feature.available(release):
        return (f"Kubernetes {version} takes {', '.join(implicit)} for a native resource: {feature.instead} "
                f"(implicit names need Kubernetes {releases.text(feature.needs)}; name the class's "
                "spec.extendedResourceName instead, or ask with a ResourceClaim)")
    return None
