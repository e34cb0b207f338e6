"""`dra-driver run --mock mixed --nri-socket ...` as a process, with NRI's own Go runtime
code (hack/nri-runtime) as the container runtime and the fake kubelet preparing claims:
a prepared NIC claim's interface lands in the pod's namespace with the configured name,
the claim status says so, a driver restart while the pod runs loses nothing, and the
interface is back in the mock's namespace after the pod is gone."""

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
from tests.test_plugin_integration import NIC, opaque, result

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
            driver = DriverProcess(api, dirs, extra=["--nri-socket", str(sock)]).start()
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
            driver = DriverProcess(api, dirs, extra=["--nri-socket", str(sock)]).start()
            try:
                runtime.wait_for(lambda e: e.get("event") == "synchronized" and e["pods"] == 1,
                                 30)
            except TimeoutError:
                raise AssertionError(f"no re-registration:\n{driver.log()}")
            assert link(pod_path, "net1") == inside

            for op in ("stop", "remove"):
                answer = runtime.command(op, id="sb-1")
                assert "error" not in answer, (answer, driver.log())
            assert link(pod_path, "net1") is None
            assert link(mock.path, IFNAME) is not None
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
