"""`dra-driver run --mock mixed --nri-socket ...` as a process, with NRI's own Go runtime
code (hack/nri-runtime) as the container runtime and the fake kubelet preparing claims:
a prepared NIC claim's interface lands in the pod's namespace with the configured name,
the claim status says so, a driver restart while the pod runs loses nothing, and the
interface is back in the mock's namespace after the pod is gone.

While the interface is in the pod the mock's sysfs no longer lists it, as a node's does
not (driver/nri/mocknet.py): rediscovery keeps the NIC published unchanged (no slice
write), its health is not judged by a link the host cannot see, and after a restart a
repeated prepare still finds it and the claim keeps NetworkReady (issue 38)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from pyroute2 import netns as pyroute2_netns

from driver.nri.setup import mock_network
from driver.sim.apiserver import ApiServer, claim_allocated
from tests import nri_runtime
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_nri_netdev import _REASON, link
from tests.test_plugin_integration import NIC, Claim, opaque, result

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

IFNAME = "enp18s0f0"  # the mixed profile's NIC nic-0000-12-00-0


@pytest.fixture(scope="module")
def go_runtime_binary(tmp_path_factory) -> Path:
    reason = nri_runtime.go_available()
    if reason:
        pytest.skip(reason)
    return nri_runtime.build_go_runtime(tmp_path_factory.mktemp("nri-runtime"))


def wait(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def passes(driver: DriverProcess, count: int) -> None:
    """Wait for `count` more rediscovery passes (each logs discovery_done)."""
    seen = driver.log().count('"discovery_done"')
    wait(lambda: driver.log().count('"discovery_done"') >= seen + count,
         f"{count} rediscovery passes", 60)


def published(api: ApiServer) -> set[str]:
    return {d["name"] for s in api.slices() for d in s["spec"].get("devices") or []}


def unhealthy(driver: DriverProcess, device: str) -> list[str]:
    return [line for line in driver.log().splitlines()
            if '"device_unhealthy"' in line and device in line]


def test_nic_claim_moves_into_the_pod_and_back(go_runtime_binary: Path) -> None:
    dirs = DriverDirs.make()
    sock_dir = Path(tempfile.mkdtemp(prefix="dra-nri-"))
    sock = sock_dir / "nri.sock"
    pod_netns = f"dra-test-pod-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pyroute2_netns.create(pod_netns)
    pod_path = f"/var/run/netns/{pod_netns}"
    mock = mock_network(dirs.state)
    runtime = nri_runtime.GoRuntime(go_runtime_binary, sock)
    driver = None
    try:
        with ApiServer() as api:
            api.add_node("node-a")
            uid = str(uuid.uuid4())
            claim = claim_allocated("default", "nic", uid, [result("nic", NIC)], [opaque(
                ["nic"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig",
                          "moveInterface": True, "interfaceName": "net1",
                          "addresses": ["10.1.0.5/24"], "mtu": 1400,
                          "routes": [{"destination": "10.2.0.0/16", "gateway": "10.1.0.1"}]})])
            claim["status"]["reservedFor"] = [{"resource": "pods", "name": "trainer",
                                               "uid": "pod-uid-1"}]
            api.put_claim(claim)
            extra = ["--nri-socket", str(sock), "--rediscover-interval", "1"]
            driver = DriverProcess(api, dirs, extra=extra).start()
            try:
                runtime.wait_for(lambda e: e.get("event") == "synchronized", 30)
            except TimeoutError:
                raise AssertionError(f"the driver did not register with NRI:\n{driver.log()}")
            kubelet = driver.kubelet()
            from tests.test_plugin_integration import Claim
            answer = kubelet.prepare([Claim("default", "nic", uid)]).claims[uid]
            assert answer.error == ""
            spec = json.loads(next(dirs.cdi.glob("*.json")).read_text())
            assert "netDevices" not in json.dumps(spec), "the NRI plugin moves it, not the runtime"
            assert link(mock.path, IFNAME) is not None

            sandbox = {"id": "sb-1", "uid": "pod-uid-1", "name": "trainer",
                       "namespace": "default", "netns": pod_path}
            answer = runtime.command("run", pod=sandbox)
            assert "error" not in answer, (answer, driver.log())
            print(f"RunPodSandbox with the driver process: {answer['ms']:.1f} ms")
            inside = link(pod_path, "net1")
            assert inside is not None and inside["up"]
            assert (inside["mtu"], inside["addresses"], inside["routes"]) == (
                1400, ["10.1.0.5/24"], ["10.2.0.0/16 via 10.1.0.1"])
            assert link(mock.path, IFNAME) is None
            sysfs = dirs.state / "mock" / "sys"
            assert IFNAME not in os.listdir(sysfs / "class" / "net")
            writes = api.writes()
            passes(driver, 3)
            assert NIC in published(api), driver.log()[-3000:]
            assert api.writes() == writes, "a NIC in a pod changed the slice"
            assert not unhealthy(driver, NIC), unhealthy(driver, NIC)

            def status_entry():
                with api.state.lock:
                    for d in (api.state.claims[("default", "nic")].get("status") or {}).get(
                            "devices") or []:
                        if d["driver"] == DRIVER and any(c["type"] == "NetworkReady"
                                                         for c in d["conditions"]):
                            return json.loads(json.dumps(d))
            entry = wait(status_entry, "NetworkReady in the claim status")
            assert entry["networkData"] == {"interfaceName": "net1", "ips": ["10.1.0.5/24"],
                                            "hardwareAddress": inside["mac"]}

            # The driver dies and comes back while the pod runs: nothing moves.
            driver.kill()
            kubelet.close()
            driver = DriverProcess(api, dirs, extra=extra).start()
            try:
                runtime.wait_for(lambda e: e.get("event") == "synchronized" and e["pods"] == 1,
                                 30)
            except TimeoutError:
                raise AssertionError(f"no re-registration:\n{driver.log()}")
            assert link(pod_path, "net1") == inside
            # The tree was written whole at start; the NIC in the pod left it again.
            assert IFNAME not in os.listdir(sysfs / "class" / "net")
            passes(driver, 2)
            kubelet = driver.kubelet()
            answer = kubelet.prepare([Claim("default", "nic", uid)]).claims[uid]
            assert answer.error == "", answer.error
            assert NIC in published(api) and not unhealthy(driver, NIC)
            assert wait(status_entry, "NetworkReady after the restart")["networkData"] == \
                entry["networkData"]

            for op in ("stop", "remove"):
                answer = runtime.command(op, id="sb-1")
                assert "error" not in answer, (answer, driver.log())
            assert link(pod_path, "net1") is None
            assert link(mock.path, IFNAME) is not None
            assert IFNAME in os.listdir(sysfs / "class" / "net")
            assert not list((dirs.state / "nri").glob("*.json"))
    finally:
        runtime.stop()
        if driver is not None:
            driver.kill()
        pyroute2_netns.remove(pod_netns)
        mock.destroy()
        dirs.cleanup()
        for entry in sock_dir.iterdir():
            entry.unlink()
        sock_dir.rmdir()


REQUIRED = {"required-plugins.noderesource.dev/pod": '["dra-accel-driver"]'}


def test_a_container_does_not_run_without_its_nic_while_the_driver_is_away(
        go_runtime_binary: Path) -> None:
    """NRI's default validator on (containerd: default_validator.enable), the pod annotated
    to require our plugin: while the driver is down its sandbox starts (the runtime skips
    a plugin that is not there) but its container is refused; with the driver back and
    the move still failing for the pod, our CreateContainer refuses it with one line; once
    the NIC can move, the kubelet's retry is created with the NIC in the pod. A pod
    without the annotation is never held up."""
    dirs = DriverDirs.make()
    sock_dir = Path(tempfile.mkdtemp(prefix="dra-nri-"))
    sock = sock_dir / "nri.sock"
    pod_netns = f"dra-test-pod-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pod_path = f"/var/run/netns/{pod_netns}"
    mock = mock_network(dirs.state)
    runtime = nri_runtime.GoRuntime(go_runtime_binary, sock, ("-validator",))
    driver = None
    made = False
    try:
        with ApiServer() as api:
            api.add_node("node-a")
            uid = str(uuid.uuid4())
            claim = claim_allocated("default", "nic", uid, [result("nic", NIC)], [opaque(
                ["nic"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig",
                          "moveInterface": True, "interfaceName": "net1",
                          "addresses": ["10.1.0.5/24"]})])
            claim["status"]["reservedFor"] = [{"resource": "pods", "name": "trainer",
                                               "uid": "pod-uid-1"}]
            api.put_claim(claim)
            driver = DriverProcess(api, dirs, extra=["--nri-socket", str(sock)]).start()
            runtime.wait_for(lambda e: e.get("event") == "synchronized", 30)
            kubelet = driver.kubelet()
            from tests.test_plugin_integration import Claim
            assert kubelet.prepare([Claim("default", "nic", uid)]).claims[uid].error == ""
            kubelet.close()

            # The driver stops after the prepare; the kubelet goes on with the pod.
            driver.kill()
            other = {"id": "sb-2", "uid": "pod-uid-2", "name": "other", "namespace": "default",
                     "netns": ""}
            for op, fields in (("run", {"pod": other}), ("create", {"id": "sb-2",
                                                                    "container": "c"})):
                answer = runtime.command(op, **fields)
                assert "error" not in answer, answer  # not annotated: not held up
            sandbox = {"id": "sb-1", "uid": "pod-uid-1", "name": "trainer",
                       "namespace": "default", "netns": pod_path, "annotations": REQUIRED}
            answer = runtime.command("run", pod=sandbox)
            assert "error" not in answer, answer  # no plugin: the sandbox starts
            answer = runtime.command("create", id="sb-1", container="main")
            assert 'required plugin "dra-accel-driver" not present' in answer["error"], answer

            # Back, but the move fails for this pod at Synchronize (here: its namespace
            # is not there yet): our CreateContainer refuses the container.
            driver = DriverProcess(api, dirs, extra=["--nri-socket", str(sock)]).start()
            runtime.wait_for(lambda e: e.get("event") == "synchronized" and e["pods"] == 2, 30)
            # (the runtime adds the plugin to its list just after the Synchronize)
            answer = wait(lambda: (lambda a: a if "not present" not in a.get("error", "")
                                   else None)(runtime.command("create", id="sb-1",
                                                              container="main")),
                          "the runtime to count the plugin in")
            assert answer["error"].endswith(
                "CreateContainer: container main of pod default/trainer is not started "
                f"without its NIC: claim {uid}: pod default/trainer: network namespace "
                f"{pod_path}: No such file or directory (the driver sees only the namespace "
                "directories mounted into it: chart value nri.netnsDirs)"), answer
            assert link(mock.path, IFNAME) is not None

            pyroute2_netns.create(pod_netns)
            made = True
            answer = runtime.command("create", id="sb-1", container="main")
            assert "error" not in answer, (answer, driver.log())
            inside = link(pod_path, "net1")
            assert inside is not None and inside["addresses"] == ["10.1.0.5/24"]
            assert '"container_refused_without_nic"' in driver.log()

            for op in ("stop", "remove"):
                answer = runtime.command(op, id="sb-1")
                assert "error" not in answer, (answer, driver.log())
            assert link(mock.path, IFNAME) is not None
    finally:
        runtime.stop()
        if driver is not None:
            driver.kill()
        if made:
            pyroute2_netns.remove(pod_netns)
        mock.destroy()
        dirs.cleanup()
        for entry in sock_dir.iterdir():
            entry.unlink()
        sock_dir.rmdir()
