"""The driver's lifecycle on a node with the real kubelet and containerd, pods running:
a seamless upgrade (a second driver process beside the first, the kubelet moving to it, no
failed prepare, then the first stopped), restarts of the kubelet and of the driver (nothing
lost: the pod runs on, its CDI spec stays, the new driver unprepares it), and a simulated
reboot (new boot id, CDI folder emptied, containers gone: the kubelet prepares again and
the driver rebuilds the spec)."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import apply, claim, events, get, namespace, pod, wait, wait_running


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


def new_driver(cluster, chart, tmp_path, fresh: bool = False) -> HostDriver:
    import local_cluster

    return HostDriver(cluster, chart, tmp_path / uuid.uuid4().hex[:8], local_cluster.NODE,
                      fresh_node=fresh, extra_env={"MOCK_PROFILE": "mixed"})


def logged(drv: HostDriver, event: str, claim_uid: str) -> list[dict]:
    return [json.loads(line) for line in drv.log().splitlines()
            if f'"{event}"' in line and claim_uid in line]


def spec_of(cluster, claim_uid: str):
    return cluster.cdi_dir / f"{DRIVER}-claim_{claim_uid}.json"  # driver/prepare/cdi.py


def claim_uid(cluster, ns: str, name: str) -> str:
    return get(cluster, ns, "resourceclaim", name)["metadata"]["uid"]


def no_failed_prepare(cluster, ns: str, *drivers: HostDriver) -> None:
    ev = events(cluster, ns)
    assert "FailedPrepareDynamicResources" not in ev, ev
    for d in drivers:
        assert '"claim_failed"' not in d.log(), d.log()[-3000:]


@pytest.mark.release(33, "two instances of a driver on one node (kubelet rolling-update support)")
def test_seamless_upgrade_with_the_real_kubelet(cluster, chart, tmp_path):
    ns = namespace(cluster, "upgrade")
    old = new_driver(cluster, chart, tmp_path, fresh=True).start()
    new = None
    try:
        old.wait_log("slices_in_sync", 90)
        old.wait_log("kubelet_registration_succeeded", 30)
        apply(cluster, ns, claim("first", "gpu.accel.dra.io"), pod("first", "first"))
        wait_running(cluster, ns, "first")
        first = claim_uid(cluster, ns, "first")
        assert logged(old, "claim_prepared", first)

        # the new pod of the DaemonSet's rolling update starts beside the old one (its own
        # pod UID, so its own socket names); the kubelet takes the newest registration
        new = new_driver(cluster, chart, tmp_path).start()
        new.wait_log("kubelet_registration_succeeded", 60)
        apply(cluster, ns, claim("second", "gpu.accel.dra.io"), pod("second", "second"))
        wait_running(cluster, ns, "second")
        second = claim_uid(cluster, ns, "second")
        assert logged(new, "claim_prepared", second), new.log()[-3000:]
        assert not logged(old, "claim_prepared", second), "the kubelet still called the old driver"

        # the old pod goes; the node's slices stay published (the new instance owns them)
        slices_before = {s["metadata"]["name"] for s in json.loads(cluster.kubectl(
            "get", "resourceslices", "-o", "json").stdout)["items"] if s["spec"]["driver"] == DRIVER}
        assert old.stop() == 0, old.log()[-3000:]
        slices_after = {s["metadata"]["name"] for s in json.loads(cluster.kubectl(
            "get", "resourceslices", "-o", "json").stdout)["items"] if s["spec"]["driver"] == DRIVER}
        assert slices_before and slices_after == slices_before

        # the new instance unprepares the claim the old one prepared (shared checkpoint)
        cluster.kubectl("delete", "pod", "-n", ns, "first", "second", "--wait=true", "--timeout=60s")
        for uid in (first, second):
            wait(f"claim {uid} unprepared by the new driver", lambda: logged(new, "claim_unprepared", uid), 60)
            assert not spec_of(cluster, uid).exists()
        no_failed_prepare(cluster, ns, old, new)
        # two driver starts and a stop: nothing the kubelet's plugin watcher stats in vain
        # (it logs an error for each file in plugins_registry gone before its stat)
        watcher_errors = [line for line in (cluster.logs / "kubelet.log").read_text(errors="replace").splitlines()
                          if "Error when handling create" in line and "plugins_registry" in line]
        assert not watcher_errors, watcher_errors
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        old.stop()
        if new is not None:
            assert new.stop() == 0, new.log()[-3000:]


def test_kubelet_and_driver_restarts_with_a_pod_running(cluster, chart, tmp_path):
    ns = namespace(cluster, "restart")
    drv = new_driver(cluster, chart, tmp_path, fresh=True).start()
    try:
        drv.wait_ready()  # a pod bound before the registration fails its prepare
        apply(cluster, ns, claim("gpu", "gpu.accel.dra.io"), pod("holder", "gpu"))
        before = wait_running(cluster, ns, "holder")
        uid = claim_uid(cluster, ns, "gpu")
        spec = spec_of(cluster, uid)
        assert spec.exists()
        content = spec.read_text()
        container = before["status"]["containerStatuses"][0]["containerID"]

        # the kubelet restarts: it registers the driver again (its plugin watcher finds the
        # socket), the pod runs on in the same container, the spec stays
        cluster.stop_kubelet()
        cluster.start_kubelet()
        wait("the driver registered with the new kubelet",
             lambda: drv.log().count('"kubelet_registration_succeeded"') >= 2, 60)
        after = wait_running(cluster, ns, "holder")
        assert after["status"]["containerStatuses"][0]["containerID"] == container
        assert spec.read_text() == content

        # the driver restarts: the same
        assert drv.stop() == 0, drv.log()[-3000:]
        drv2 = new_driver(cluster, chart, tmp_path).start()
        drv2.wait_log("kubelet_registration_succeeded", 60)
        after = wait_running(cluster, ns, "holder")
        assert after["status"]["containerStatuses"][0]["containerID"] == container
        assert spec.read_text() == content

        # the pod goes: the restarted driver unprepares what its predecessor prepared
        cluster.kubectl("delete", "pod", "-n", ns, "holder", "--wait=true", "--timeout=60s")
        wait("the claim unprepared by the restarted driver", lambda: logged(drv2, "claim_unprepared", uid), 60)
        assert not spec.exists()
        no_failed_prepare(cluster, ns, drv, drv2)
        assert drv2.stop() == 0, drv2.log()[-3000:]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        drv.stop()


def test_a_simulated_reboot_with_a_pod_running(cluster, chart, tmp_path):
    ns = namespace(cluster, "reboot")
    drv = new_driver(cluster, chart, tmp_path, fresh=True).start()
    drv2 = None
    try:
        drv.wait_ready()
        holder = pod("holder", "gpu")
        holder["spec"]["restartPolicy"] = "Always"  # a node's pods come back after a reboot
        apply(cluster, ns, claim("gpu", "gpu.accel.dra.io"), holder)
        before = wait_running(cluster, ns, "holder")
        uid = claim_uid(cluster, ns, "gpu")
        spec = spec_of(cluster, uid)
        assert spec.exists()

        # "reboot": the driver and the kubelet stop, every container dies, the boot id
        # changes and /var/run/cdi (a tmpfs) comes back empty
        assert drv.stop() == 0, drv.log()[-3000:]
        cluster.stop_kubelet()
        tasks = cluster.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for t in tasks:
            cluster.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
        boot_id = cluster.kubelet_dir / "plugins" / DRIVER / "mock" / "proc" / "sys" / "kernel" / "random" / "boot_id"
        old_boot = boot_id.read_text().strip()
        boot_id.write_text(str(uuid.uuid4()) + "\n")
        for f in cluster.cdi_dir.iterdir():
            f.unlink()

        cluster.start_kubelet()
        drv2 = new_driver(cluster, chart, tmp_path).start()
        # the kubelet makes a new sandbox, prepares the claim again, the driver rebuilds the
        # spec for the new boot, and the container runs again
        wait("the claim restored after the reboot", lambda: logged(drv2, "claim_restored", uid), 120,
             explain=lambda: drv2.log()[-3000:] + events(cluster, ns))
        assert spec.exists()

        def restarted():
            p = get(cluster, ns, "pod", "holder")
            st = ((p or {}).get("status") or {}).get("containerStatuses") or [{}]
            return (p["status"].get("phase") == "Running" and st[0].get("ready")
                    and st[0].get("containerID") != before["status"]["containerStatuses"][0]["containerID"])
        wait("the pod running again in a new container", restarted, 120,
             explain=lambda: events(cluster, ns))
        assert boot_id.read_text().strip() != old_boot
        assert '"claim_failed"' not in drv2.log(), drv2.log()[-3000:]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        drv.stop()
        if drv2 is not None:
            assert drv2.stop() == 0, drv2.log()[-3000:]
