"""What the driver tells the user about their cluster's Kubernetes release (issue 44 item 3):
one `cluster_support` line at start, the same line in `dra-driver status`, and in explain
a claim that asks for more than the release can do. Against the API emulator set to an
older release (/version and the resource.k8s.io versions it serves)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
import yaml

from driver import cli
from driver.kube import releases
from driver.sim.apiserver import ApiServer
from tests.driverproc import DRIVER, DriverDirs, DriverProcess


def _lines(proc: DriverProcess, event: str) -> list[dict]:
    found = []
    for line in proc.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            found.append(entry)
    return found


def _status(dirs: DriverDirs, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "mixed", "--node-name", "node-a",
                           "--state-dir", str(dirs.state), *extra], capture_output=True, text=True, timeout=120)


@pytest.fixture
def dirs():
    made = DriverDirs.make()
    yield made
    made.cleanup()


def _run_until_published(api: ApiServer, dirs: DriverDirs, extra: list[str]) -> DriverProcess:
    if "node-a" not in api.state.nodes:
        api.add_node("node-a")
    proc = DriverProcess(api, dirs, extra=extra).start()
    try:
        deadline = time.monotonic() + 60
        while not _lines(proc, "slices_in_sync"):
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.1)
    finally:
        proc.terminate()
    return proc


def test_on_1_32_consumable_sharing_is_said_to_need_1_34_at_start_and_in_status(dirs):
    with ApiServer(versions=["v1beta1"], server_version=(1, 32)) as api:
        proc = _run_until_published(api, dirs, ["--gpu-sharing", "consumable"])
        devices = [d for s in api.slices() for d in s["spec"]["devices"]]
    (line,) = _lines(proc, "cluster_support")
    assert (line["kubernetes"], line["resource_api"]) == ("1.32", "v1beta1")
    (consumable,) = [u for u in line["unavailable"] if "--gpu-sharing=consumable" in u]
    assert "needs 1.34" in consumable and "whole GPUs" in consumable
    # ... and that is what it did: no device offered to several claims.
    assert devices and not any("allowMultipleAllocations" in d.get("basic", d) for d in devices)
    gates = " ".join(line["gate_off_by_default"])
    assert "DynamicResourceAllocation" in gates and "on by default from 1.34" in gates
    assert "DRAResourceClaimDeviceStatus" in gates and "on by default from 1.33" in gates
    shown = _status(dirs)
    assert shown.returncode == 0, shown.stderr
    first = shown.stdout.splitlines()[0]
    assert first == line["line"] and first.startswith("Kubernetes 1.32 (resource.k8s.io v1beta1) lacks ")
    assert shown.stdout.splitlines()[1].startswith("DEVICE")
    rows = json.loads(_status(dirs, "-o", "json").stdout)
    assert rows and all(r["cluster_support"] == line["line"] for r in rows)


def test_a_kubelet_older_than_the_control_plane_is_judged_by_its_own_release(dirs):
    """Seamless upgrades are the kubelet's (1.33): the chart turns them on by the control
    plane's release, but a 1.32 kubelet under a 1.34 control plane cannot keep two instances
    apart. The driver reads its Node's kubeletVersion and says so."""
    with ApiServer(server_version=(1, 34)) as api:
        api.add_node("node-a", kubelet_version="v1.32.13")
        proc = _run_until_published(api, dirs, ["--pod-uid", "6c1f8a2e-0d5b-4c1e-9a55-1f4e2b7c9d10"])
    (line,) = _lines(proc, "cluster_support")
    assert line["kubelet"] == "1.32" and line["kubernetes"] == "1.34"
    (seamless,) = [u for u in line["unavailable"] if u.startswith("seamless upgrades")]
    assert "needs kubelet 1.33" in seamless and "maxSurge 0" in seamless
    assert line["line"].startswith("Kubernetes 1.34 (resource.k8s.io v1) with a 1.32 kubelet lacks ")
    # the kubelet's other feature (health in the pod's status, 1.34) is judged by it too
    assert any(u.startswith("device health in pod status") for u in line["unavailable"])


def test_on_1_37_nothing_is_said(dirs):
    with ApiServer(server_version=(1, 37)) as api:
        proc = _run_until_published(api, dirs, ["--gpu-sharing", "consumable", "--mig-mode", "dynamic"])
    assert _lines(proc, "cluster_support") == []
    shown = _status(dirs)
    assert shown.returncode == 0 and shown.stdout.startswith("DEVICE"), shown.stdout + shown.stderr
    assert all(r["cluster_support"] is None for r in json.loads(_status(dirs, "-o", "json").stdout))


def test_gates_off_by_default_on_1_35_are_named_with_the_release_that_turns_them_on():
    used = [releases.DRA, releases.DEVICE_TAINTS, releases.DYNAMIC_MIG]
    found = releases.support((1, 35), "v1", used)
    assert found.missing == ()
    assert found.gated == ("DRADeviceTaints for taints on unhealthy devices (on by default from 1.36)",
                           "DRAPartitionableDevices for dynamic MIG (--mig-mode=dynamic, on by default from 1.36)")
    # The driver writes no counters before 1.34 (upstream's 1.33 alpha has another shape).
    assert "static MIG" in releases.support((1, 33), "v1beta2", used).missing[0]
    # v1beta1 slices have no taints, whatever the release.
    assert releases.support((1, 33), "v1beta1", used).missing[0].startswith("taints on unhealthy devices (needs "
                                                                            "resource.k8s.io v1 or v1beta2")
    assert releases.support((1, 36), "v1", used).line() is None


def _explain(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    parsed = cli.parser().parse_args(["explain", *args])
    from driver.explain import command
    return command.run(parsed, out, err), out.getvalue(), err.getvalue()


def test_explain_names_the_release_a_capacity_request_needs(tmp_path):
    claim = {"apiVersion": "resource.k8s.io/v1beta2", "kind": "ResourceClaim",
             "metadata": {"name": "share", "namespace": "default"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": f"gpu.{DRIVER}", "capacity": {"requests": {"memory": "10Gi"}}}}]}}}
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(claim))
    with ApiServer(versions=["v1beta2", "v1beta1"], server_version=(1, 33)) as api:
        kubeconfig = str(api.kubeconfig(tmp_path))
        code, out, err = _explain("-f", str(path), "--kubeconfig", kubeconfig)
        assert code in (0, 1), err
        lines = out.splitlines()
        assert lines[0].startswith("Claim default/share")
        assert lines[1].strip() == ("Kubernetes 1.33 cannot allocate it: request gpu asks for capacity "
                                    "(consumable GPU shares), which needs Kubernetes 1.34")
        code, out, _ = _explain("-f", str(path), "--kubeconfig", kubeconfig, "-o", "json")
        assert "needs Kubernetes 1.34" in json.loads(out)["claims"][0]["release"]
        api.state.server_version = (1, 34)
        code, out, _ = _explain("-f", str(path), "--kubeconfig", kubeconfig, "-o", "json")
        assert json.loads(out)["claims"][0]["release"] is None


def test_explain_on_a_server_without_a_resource_api_it_knows_says_what_dra_needs(tmp_path):
    with ApiServer(server_version=(1, 31)) as api:
        api.state.versions = ["v1alpha3"]  # 1.31's DRA: an API this driver does not speak
        code, _, err = _explain("anything", "--kubeconfig", str(api.kubeconfig(tmp_path)))
    assert code == 2
    (line,) = err.splitlines()
    assert "(Kubernetes 1.31)" in line and "serves no resource.k8s.io version this driver knows" in line
    assert "needs Kubernetes 1.32 or newer" in line and "cannot reach" not in line


def _deployment(tmp_path, resource: str):
    pod = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "trainer", "namespace": "default"},
           "spec": {"template": {"spec": {"containers": [
               {"name": "app", "image": "busybox", "resources": {"limits": {resource: 1}}}]}}}}
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(pod))
    return str(path)


@pytest.mark.parametrize("release,expected", [
    # found by the matrix: on 1.34 the pod ran, with no device (its scheduler and kubelet
    # take the implicit name for a native resource)
    ((1, 34), "Kubernetes 1.34 takes deviceclass.resource.kubernetes.io/gpu.accel.dra.io for a native "
              "resource: a pod asking for one is scheduled without a claim and runs without the device"),
    ((1, 33), "Kubernetes 1.33 cannot serve deviceclass.resource.kubernetes.io/gpu.accel.dra.io from a "
              "DeviceClass: extended resource names need Kubernetes 1.34; the pod stays Pending there"),
    ((1, 35), None),
])
def test_explain_says_which_release_serves_a_pods_implicit_extended_resource(tmp_path, release, expected):
    resource = f"deviceclass.resource.kubernetes.io/gpu.{DRIVER}"
    with ApiServer(server_version=release) as api:
        api.state.objects[("deviceclasses", "", f"gpu.{DRIVER}")] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"gpu.{DRIVER}"},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}
        kubeconfig = str(api.kubeconfig(tmp_path))
        code, out, err = _explain("-f", _deployment(tmp_path, resource), "--kubeconfig", kubeconfig, "-o", "json")
        assert code in (0, 1), err
        (found,) = json.loads(out)["claims"]
        if expected is None:
            assert found["release"] is None
        else:
            assert found["release"].startswith(expected), found["release"]
        # an explicit name is served from 1.34
        api.state.objects[("deviceclasses", "", f"gpu.{DRIVER}")]["spec"]["extendedResourceName"] = "example.com/gpu"
        code, out, err = _explain("-f", _deployment(tmp_path, "example.com/gpu"), "--kubeconfig", kubeconfig,
                                  "-o", "json")
        (found,) = json.loads(out)["claims"]
        assert (found["release"] is None) == (release >= (1, 34)), found["release"]
