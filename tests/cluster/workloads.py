"""Pods and claims for the cluster tier's own cases (not the examples): a long-running pod
holding a ResourceClaim, and ways to wait on what the real components do with it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

import yaml

from tests.cluster.driverhost import DRIVER

# The releases an example needs, where it is newer than 1.32 (what it asks of the API
# server does not exist before): the matrix reports it not applicable on older ones.
EXAMPLE_RELEASES: dict[str, tuple[int, str]] = {
    "gpu-consumable": (34, "consumable capacity (capacity requests, DRAConsumableCapacity)"),
    "mig-dynamic": (34, "the driver's shared counters for dynamic MIG (DRAPartitionableDevices)"),
    "prioritized-gpu": (33, "prioritized lists (firstAvailable, DRAPrioritizedList)"),
}


def example_param(name: str):
    """A pytest parameter for an example, marked with the release it needs."""
    import pytest

    if name in EXAMPLE_RELEASES:
        return pytest.param(name, marks=pytest.mark.release(*EXAMPLE_RELEASES[name]))
    return name


# hack/local-cluster imports this busybox image (no registry); a tag other than `latest`,
# so that the kubelet's default pull policy is IfNotPresent and it never tries a registry
BUSYBOX = "docker.io/library/busybox:1.36"


def namespace(cluster, prefix: str) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"[:63]
    cluster.kubectl("create", "namespace", ns)
    return ns


def claim(name: str, device_class: str, selector: str | None = None) -> dict:
    exactly: dict = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}}}


def pod(name: str, claim_name: str | None = None, template: str | None = None,
        command: str = "sleep 3600") -> dict:
    """A pod whose one container holds the claim (by name, or made from a template)."""
    ref = {"name": "dev"}
    if template:
        ref["resourceClaimTemplateName"] = template
    else:
        ref["resourceClaimName"] = claim_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [ref],
                     "containers": [{"name": "app", "image": BUSYBOX,
                                     "command": ["sh", "-c", command],
                                     "resources": {"claims": [{"name": "dev"}]}}]}}


def apply(cluster, ns: str, *objects: dict) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(objects))


def get(cluster, ns: str, kind: str, name: str) -> dict | None:
    p = cluster.kubectl("get", kind, "-n", ns, name, "-o", "json", "--show-managed-fields", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else None


def wait(what: str, probe: Callable[[], object], timeout: float, interval: float = 0.5,
         explain: Callable[[], str] = lambda: "") -> object:
    """probe()'s first truthy answer; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what}: not after {timeout:.0f}s (last: {last!r}) {explain()}")


def events(cluster, ns: str) -> str:
    return cluster.kubectl("get", "events", "-n", ns, "-o", "wide", check=False).stdout


def wait_running(cluster, ns: str, name: str, timeout: float = 120) -> dict:
    return wait(f"pod {ns}/{name} Running",
                lambda: (p := get(cluster, ns, "pod", name)) and
                p.get("status", {}).get("phase") == "Running" and p,
                timeout, explain=lambda: f"\nevents:\n{events(cluster, ns)}")


def our_entries(claim_obj: dict | None) -> list[dict]:
    """The claim's status.devices entries of our driver."""
    if not claim_obj:
        return []
    return [d for d in (claim_obj.get("status") or {}).get("devices") or []
            if d.get("driver") == DRIVER]


def conditions(entry: dict) -> dict[str, dict]:
    return {c["type"]: c for c in entry.get("conditions") or []}


def allocated(claim_obj: dict) -> list[dict]:
    """The allocation's results of our driver."""
    results = (((claim_obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return [r for r in results if r.get("driver") == DRIVER]


def generated_claim(cluster, ns: str, pod_name: str) -> str:
    """The name of the claim the resourceclaim controller made for the pod's "dev" claim."""
    def name():
        p = get(cluster, ns, "pod", pod_name) or {}
        for st in p.get("status", {}).get("resourceClaimStatuses") or []:
            if st.get("name") == "dev" and st.get("resourceClaimName"):
                return st["resourceClaimName"]
        return None
    return wait(f"the claim made for pod {ns}/{pod_name}", name, 60)


def slice_device(cluster, device: str) -> dict:
    """The device as our driver's slices on the node publish it."""
    out = json.loads(cluster.kubectl("get", "resourceslices", "-o", "json").stdout)
    for s in out["items"]:
        if s["spec"].get("driver") != DRIVER:
            continue
        for d in s["spec"].get("devices") or []:
            if d["name"] == device:
                return d
    raise AssertionError(f"device {device} in none of {DRIVER}'s slices")
