"""ResourceClaim `status.devices` (KEP-4817) against the real API server: written by the
driver with server-side apply under the chart's RBAC, the Idle condition and the DeviceIdle
Event when the mock GPU sits idle (and the condition gone when it is busy again), and the
`resourceclaims/driver` `associated-node:patch` grant proved needed by taking it away."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from driver.devices.mock.gpuload import GpuLoadStore
from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import (allocated, apply, claim, conditions, get, namespace, our_entries,
                                     pod, slice_device, wait, wait_running)

IDLE_AFTER = 3  # seconds; the driver samples every second


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


@pytest.fixture(scope="module")
def driver(cluster, chart, tmp_path_factory):
    import local_cluster

    drv = HostDriver(cluster, chart, tmp_path_factory.mktemp("drv"), local_cluster.NODE,
                     fresh_node=True,
                     extra_env={"MOCK_PROFILE": "mixed", "UTILIZATION_INTERVAL": "1",
                                "IDLE_AFTER": str(IDLE_AFTER)}).start()
    drv.wait_ready()
    yield drv
    assert drv.stop() == 0, drv.log()[-3000:]


def mock_root(cluster):
    return cluster.kubelet_dir / "plugins" / DRIVER / "mock"


def gpu_uuid(cluster, device: str) -> str:
    attrs = slice_device(cluster, device).get("attributes") or {}
    for key in ("uuid", f"{DRIVER}/uuid"):
        if key in attrs:
            return attrs[key]["string"]
    raise AssertionError(f"{device} has no uuid attribute: {attrs}")


def status_patches(cluster, ns: str, name: str) -> list[int]:
    """The answers to the driver's resourceclaims/status patches of this claim (audit log)."""
    return [ev.get("responseStatus", {}).get("code", 0) for ev in cluster.audit()
            if ev["verb"] == "patch" and ev["objectRef"].get("resource") == "resourceclaims"
            and ev["objectRef"].get("subresource") == "status"
            and ev["objectRef"].get("namespace") == ns and ev["objectRef"].get("name") == name]


def claim_events(cluster, ns: str, name: str) -> list[dict]:
    out = json.loads(cluster.kubectl("get", "events.v1.events.k8s.io", "-n", ns, "-o", "json").stdout)
    return [e for e in out["items"] if (e.get("regarding") or {}).get("kind") == "ResourceClaim"
            and e["regarding"].get("name") == name]


def test_status_devices_idle_condition_and_event(cluster, driver):
    ns = namespace(cluster, "status")
    try:
        apply(cluster, ns, claim("gpu", "gpu.accel.dra.io"), pod("holder", "gpu"))
        wait_running(cluster, ns, "holder")

        # status.devices: one entry per allocated device, Ready, written by server-side apply
        # with the driver's name as field manager on the status subresource
        wait("our status.devices entry", lambda: our_entries(get(cluster, ns, "resourceclaim", "gpu")), 30)
        full = get(cluster, ns, "resourceclaim", "gpu")
        (result,) = allocated(full)
        (entry,) = our_entries(full)
        assert (entry["pool"], entry["device"]) == (result["pool"], result["device"]), (entry, result)
        ready = conditions(entry)["Ready"]
        assert (ready["status"], ready["reason"]) == ("True", "Prepared"), entry
        managers = {(m["manager"], m["operation"], m.get("subresource"))
                    for m in full["metadata"]["managedFields"]}
        assert (DRIVER, "Apply", "status") in managers, managers
        assert 200 in status_patches(cluster, ns, "gpu"), status_patches(cluster, ns, "gpu")

        # the mock GPU runs nothing: after IDLE_AFTER the entry gets Idle and the claim an Event
        def idle():
            (e,) = our_entries(get(cluster, ns, "resourceclaim", "gpu")) or [None]
            return e and "Idle" in conditions(e) and e
        entry = wait("the Idle condition", idle, IDLE_AFTER + 30)
        cond = conditions(entry)["Idle"]
        assert (cond["status"], cond["reason"]) == ("True", "DeviceIdle"), cond
        assert conditions(entry)["Ready"]["lastTransitionTime"] == ready["lastTransitionTime"]
        ev = wait("a DeviceIdle Event on the claim", lambda: [
            e for e in claim_events(cluster, ns, "gpu") if e.get("reason") == "DeviceIdle"], 20)
        assert ev[0]["reportingController"] == DRIVER and ev[0]["type"] == "Normal", ev[0]
        assert ev[0]["regarding"]["uid"] == full["metadata"]["uid"], ev[0]

        # busy again: the condition goes, Ready stays as it was
        GpuLoadStore(mock_root(cluster)).set(gpu_uuid(cluster, result["device"]), sm_percent=90)
        entry = wait("the Idle condition removed", lambda: (
            (e := our_entries(get(cluster, ns, "resourceclaim", "gpu"))) and "Idle" not in conditions(e[0])
            and e[0]), 30)
        assert conditions(entry)["Ready"] == ready, entry
        assert len([e for e in claim_events(cluster, ns, "gpu") if e.get("reason") == "DeviceIdle"]) == 1

        # the pod goes: the kubelet unprepares and the driver's entries leave the claim
        cluster.kubectl("delete", "pod", "-n", ns, "holder", "--wait=true", "--timeout=60s")
        wait("our status.devices entries removed",
             lambda: get(cluster, ns, "resourceclaim", "gpu") is not None
             and not our_entries(get(cluster, ns, "resourceclaim", "gpu")), 60)
        assert '"claim_status_write_failed"' not in driver.log(), driver.log()[-3000:]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)


@pytest.mark.release(36, "the resourceclaims/driver grant for status writes (DRAResourceClaimGranularStatusAuthorization)")
def test_status_write_needs_the_associated_node_grant(cluster, chart, driver):
    """From 1.36 (DRAResourceClaimGranularStatusAuthorization) a write of status.devices
    also needs `associated-node:patch` on `resourceclaims/driver` for the driver's name
    (the API server's own authorization check, no request of its own in the audit log):
    without it the apply is refused, the driver retries, and it lands once the grant is
    back. The driver's token is bound to the node the claim is allocated on, so the API
    server asks for associated-node:patch first (arbitrary-node:patch is never granted)."""
    (role,) = [o for o in chart if o["kind"] == "ClusterRole"]
    rules = [r for r in role["rules"] if "resourceclaims/driver" not in r["resources"]]
    assert len(rules) == len(role["rules"]) - 1, role["rules"]
    (grant,) = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    assert grant["verbs"] == ["associated-node:patch"] and grant["resourceNames"] == [DRIVER], grant
    stripped = copy.deepcopy(role)
    stripped["rules"] = rules
    ns = namespace(cluster, "grant")
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(stripped))
        apply(cluster, ns, claim("gpu", "gpu.accel.dra.io"), pod("holder", "gpu"))
        wait_running(cluster, ns, "holder")
        line = wait("the driver's refused status write", lambda: [
            json.loads(x) for x in driver.log().splitlines()
            if '"claim_status_write_failed"' in x and f'"{ns}"' in x], 30)[0]
        # not a 403: the API server's strategy refuses the field (422 Invalid, Forbidden)
        assert "HTTP 422" in line["error"], line
        assert ('status.devices: Forbidden: changing status.devices requires '
                'resource="resourceclaims/driver", verb="[associated-node:patch arbitrary-node:patch]"'
                in line["error"]), line
        assert not our_entries(get(cluster, ns, "resourceclaim", "gpu"))
        assert 422 in status_patches(cluster, ns, "gpu")
    finally:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(role))
    try:
        # the driver's retry (backoff up to 30 s) lands under the chart's grant
        wait("status.devices after the grant is back",
             lambda: our_entries(get(cluster, ns, "resourceclaim", "gpu")), 45)
        assert 200 in status_patches(cluster, ns, "gpu")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
