"""A NIC claim delivers a working interface on the real cluster: the driver (chart value
nri.enabled) registers with containerd's NRI, and a pod whose claim's NicConfig moves the
mock VF (a real netdev in the mock's namespace) sees it inside with the configured name,
address and MTU (`ip` in the container), the claim says NetworkReady, a driver restart
while the pod runs changes nothing, and after the pod is deleted the interface is back in
the mock's namespace.

While the VF is in the pod the mock's sysfs no longer lists it, as a node's sysfs does not
(issue 38): rediscovery passes keep it in the stored ResourceSlice with no write, the pod
sees it Healthy (not Unknown) in `allocatedResourcesStatus`, and after the restart the
claim keeps NetworkReady and networkData.

containerd v2 serves NRI on /var/run/nri/nri.sock by default (hack/local-cluster does not
turn it off); pods get their network namespace from the CNI bridge plugin that
hack/local-cluster sets up."""

from __future__ import annotations

from pathlib import Path

import os

import pytest

from driver.nri.setup import mock_network
from tests.cluster.conftest import release_minor
from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.test_health import health_of
from tests.cluster.test_slices import WRITE_VERBS
from tests.cluster.workloads import (apply, conditions, get, namespace, our_entries, pod,
                                     slice_device, wait, wait_running)

CONFIG = {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig", "moveInterface": True,
          "interfaceName": "net1", "addresses": ["10.99.0.5/24"], "mtu": 1400}


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}, "nri": {"enabled": True}})


def start(cluster, chart, workdir: Path, fresh: bool) -> HostDriver:
    import local_cluster

    drv = HostDriver(cluster, chart, workdir, local_cluster.NODE, fresh_node=fresh,
                     extra_env={"MOCK_PROFILE": "sriov", "REDISCOVER_INTERVAL": "2",
                                "HEALTH_INTERVAL": "1"}).start()
    drv.wait_ready()
    drv.wait_log("nri_synchronized", 30)
    return drv


def passes(drv: HostDriver, count: int) -> None:
    """Wait for `count` more rediscovery passes (each logs discovery_done)."""
    seen = drv.log().count('"discovery_done"')
    wait(f"{count} rediscovery passes",
         lambda: drv.log().count('"discovery_done"') >= seen + count, 60)


def slice_writes(cluster, since: int) -> list[tuple[str, str]]:
    return [(e["verb"], e["requestURI"]) for e in cluster.audit()[since:]
            if e["verb"] in WRITE_VERBS and "/resourceslices" in e["requestURI"]]


def vf_claim() -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "vf"},
            "spec": {"devices": {
                "requests": [{"name": "dev", "exactly": {
                    "deviceClassName": f"nic.{DRIVER}",
                    "selectors": [{"cel": {"expression":
                                           f'device.attributes["{DRIVER}"].sriovVF == true'}}]}}],
                "config": [{"requests": ["dev"], "opaque": {"driver": DRIVER,
                                                           "parameters": CONFIG}}]}}}


def in_pod(cluster, ns: str, name: str, *command: str) -> str:
    return cluster.kubectl("exec", "-n", ns, name, "--", *command).stdout


def test_nic_moves_into_the_pod_survives_a_driver_restart_and_comes_back(
        cluster, chart, tmp_path_factory):
    drv = start(cluster, chart, tmp_path_factory.mktemp("drv"), fresh=True)
    ns = namespace(cluster, "nics")
    try:
        apply(cluster, ns, vf_claim(), pod("trainer", "vf"))
        wait_running(cluster, ns, "trainer")
        claim = get(cluster, ns, "resourceclaim", "vf")
        (result,) = [r for r in claim["status"]["allocation"]["devices"]["results"]
                     if r["driver"] == DRIVER]
        attrs = slice_device(cluster, result["device"])["attributes"]
        host_name = (attrs.get("ifName") or attrs[f"{DRIVER}/ifName"])["string"]
        mock = mock_network(cluster.kubelet_dir / "plugins" / DRIVER)

        # IPv4 only: the kernel's IPv6 link-local address changes flags (DAD) as time passes.
        addr = in_pod(cluster, ns, "trainer", "ip", "-o", "-4", "addr", "show", "net1")
        assert "10.99.0.5/24" in addr, addr
        assert "mtu 1400" in in_pod(cluster, ns, "trainer", "ip", "link", "show", "net1")
        assert host_name not in in_pod(cluster, ns, "trainer", "ip", "-o", "link")
        entry = wait("NetworkReady on the claim", lambda: next(
            (e for e in our_entries(get(cluster, ns, "resourceclaim", "vf"))
             if "NetworkReady" in conditions(e)), None), 30)
        assert entry["networkData"]["interfaceName"] == "net1"
        assert entry["networkData"]["ips"] == ["10.99.0.5/24"]

        # Gone from the host's sysfs, as on a node: still published, unchanged, healthy.
        sysfs = cluster.kubelet_dir / "plugins" / DRIVER / "mock" / "sys"
        assert host_name not in os.listdir(sysfs / "class" / "net")
        device = slice_device(cluster, result["device"])
        since = len(cluster.audit())
        passes(drv, 3)
        assert slice_device(cluster, result["device"]) == device
        assert slice_writes(cluster, since) == [], drv.log()[-3000:]
        # device health in the pod's status, for a claim the pod names (resourceClaimName):
        # from 1.36 (tests/cluster/test_health.py says why)
        if release_minor() >= 36:
            health = wait("the VF Healthy in the pod's status", lambda: (
                h := health_of(get(cluster, ns, "pod", "trainer"))) and h, 60)
            assert set(health.values()) == {"Healthy"}, health

        # The driver restarts while the pod runs: the pod keeps its interface as it was.
        assert drv.stop() == 0, drv.log()[-3000:]
        drv = start(cluster, chart, tmp_path_factory.mktemp("drv"), fresh=False)
        assert in_pod(cluster, ns, "trainer", "ip", "-o", "-4", "addr", "show", "net1") == addr
        assert host_name not in os.listdir(sysfs / "class" / "net")
        passes(drv, 2)
        assert slice_device(cluster, result["device"]) == device
        (after,) = [e for e in our_entries(get(cluster, ns, "resourceclaim", "vf"))
                    if e["device"] == result["device"]]
        assert "NetworkReady" in conditions(after), after
        assert after["networkData"] == entry["networkData"], after
        if release_minor() >= 36:
            assert set(health_of(get(cluster, ns, "pod", "trainer")).values()) == {"Healthy"}

        cluster.kubectl("delete", "pod", "-n", ns, "trainer", "--wait=true", "--timeout=60s")
        from tests.test_nri_netdev import link
        back = wait(f"{host_name} back in the mock's namespace",
                    lambda: link(mock.path, host_name), 60)
        assert back["addresses"] == [] and back["mtu"] == 1500
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]
