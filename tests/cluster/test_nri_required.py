"""A pod must not start without its NIC (issue 38, item 3), on the real cluster.

containerd starts a pod's sandbox without an NRI plugin that is not registered (and
without one it closed after a timeout), so the driver's RunPodSandbox move never happens;
the Synchronize after the plugin comes back moves the NIC, but by then the workload has
started and set NCCL/UCX up without it. NRI's default validator (hack/local-cluster turns
it on: `[plugins.'io.containerd.nri.v1.nri'.default_validator] enable = true`) refuses
the container of a pod annotated `required-plugins.noderesource.dev/pod:
'["dra-accel-driver"]'` while the plugin is not registered; the kubelet retries it, and
once the driver is back (Synchronize moves the NIC; our CreateContainer checks it is in
place) the container runs with the NIC.

Here the pod is created while the driver serves the kubelet (its claim must be prepared
before the sandbox is made) but its NRI half cannot reach containerd (a socket path
with nothing behind it); then that driver stops, and the container still does not run;
then the driver comes back as the chart runs it."""

from __future__ import annotations

import json

import pytest

from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import apply, events, get, namespace, pod, wait, wait_running

REQUIRED = {"required-plugins.noderesource.dev/pod": json.dumps(["dra-accel-driver"])}
CONFIG = {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig", "moveInterface": True,
          "interfaceName": "net1", "addresses": ["10.99.0.5/24"]}


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


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}, "nri": {"enabled": True}})


def driver(cluster, chart, workdir, fresh: bool, **env: str) -> HostDriver:
    import local_cluster

    drv = HostDriver(cluster, chart, workdir, local_cluster.NODE, fresh_node=fresh,
                     extra_env={"MOCK_PROFILE": "sriov", **env}).start()
    drv.wait_ready()
    return drv


def waiting(cluster, ns: str, name: str) -> dict | None:
    """The container's `waiting` state, None once it is anything else (or not yet known)."""
    p = get(cluster, ns, "pod", name) or {}
    for status in p.get("status", {}).get("containerStatuses") or []:
        return (status.get("state") or {}).get("waiting")
    return None


def refusals(cluster, ns: str) -> int:
    """How many times the kubelet was refused the container (events count repeats)."""
    out = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout)
    return sum(e.get("count") or 1 for e in out["items"]
               if "not present" in (e.get("message") or ""))


def never_ran(cluster, ns: str, name: str) -> bool:
    p = get(cluster, ns, "pod", name) or {}
    return all("running" not in (s.get("state") or {}) and "terminated" not in (s.get("state") or {})
               and not s.get("lastState") and s.get("restartCount", 0) == 0
               for s in p.get("status", {}).get("containerStatuses") or [])


def test_the_container_waits_for_its_nic_while_the_driver_is_away(cluster, chart,
                                                                 tmp_path_factory):
    workdir = tmp_path_factory.mktemp("drv")
    # The DRA half serves the kubelet; the NRI half dials a socket nobody listens on.
    away = driver(cluster, chart, workdir, True, NRI_SOCKET=str(workdir / "no-runtime.sock"))
    drv = None
    ns = namespace(cluster, "nri-req")
    try:
        trainer = pod("trainer", "vf")
        trainer["metadata"]["annotations"] = REQUIRED
        apply(cluster, ns, vf_claim(), trainer)
        away.wait_log("claim_prepared", 90)

        # The sandbox started (containerd skips the absent plugin); the container is refused.
        state = wait("the container refused for the missing plugin",
                     lambda: (w := waiting(cluster, ns, "trainer")) and
                     w.get("reason") == "CreateContainerError" and w, 120,
                     explain=lambda: f"\nevents:\n{events(cluster, ns)}")
        assert 'required plugin "dra-accel-driver" not present' in state["message"], state
        assert get(cluster, ns, "pod", "trainer")["status"]["phase"] == "Pending"

        # The driver stops: the kubelet keeps retrying, the container still never runs.
        before = refusals(cluster, ns)
        assert away.stop() == 0, away.log()[-3000:]
        wait("another refusal while the driver is stopped",
             lambda: refusals(cluster, ns) > before, 120,
             explain=lambda: f"\nevents:\n{events(cluster, ns)}")
        assert never_ran(cluster, ns, "trainer"), get(cluster, ns, "pod", "trainer")["status"]

        # Back as the chart runs it: Synchronize moves the VF into the running sandbox and
        # the kubelet's next try makes the container, which sees it.
        drv = driver(cluster, chart, tmp_path_factory.mktemp("drv"), False)
        drv.wait_log("nri_synchronized", 30)
        wait_running(cluster, ns, "trainer", 180)
        addr = cluster.kubectl("exec", "-n", ns, "trainer", "--", "ip", "-o", "-4", "addr",
                               "show", "net1").stdout
        assert "10.99.0.5/24" in addr, addr
        status = get(cluster, ns, "pod", "trainer")["status"]["containerStatuses"][0]
        assert status["restartCount"] == 0 and not status.get("lastState"), status
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        away.stop()
        if drv is not None:
            assert drv.stop() == 0, drv.log()[-3000:]
