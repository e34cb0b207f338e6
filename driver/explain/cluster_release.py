"""The one line explain adds under a claim's verdict when the claim asks for something the
cluster's Kubernetes release cannot do (the release table: driver/kube/releases.py). Only
where the cluster was read: files and mock nodes have no release."""

from __future__ import annotations

from driver.explain import engine
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
