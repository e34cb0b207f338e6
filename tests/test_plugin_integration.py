"""The real plugin process, a fake kubelet over unix sockets, and the API emulator."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from driver.sim.apiserver import ApiServer, claim_allocated
from tests.cdi_check import check_spec
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from driver.sim.kubelet import Claim

GPU = "gpu-0000-11-00-0"
GPU2 = "gpu-0000-21-00-0"
NIC = "nic-0000-12-00-0"
VF = "nic-0000-41-00-2"
FPGA = "fpga-0000-31-00-1"


def result(request: str, device: str, pool: str = "node-a", driver: str = DRIVER) -> dict:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def opaque(request_names, parameters, source="FromClaim", driver=DRIVER) -> dict:
    return {"source": source, "requests": request_names,
            "opaque": {"driver": driver, "parameters": parameters}}


def new_claim(api, name, results, config=None, namespace="default") -> Claim:
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated(namespace, name, uid, results, config))
    return Claim(namespace, name, uid)


@pytest.fixture
def env():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        yield api, driver, kubelet, dirs
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def spec_files(dirs) -> list[Path]:
    return sorted(dirs.cdi.glob("*.json"))


def record_files(dirs) -> list[Path]:
    return sorted((dirs.state / "claims").glob("*.json"))


def test_registration_dance(env):
    api, driver, kubelet, dirs = env
    info = kubelet.info
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == str(dirs.plugins / DRIVER / "dra.sock")
    assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert kubelet.version == "v1.DRAPlugin"
    assert "kubelet_registration_succeeded" in driver.log()


@pytest.mark.parametrize("version", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
def test_prepare_and_unprepare(env, version):
    api, driver, kubelet, dirs = env
    claim = new_claim(api, "train", [result("gpu", GPU), result("nic/cx7", NIC)])
    response = kubelet.prepare([claim], version)
    entry = response.claims[claim.uid]
    assert entry.error == ""
    devices = {d.device_name: d for d in entry.devices}
    assert set(devices) == {GPU, NIC}
    assert list(devices[NIC].request_names) == ["nic"], "subrequest stripped"
    assert devices[GPU].pool_name == "node-a"
    assert list(devices[GPU].cdi_device_ids) == [f"{DRIVER}/claim={claim.uid}-{GPU}"]

    (spec_path,) = spec_files(dirs)
    assert spec_path.name == f"{DRIVER}-claim_{claim.uid}.json"
    spec = json.loads(spec_path.read_text())
    check_spec(spec)
    assert spec["kind"] == f"{DRIVER}/claim" and spec["cdiVersion"] == "0.5.0"
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    gpu_edits = by_name[f"{claim.uid}-{GPU}"]
    paths = [n["path"] for n in gpu_edits["deviceNodes"]]
    assert paths == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert gpu_edits["deviceNodes"][0]["hostPath"] == str(dirs.state / "mock" / "dev" / "nvidia0")
    assert "DRA_GPU_0000_11_00_0_CLAIM=default/train" in gpu_edits["env"]
    # The driver's user-space files, from the node, where CUDA images look for them.
    driver_root = dirs.state / "mock" / "driver-root"
    # KEP-5304: the request's device metadata, read-only, at the well-known path.
    metadata = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/gpu/{DRIVER}-metadata.json"
    assert {m["containerPath"]: m["hostPath"] for m in gpu_edits["mounts"]} == {
        metadata: f"{dirs.state}/metadata/{claim.uid}_gpu.json",
        "/usr/local/nvidia/lib64/libcuda.so.1": f"{driver_root}/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1": f"{driver_root}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15",
        "/usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1":
            f"{driver_root}/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.550.54.15",
        "/usr/local/nvidia/bin/nvidia-smi": f"{driver_root}/usr/bin/nvidia-smi",
    }
    assert all(m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in gpu_edits["mounts"])
    nic_edits = by_name[f"{claim.uid}-{NIC}"]
    assert [n["path"] for n in nic_edits["deviceNodes"]] == ["/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"]
    assert "DRA_NIC_0000_12_00_0_IFNAME=enp18s0f0" in nic_edits["env"]
    assert "netDevices" not in nic_edits, "moving the interface is off by default"
    assert [m["containerPath"] for m in nic_edits["mounts"]] == [
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/nic/{DRIVER}-metadata.json"]
    assert len(record_files(dirs)) == 1

    again = kubelet.prepare([claim], version)
    assert again.claims[claim.uid] == entry, "idempotent"

    unprep = kubelet.unprepare([claim], version)
    assert unprep.claims[claim.uid].error == ""
    assert spec_files(dirs) == [] and record_files(dirs) == []
    assert kubelet.unprepare([claim], version).claims[claim.uid].error == "", "unknown claim succeeds"


def test_empty_request_is_answered(env):
    _, _, kubelet, _ = env
    assert len(kubelet.prepare([]).claims) == 0
    assert len(kubelet.unprepare([]).claims) == 0


def test_other_drivers_results_are_ignored(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "mixed-drivers", [result("gpu", GPU), result("net", "eth9", driver="other.example.com")])
    entry = kubelet.prepare([claim]).claims[claim.uid]
    assert entry.error == "" and [d.device_name for d in entry.devices] == [GPU]


def test_configs_class_then_claim_override(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "cfg", [result("gpu", GPU), result("fpga", FPGA), result("vf", VF)], config=[
        opaque(["gpu"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "env": {"A": "claim"}}),
        opaque([], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "env": {"A": "class"}}, source="FromClass"),
        opaque(["fpga"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "FpgaConfig", "managementAccess": True}),
        opaque(["vf"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig", "moveInterface": True,
                        "interfaceName": "net1"}),
    ])
    entry = kubelet.prepare([claim]).claims[claim.uid]
    assert entry.error == ""
    spec = json.loads(spec_files(dirs)[0].read_text())
    check_spec(spec)
    edits = {d["name"].removeprefix(claim.uid + "-"): d["containerEdits"] for d in spec["devices"]}
    assert "A=claim" in edits[GPU]["env"] and "A=class" not in edits[GPU]["env"]
    assert "/dev/xclmgmt0" in [n["path"] for n in edits[FPGA]["deviceNodes"]]
    assert edits[VF]["netDevices"] == [{"hostInterfaceName": "enp65s0f0v0", "name": "net1"}]
    assert spec["cdiVersion"] == "1.1.0", "netDevices needs CDI 1.1.0"


def _bad(api, kubelet, dirs, claim, fragment):
    response = kubelet.prepare([claim])
    error = response.claims[claim.uid].error
    assert fragment in error, error
    assert spec_files(dirs) == [] and record_files(dirs) == [], "no state change"
    return error


def test_claim_not_found(env):
    api, _, kubelet, dirs = env
    error = _bad(api, kubelet, dirs, Claim("default", "ghost", str(uuid.uuid4())), "claim default/ghost not found")
    assert "ghost" in error


def test_uid_mismatch(env):
    api, _, kubelet, dirs = env
    new_claim(api, "replaced", [result("gpu", GPU)])
    _bad(api, kubelet, dirs, Claim("default", "replaced", str(uuid.uuid4())), "re-created")


def test_not_allocated(env):
    api, _, kubelet, dirs = env
    uid = str(uuid.uuid4())
    api.put_claim({"metadata": {"namespace": "default", "name": "pending", "uid": uid}, "spec": {}, "status": {}})
    _bad(api, kubelet, dirs, Claim("default", "pending", uid), "claim default/pending is not allocated")


def test_other_nodes_pool(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "elsewhere", [result("gpu", GPU, pool="node-b")])
    _bad(api, kubelet, dirs, claim, "pool 'node-b', this node's pool is 'node-a'")


def test_unknown_device(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "unknown", [result("gpu", "gpu-0000-99-00-0")])
    _bad(api, kubelet, dirs, claim, "device 'gpu-0000-99-00-0' does not exist on node node-a")


@pytest.mark.parametrize("parameters, fragment", [
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "TpuConfig"}, "unknown kind 'TpuConfig'"),
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "replicas": 4}, "unknown field(s) replicas"),
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "sharing": "mps"},
     "GpuConfig.sharing must be an object, got 'mps'"),
    ({"apiVersion": "v9", "kind": "GpuConfig"}, "apiVersion must be"),
    ("not-an-object", "parameters must be a JSON object"),
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "env": {"A": 1}}, "env.A must be a string"),
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "env": {f"K{i}": "x" * 200 for i in range(60)}},
     "the limit is 10240"),
    ({"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig"}, "NicConfig cannot configure gpu device"),
])
def test_bad_opaque_config(env, parameters, fragment):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "badcfg", [result("gpu", GPU)], config=[opaque(["gpu"], parameters)])
    error = _bad(api, kubelet, dirs, claim, fragment)
    assert "default/badcfg" in error


def test_duplicate_claims_in_one_request(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "dup", [result("gpu", GPU)])
    response = kubelet.prepare([claim, claim])
    assert "appears 2 times in one request" in response.claims[claim.uid].error
    assert spec_files(dirs) == [] and record_files(dirs) == []


@pytest.mark.parametrize("uid", ["../../etc/passwd", "a/b", "..", "UPPER-CASE-UID", "x" * 64])
def test_names_that_would_escape_directories(env, uid):
    api, _, kubelet, dirs = env
    api.put_claim(claim_allocated("default", "evil", uid, [result("gpu", GPU)]))
    response = kubelet.prepare([Claim("default", "evil", uid)])
    assert "is not a valid UID" in response.claims[uid].error
    assert kubelet.unprepare([Claim("default", "evil", uid)]).claims[uid].error
    assert spec_files(dirs) == [] and record_files(dirs) == []
    assert sorted(p.name for p in dirs.root.iterdir()) == sorted(
        ["cdi", "driver-0.log", "kubeconfig", "plugins", "registry", "state"])


def test_bad_namespace_reference(env):
    _, _, kubelet, dirs = env
    uid = str(uuid.uuid4())
    response = kubelet.prepare([Claim("../kube-system", "x", uid)])
    assert "namespace '../kube-system' is invalid" in response.claims[uid].error


def test_one_bad_claim_does_not_fail_the_others(env):
    api, _, kubelet, dirs = env
    good = new_claim(api, "good", [result("gpu", GPU)])
    bad = new_claim(api, "bad", [result("gpu", "gpu-0000-99-00-0")])
    response = kubelet.prepare([good, bad])
    assert response.claims[good.uid].error == "" and response.claims[bad.uid].error
    assert len(spec_files(dirs)) == 1


def test_sigterm_stops_cleanly_and_removes_own_sockets(env):
    api, driver, kubelet, dirs = env
    reg = dirs.registry / f"{DRIVER}-reg.sock"
    dra = dirs.plugins / DRIVER / "dra.sock"
    assert reg.exists() and dra.exists()
    assert driver.terminate() == 0
    assert not reg.exists() and not dra.exists()
    assert "plugin_stopped" in driver.log()


def test_run_publishes_slices_and_keeps_them_on_shutdown(env):
    api, driver, kubelet, dirs = env
    assert api.wait_for(lambda: len(api.state.slices) == 3, timeout=20), driver.log()
    published = {d["name"] for s in api.slices() for d in s["spec"]["devices"]}
    assert {GPU, GPU2, NIC, VF, FPGA} <= published
    assert driver.terminate() == 0
    assert len(api.slices()) == 3, "slices survive a restart; the next instance takes over"


def test_prepare_works_while_the_api_server_fails_slice_writes(env):
    api, driver, kubelet, dirs = env
    from driver.sim.apiserver import Fault

    api.inject(Fault("*", "resourceslices", status=503, times=10_000))
    claim = new_claim(api, "during-outage", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""


def test_a_claim_reallocated_under_the_same_uid_is_prepared_anew(env):
    """The record is not the truth: the claim is (deallocated and allocated again with
    other devices while its UID stayed)."""
    api, driver, kubelet, dirs = env
    claim = new_claim(api, "moved", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].devices[0].device_name == GPU
    api.put_claim(claim_allocated("default", "moved", claim.uid, [result("gpu", GPU2)]))
    entry = kubelet.prepare([claim]).claims[claim.uid]
    assert entry.error == "" and [d.device_name for d in entry.devices] == [GPU2]
    spec = json.loads(spec_files(dirs)[0].read_text())
    assert [d["name"] for d in spec["devices"]] == [f"{claim.uid}-{GPU2}"]
    record = json.loads(record_files(dirs)[0].read_text())
    assert [d["device"] for d in record["devices"]] == [GPU2]
    assert "claim_reallocated" in driver.log()
    # GPU is free again for another claim.
    other = new_claim(api, "next", [result("gpu", GPU)])
    assert kubelet.prepare([other]).claims[other.uid].error == ""


def test_a_prepared_claim_that_is_gone_is_not_answered_from_the_record(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "gone", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    api.delete_claim("default", "gone")
    assert kubelet.prepare([claim]).claims[claim.uid].error == "claim default/gone not found"
    assert len(record_files(dirs)) == 1, "a failed check changes no state"
    # Unprepare never needs the API server.
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert spec_files(dirs) == [] and record_files(dirs) == []


def test_a_device_prepared_for_one_claim_is_refused_to_another(env):
    api, _, kubelet, dirs = env
    first = new_claim(api, "first", [result("gpu", GPU)])
    second = new_claim(api, "second", [result("gpu", GPU)], namespace="team-b")
    assert kubelet.prepare([first]).claims[first.uid].error == ""
    error = kubelet.prepare([second]).claims[second.uid].error
    assert error == (f"claim team-b/second: device {GPU} is already prepared for claim default/first "
                     f"(UID {first.uid}) and is not shared; it is prepared again only after that "
                     "claim is unprepared")
    assert len(spec_files(dirs)) == 1
    assert kubelet.unprepare([first]).claims[first.uid].error == ""
    assert kubelet.prepare([second]).claims[second.uid].error == ""


def test_admin_access_and_shares_may_sit_beside_a_claim(env):
    api, _, kubelet, dirs = env
    workload = new_claim(api, "workload", [result("gpu", GPU)])
    assert kubelet.prepare([workload]).claims[workload.uid].error == ""
    monitor = new_claim(api, "monitor", [dict(result("gpu", GPU), adminAccess=True)])
    assert kubelet.prepare([monitor]).claims[monitor.uid].error == ""
    spec = json.loads((dirs.cdi / f"{DRIVER}-claim_{monitor.uid}.json").read_text())
    env_vars = spec["devices"][0]["containerEdits"]["env"]
    assert "DRA_GPU_0000_11_00_0_ADMIN_ACCESS=true" in env_vars
    workload_spec = (dirs.cdi / f"{DRIVER}-claim_{workload.uid}.json").read_text()
    assert "ADMIN_ACCESS" not in workload_spec
    # Admin access first, then a workload: allowed as well.
    watcher = new_claim(api, "watcher", [dict(result("gpu", GPU2), adminAccess=True)])
    job = new_claim(api, "job", [result("gpu", GPU2)])
    assert kubelet.prepare([watcher]).claims[watcher.uid].error == ""
    assert kubelet.prepare([job]).claims[job.uid].error == ""
    # A share of a multi-allocatable device (the scheduler assigned a shareID).
    shared = new_claim(api, "shared", [dict(result("nic", NIC), shareID="b8d3c5a0-share-1")])
    also = new_claim(api, "also", [dict(result("nic", NIC), shareID="b8d3c5a0-share-2")])
    assert kubelet.prepare([shared]).claims[shared.uid].error == ""
    assert kubelet.prepare([also]).claims[also.uid].error == ""
    # Admin access never moves an interface away from the claim that uses it.
    grab = new_claim(api, "grab", [dict(result("nic", VF), adminAccess=True)],
                     config=[opaque([], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig",
                                         "moveInterface": True})])
    assert "moveInterface would take it away" in kubelet.prepare([grab]).claims[grab.uid].error


def test_the_claim_get_happens_outside_the_cross_process_lock(env):
    """A slow API server must not hold up the other driver instance of an upgrade."""
    import fcntl
    import os
    import threading

    from driver.sim.apiserver import Fault

    api, _, kubelet, dirs = env
    claim = new_claim(api, "slow", [result("gpu", GPU)])
    api.inject(Fault("GET", "/resourceclaims/slow", status=0, delay=2.0))
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(kubelet.prepare([claim]).claims))
    thread.start()
    assert api.wait_for(lambda: api.state.requests > 0 and any(
        f.times == 0 for f in api.state.faults), timeout=10), "the GET is in flight"
    fd = os.open(dirs.state / "prepare.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free while the GET waits
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    thread.join(20)
    assert answer[claim.uid].error == ""


def test_a_claim_moving_its_nic_reserved_for_two_pods_is_refused_at_prepare(env):
    """Issue 38, 10(a): the interface can be in one pod only; the second pod's sandbox
    would fail on every retry. Refused at prepare with one line naming the claim, the
    device and the pods; one pod, or two without moveInterface, prepare as before."""
    api, _, kubelet, dirs = env
    moved = {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig", "moveInterface": True,
             "interfaceName": "net1"}
    two = [{"resource": "pods", "name": name, "uid": f"uid-{name}"} for name in ("b", "a")]

    def reserved(name: str, config: dict, pods: list[dict]) -> Claim:
        uid = str(uuid.uuid4())
        claim = claim_allocated("default", name, uid, [result("vf", VF)], [opaque(["vf"], config)])
        claim["status"]["reservedFor"] = pods
        api.put_claim(claim)
        return Claim("default", name, uid)

    error = _bad(api, kubelet, dirs, reserved("shared-vf", moved, two), "reserved for 2 pods")
    assert error == (
        f"claim default/shared-vf: device {VF} has NicConfig moveInterface: true, so its "
        "interface goes into one pod's network namespace, but the claim is reserved for 2 "
        "pods (a, b); give each pod its own claim (a ResourceClaimTemplate)")
    ok = reserved("one-pod", moved, two[:1])
    assert kubelet.prepare([ok]).claims[ok.uid].error == ""
    assert kubelet.unprepare([ok]).claims[ok.uid].error == ""
    stays = reserved("on-host", {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig"}, two)
    assert kubelet.prepare([stays]).claims[stays.uid].error == ""
