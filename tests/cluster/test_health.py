"""Device health against the real kubelet, API server and controller-manager: a NIC whose
link goes down in the mock shows as Unhealthy in the pod's status (KEP-4680,
`allocatedResourcesStatus`, fed by our DRAResourceHealth stream) and as a NoSchedule taint
on its slice, both undone when the link is back; and a NoExecute device taint (a
DeviceTaintRule, as an admin or a remediation tool would add) makes kube-controller-manager's
device-taint eviction evict the pod, after which the kubelet unprepares the claim."""

from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import release_minor
from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import (allocated, apply, claim, get, namespace, pod, slice_device, wait,
                                     wait_running)

IFNAME = "enp18s0f0"  # the mixed profile's first ConnectX-7


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


@pytest.fixture(scope="module")
def driver(cluster, chart, tmp_path_factory):
    import local_cluster

    drv = HostDriver(cluster, chart, tmp_path_factory.mktemp("drv"), local_cluster.NODE,
                     fresh_node=True,
                     extra_env={"MOCK_PROFILE": "mixed", "HEALTH_INTERVAL": "1"}).start()
    drv.wait_ready()
    yield drv
    assert drv.stop() == 0, drv.log()[-3000:]


def nic_claim() -> dict:
    return claim("nic", "nic.accel.dra.io", f'device.attributes["{DRIVER}"].ifName == "{IFNAME}"')


def health_of(pod_obj: dict | None) -> dict[str, str]:
    """resourceID -> health of the container's claim "dev" (allocatedResourcesStatus)."""
    out = {}
    for cs in ((pod_obj or {}).get("status") or {}).get("containerStatuses") or []:
        for rs in cs.get("allocatedResourcesStatus") or []:
            if rs.get("name") == "claim:dev":
                out.update({r["resourceID"]: r.get("health", "") for r in rs.get("resources") or []})
    return out


def taint_keys(cluster, device: str) -> dict[str, str]:
    return {t["key"]: t["effect"] for t in slice_device(cluster, device).get("taints") or []}


@pytest.mark.release(33, "device taints (DRADeviceTaints)")
def test_link_down_shows_in_the_pod_status_and_as_a_slice_taint(cluster, driver):
    # Device health in the pod's status for a claim the pod names (`resourceClaimName`, under
    # an entry of another name) from 1.36: the 1.34 kubelet matches the claim's own name
    # against the pod's entry names (kubernetes#134482), 1.35's finds a claim only through
    # the pod's status.resourceClaimStatuses, which lists claims made from templates alone;
    # 1.36 also resolves it from the pod's spec (seen in the matrix, read in each release's
    # pkg/kubelet/cm/dra/manager.go UpdateAllocatedResourcesStatus). The taint: from 1.33.
    in_pod_status = release_minor() >= 36
    operstate = cluster.kubelet_dir / "plugins" / DRIVER / "mock" / "sys" / "class" / "net" / IFNAME / "operstate"
    assert operstate.read_text().strip() == "up"
    ns = namespace(cluster, "health")
    try:
        apply(cluster, ns, nic_claim(), pod("holder", "nic"))
        wait_running(cluster, ns, "holder")
        (result,) = allocated(get(cluster, ns, "resourceclaim", "nic"))
        device = result["device"]
        if in_pod_status:
            health = wait("the device Healthy in the pod's status", lambda: (
                h := health_of(get(cluster, ns, "pod", "holder"))) and set(h.values()) == {"Healthy"} and h, 60)
            assert len(health) == 1 and device in next(iter(health)), health

        operstate.write_text("down\n")
        wait("the link-down taint on the slice",
             lambda: taint_keys(cluster, device).get(f"{DRIVER}/link-down") == "NoSchedule", 30)
        if in_pod_status:
            wait("the device Unhealthy in the pod's status",
                 lambda: set(health_of(get(cluster, ns, "pod", "holder")).values()) == {"Unhealthy"}, 60)

        operstate.write_text("up\n")
        wait("the taint gone", lambda: f"{DRIVER}/link-down" not in taint_keys(cluster, device), 30)
        if in_pod_status:
            wait("the device Healthy again",
                 lambda: set(health_of(get(cluster, ns, "pod", "holder")).values()) == {"Healthy"}, 60)
    finally:
        operstate.write_text("up\n")
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)


@pytest.mark.release(33, "device taints and DeviceTaintRule (DRADeviceTaints)")
def test_a_noexecute_device_taint_evicts_the_pod(cluster, driver):
    import local_cluster

    # DeviceTaintRule: v1alpha3 until 1.35, v1beta2 in 1.36 (v1alpha3 no longer enabled by
    # its runtime config: cluster.py RELEASE_RUNTIME_CONFIG), v1 from 1.37
    minor = local_cluster.minor(cluster.vers["KUBERNETES_VERSION"])
    version = "v1" if minor >= 37 else "v1beta2" if minor == 36 else "v1alpha3"
    ns = namespace(cluster, "evict")
    rule = f"evict-{ns}"
    try:
        apply(cluster, ns, nic_claim(), pod("holder", "nic"))
        wait_running(cluster, ns, "holder")
        c = get(cluster, ns, "resourceclaim", "nic")
        (result,) = allocated(c)
        uid = c["metadata"]["uid"]
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": f"resource.k8s.io/{version}", "kind": "DeviceTaintRule",
            "metadata": {"name": rule},
            "spec": {"deviceSelector": {"driver": DRIVER, "pool": result["pool"], "device": result["device"]},
                     "taint": {"key": "example.com/maintenance", "value": "nic", "effect": "NoExecute"}}}))

        # the controller-manager's device-taint eviction deletes the pod (DisruptionTarget
        # condition first), the kubelet stops it and unprepares the claim through our driver
        def evicted():
            p = get(cluster, ns, "pod", "holder")
            if p is None:
                return "deleted"
            conds = {c["type"]: c for c in p.get("status", {}).get("conditions") or []}
            target = conds.get("DisruptionTarget", {})
            return target.get("status") == "True" and target.get("reason")
        reason = wait("the pod evicted", evicted, 90)
        assert reason in ("deleted", "DeletionByDeviceTaintManager"), reason
        wait("the claim unprepared by the driver", lambda: any(
            '"claim_unprepared"' in line and uid in line for line in driver.log().splitlines()), 60)
        wait("the pod gone", lambda: get(cluster, ns, "pod", "holder") is None, 60)
    finally:
        cluster.kubectl("delete", "devicetaintrule", rule, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
