"""GPU sharing end to end: the real driver process, the API emulator with its kubelet's
pod runner (MPS daemon pods run as local processes), the fake NVML library and the mock
node's nvidia-smi and nvidia-cuda-mps-control."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import kubernetes_validate
import pytest

from driver.kube import quantity
from driver.devices.mock.gpustate import GpuStateStore
from driver.sim.apiserver import ApiServer, Fault, claim_allocated
from driver.sim.kubelet import Claim
from driver.sim.pods import PodRunner
from tests.driverproc import DRIVER, DriverDirs, DriverProcess

GPU = "gpu-0000-11-00-0"
GPU2 = "gpu-0000-21-00-0"
NAMESPACE = "dra-system"
EXCLUSIVE_PROCESS, DEFAULT = 3, 0
MPS_ARGS = ["--gpu-sharing", "consumable", "--mps-image", "registry.example/dra-accel-driver:test",
            "--namespace", NAMESPACE, "--mps-start-timeout", "20",
            "--sharing-reconcile-interval", "1"]


def share(device: str, memory: str, compute: str, request: str = "gpu") -> dict:
    return {"request": request, "driver": DRIVER, "pool": "node-a", "device": device,
            "shareID": str(uuid.uuid4()), "consumedCapacity": {"memory": memory, "compute": compute}}


def gpu_config(sharing: dict, requests=None) -> dict:
    return {"source": "FromClaim", "requests": requests or [],
            "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}}}


def new_claim(api, name, results, config=None) -> Claim:
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated("default", name, uid, results, config))
    return Claim("default", name, uid)


class Node:
    def __init__(self, api: ApiServer, dirs: DriverDirs, runner: PodRunner) -> None:
        self.api, self.dirs, self.runner = api, dirs, runner
        self.driver = DriverProcess(api, dirs, profile="h100x8", extra=MPS_ARGS).start()
        self.kubelet = self.driver.kubelet()

    def restart(self) -> None:
        self.kubelet.close()
        self.driver.kill()
        self.driver = DriverProcess(self.api, self.dirs, profile="h100x8", extra=MPS_ARGS).start()
        self.kubelet = self.driver.kubelet()

    @property
    def mock_root(self) -> Path:
        return self.dirs.state / "mock"

    def uuid_of(self, device: str) -> str:
        for info in (self.mock_root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information"):
            bdf = info.parent.name
            if device == "gpu-" + bdf.replace(":", "-").replace(".", "-"):
                return next(line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                            if line.startswith("GPU UUID:"))
        raise KeyError(device)

    def gpu(self, device: str):
        return GpuStateStore(self.mock_root).get(self.uuid_of(device))

    def pods(self) -> dict[str, dict]:
        with self.api.state.lock:
            return {name: pod for (ns, name), pod in self.api.state.pods.items()}

    def spec(self, claim: Claim) -> dict:
        return json.loads((self.dirs.cdi / f"{DRIVER}-claim_{claim.uid}.json").read_text())

    def mps_dir(self, device: str) -> Path:
        return self.dirs.state / "mps" / device

    def wait(self, predicate, timeout: float = 20.0, what: str = "", seen=None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                found = f" (found {seen()})" if seen is not None else ""
                raise AssertionError(f"timed out waiting for {what}{found}; driver log:\n"
                                     f"{self.driver.log()[-3000:]}")
            time.sleep(0.05)


@pytest.fixture
def node():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        # Leaving the runner ends every daemon the test left, as a node shutting down would.
        with PodRunner(api, "node-a", dirs.root / "pod-logs") as runner:
            n = Node(api, dirs, runner)
            yield n
            n.kubelet.close()
            n.driver.kill()
    dirs.cleanup()


def env_of(spec: dict, device_index: int = 0) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["devices"][device_index]["containerEdits"]["env"])


def test_consumable_slices_validate_for_every_server_that_has_the_fields(node):
    slices = [s for s in node.api.slices() if s["metadata"]["name"].endswith("-gpu-0")]
    assert slices, node.api.slices()
    gpu = slices[0]["spec"]["devices"][0]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"]["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "79Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}
    assert gpu["capacity"]["compute"]["requestPolicy"] == {"default": "0", "validRange": {"min": "0", "step": "1"}}
    for version in ("1.34.0", "1.35.0", "1.36.0", "1.37.0"):
        kubernetes_validate.validate(slices[0], version, strict=True)


def test_two_shares_pack_onto_one_mps_daemon_with_their_own_limits(node):
    a = new_claim(node.api, "infer-a", [share(GPU, "20Gi", "30")])
    b = new_claim(node.api, "infer-b", [share(GPU, "30Gi", "30")])
    reply = node.kubelet.prepare([a])
    assert reply.claims[a.uid].error == ""
    assert [d.share_id for d in reply.claims[a.uid].devices] != [""]
    assert len(node.pods()) == 1, "the first share starts the GPU's daemon"
    reply = node.kubelet.prepare([b])
    assert reply.claims[b.uid].error == ""
    assert len(node.pods()) == 1, "the second share joins it"
    assert node.gpu(GPU).compute_mode == EXCLUSIVE_PROCESS
    pipe = node.mps_dir(GPU) / "pipe"
    assert (pipe / "control").exists()
    for claim, memory, compute in ((a, "20480M", "30"), (b, "30720M", "30")):
        spec = node.spec(claim)
        env = env_of(spec)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={memory}"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == compute
        mounts = {m["containerPath"]: m["hostPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]}
        assert mounts["/tmp/nvidia-mps"] == str(pipe)
        assert mounts["/dev/shm"] == str(node.mps_dir(GPU) / "shm")
        assert spec["devices"][0]["name"].endswith(env["DRA_GPU_0000_11_00_0_SHARE_ID"])
    # Last one out tears down; the first one leaving changes nothing.
    assert node.kubelet.unprepare([a]).claims[a.uid].error == ""
    assert len(node.pods()) == 1 and node.gpu(GPU).compute_mode == EXCLUSIVE_PROCESS
    assert node.kubelet.unprepare([b]).claims[b.uid].error == ""
    assert node.pods() == {}
    assert node.gpu(GPU).compute_mode == DEFAULT
    assert not node.mps_dir(GPU).exists()
    assert list((node.dirs.state / "devices").glob("*.json")) == []


def test_an_overcommitted_share_is_refused_naming_the_claims_there(node):
    a = new_claim(node.api, "big-a", [share(GPU, "50Gi", "50")])
    b = new_claim(node.api, "big-b", [share(GPU, "40Gi", "40")])
    assert node.kubelet.prepare([a]).claims[a.uid].error == ""
    error = node.kubelet.prepare([b]).claims[b.uid].error
    assert "default/big-b" in error and "default/big-a (50Gi, 50%)" in error and "overcommits" in error
    assert not (node.dirs.cdi / f"{DRIVER}-claim_{b.uid}.json").exists()


def test_time_slicing_sets_the_interval_and_the_last_unprepare_resets_it(node):
    claim = new_claim(node.api, "ts", [{"request": "gpu", "driver": DRIVER, "pool": "node-a",
                                         "device": GPU2}],
                      [gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    assert node.gpu(GPU2).timeslice == 3 and node.gpu(GPU2).compute_mode == DEFAULT
    assert env_of(node.spec(claim))["DRA_GPU_0000_21_00_0_SHARING"] == "TimeSlicing"
    assert node.pods() == {}
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert node.gpu(GPU2).timeslice == 0


def test_two_claims_asking_one_gpu_for_different_intervals(node):
    whole = {"memory": "81559Mi", "compute": "100"}
    a = new_claim(node.api, "long", [{**share(GPU, "1Gi", "1"), "consumedCapacity": whole}],
                  [gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})])
    b = new_claim(node.api, "short", [{**share(GPU, "1Gi", "1"), "consumedCapacity": whole}],
                  [gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}})])
    assert node.kubelet.prepare([a]).claims[a.uid].error == ""
    error = node.kubelet.prepare([b]).claims[b.uid].error
    assert "default/short" in error and "default/long" in error
    assert "interval Short" in error and "interval Long" in error
    assert node.gpu(GPU).timeslice == 3, "the first claim's setting stays"


@pytest.mark.parametrize("sharing, fragment", [
    ({"strategy": "TimeSlicing"}, "TimeSlicing cannot limit a share"),
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}, "from 1 to 100"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}, "not a quantity"),
    ({"strategy": "Spatial"}, "strategy must be one of TimeSlicing, MPS"),
    ({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}, "strategy is MPS"),
])
def test_bad_sharing_config_fails_the_claim_by_name(node, sharing, fragment):
    claim = new_claim(node.api, "bad", [share(GPU, "10Gi", "10")], [gpu_config(sharing)])
    error = node.kubelet.prepare([claim]).claims[claim.uid].error
    assert "default/bad" in error and fragment in error, error
    assert node.pods() == {}


def test_mps_server_defaults_reach_the_daemon(node):
    claim = new_claim(node.api, "mps", [{"request": "gpu", "driver": DRIVER, "pool": "node-a",
                                          "device": GPU2}],
                      [gpu_config({"strategy": "MPS", "mpsConfig": {
                          "defaultActiveThreadPercentage": 40,
                          "defaultPinnedDeviceMemoryLimit": "10Gi"}})])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    log = (node.mps_dir(GPU2) / "log" / "control.log").read_text()
    assert "set_default_active_thread_percentage 40" in log
    assert "set_default_device_pinned_mem_limit 0 10240M" in log
    assert f"CUDA_VISIBLE_DEVICES={node.uuid_of(GPU2)}" in log
    (pod,) = node.pods().values()
    assert pod["spec"]["nodeName"] == "node-a" and pod["metadata"]["namespace"] == NAMESPACE
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "mps-control-daemon"


def test_the_daemon_outlives_the_driver_and_a_restart_adopts_it(node):
    claim = new_claim(node.api, "keep", [share(GPU, "10Gi", "20")])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    (pod,) = node.pods().values()
    pid = node.runner.processes()[pod["metadata"]["name"]]
    node.driver.proc.send_signal(signal.SIGKILL)
    node.driver.proc.wait(10)
    time.sleep(0.5)
    os.kill(pid, 0)  # still running: the workloads' MPS server is not taken down
    node.restart()
    assert node.gpu(GPU).compute_mode == EXCLUSIVE_PROCESS, "a driver restart is not a GPU reset"
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    (again,) = node.pods().values()
    assert again["metadata"]["uid"] == pod["metadata"]["uid"], "adopted, not re-created"
    assert node.runner.processes()[pod["metadata"]["name"]] == pid
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert node.pods() == {}


def test_each_share_has_its_own_status_entry(node):
    first, second = share(GPU, "20Gi", "30"), share(GPU, "10Gi", "20")
    claim = new_claim(node.api, "two-shares", [first, {**second, "request": "gpu2"}])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""

    def entries() -> dict:
        with node.api.state.lock:
            found = node.api.state.claims[("default", "two-shares")].get("status", {}).get("devices", [])
        return {e.get("shareID"): e for e in found}

    node.wait(lambda: len(entries()) == 2, what="two status entries")
    for result in (first, second):
        entry = entries()[result["shareID"]]
        assert entry["device"] == GPU and entry["conditions"][0]["status"] == "True"
        assert entry["data"]["consumedCapacity"] == {
            k: quantity.canonical(v) for k, v in result["consumedCapacity"].items()}
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    node.wait(lambda: entries() == {}, what="the entries to go")


def test_a_deleted_daemon_pod_is_recreated_for_its_claims(node):
    claim = new_claim(node.api, "revive", [share(GPU, "10Gi", "20")])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    ((name, pod),) = node.pods().items()
    with node.api.state.lock:
        node.api.state.pods[(NAMESPACE, name)]["metadata"]["deletionTimestamp"] = "now"

    def replaced() -> bool:
        # By uid, not by name: the driver may delete and re-create the pod
        # between two polls, so "the name was gone for a moment" can be missed.
        again = node.pods().get(name)
        return again is not None and again["metadata"]["uid"] != pod["metadata"]["uid"]

    node.wait(replaced, what="the pod to be re-created")
    assert "deletionTimestamp" not in node.pods()[name]["metadata"]
    node.wait(lambda: (node.mps_dir(GPU) / "ready").exists(), what="the new daemon to be ready")
    node.wait(lambda: "device_setup_restored" in node.driver.log(), what="the log")


def test_an_orphan_daemon_is_stopped(node):
    with node.api.state.lock:
        node.api.state.pods[(NAMESPACE, "stray")] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "stray", "namespace": NAMESPACE, "uid": "u",
                         "labels": {"app.kubernetes.io/name": "dra-accel-driver",
                                    "app.kubernetes.io/component": "mps-control-daemon",
                                    f"{DRIVER}/node": "node-a", f"{DRIVER}/device": GPU}},
            "spec": {"nodeName": "other-node", "containers": [{"name": "c", "image": "i"}]}}
    node.wait(lambda: "stray" not in node.pods(), what="the orphan to be deleted")
    node.wait(lambda: "mps_orphan_daemon_stopped" in node.driver.log(), what="the log")


def test_sigkill_while_the_daemon_starts_leaks_nothing(node):
    claim = new_claim(node.api, "crash", [share(GPU, "10Gi", "20")])
    node.api.inject(Fault("POST", "/pods", status=0, delay=1.5))
    import threading

    thread = threading.Thread(target=lambda: _quietly(node.kubelet.prepare, [claim], timeout=5))
    thread.start()
    node.wait(lambda: list((node.dirs.state / "devices").glob("*.json")), what="the device record")
    node.driver.proc.send_signal(signal.SIGKILL)
    node.driver.proc.wait(10)
    thread.join()
    assert node.gpu(GPU).compute_mode in (DEFAULT, EXCLUSIVE_PROCESS)
    node.restart()
    # Nobody needs the half-made setup: undone, pod (created after the delay) deleted.
    node.wait(lambda: not list((node.dirs.state / "devices").glob("*.json")) and node.pods() == {},
              what="the half-made setup to be undone")
    assert node.gpu(GPU).compute_mode == DEFAULT
    # The kubelet's retry then prepares it properly, and the unprepare cleans up.
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert node.pods() == {} and node.runner.processes() == {}


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception:
        pass


def test_a_reboot_rebuilds_the_gpu_setup(node):
    """After a reboot the GPU is back in DEFAULT and the daemon's processes are gone; the
    driver applies the needed setup again without waiting for the kubelet."""
    claim = new_claim(node.api, "reboot", [share(GPU, "10Gi", "20")])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    node.kubelet.close()
    node.driver.kill()
    node.runner.__exit__(None, None, None)  # the node goes down: every pod's process ends
    (node.mock_root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text("rebooted\n")
    assert node.gpu(GPU).compute_mode == DEFAULT, "a reboot clears the compute mode"
    node.runner = PodRunner(node.api, "node-a", node.dirs.root / "pod-logs-2").__enter__()
    node.driver = DriverProcess(node.api, node.dirs, profile="h100x8", extra=MPS_ARGS).start()
    node.kubelet = node.driver.kubelet()
    node.wait(lambda: node.gpu(GPU).compute_mode == EXCLUSIVE_PROCESS and
              (node.mps_dir(GPU) / "ready").exists(), what="the setup to be rebuilt")
    state = json.loads((node.dirs.state / "devices" / f"{GPU}.json").read_text())
    assert state["boot_id"] == "rebooted"
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert node.pods() == {} and node.gpu(GPU).compute_mode == DEFAULT
    node.runner.__exit__(None, None, None)


def test_an_upgrade_keeps_the_daemon_and_the_new_instance_tears_down(node):
    """Old and new driver pod side by side (seamless upgrade): the daemon started by the old
    one is adopted by the new one, which unprepares the claims after the old one is gone."""
    claims = [new_claim(node.api, f"up-{i}", [share(GPU, "10Gi", "20")]) for i in range(2)]
    for claim in claims:
        assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    (name,) = node.pods()
    pid = node.runner.processes()[name]
    new = DriverProcess(node.api, node.dirs, profile="h100x8",
                        extra=[*MPS_ARGS, "--pod-uid", str(uuid.uuid4())]).start()
    try:
        node.wait(lambda: "plugin_serving" in new.log(), what="the new instance to serve")
        time.sleep(1.5)  # both run their sharing reconcile
        assert node.runner.processes() == {name: pid}, "nobody restarted or stopped the daemon"
        node.kubelet.close()
        node.driver.terminate()
        node.driver = new
        node.kubelet = new.kubelet()
        assert node.kubelet.unprepare([claims[0]]).claims[claims[0].uid].error == ""
        assert node.runner.processes() == {name: pid}
        assert node.kubelet.unprepare([claims[1]]).claims[claims[1].uid].error == ""
        assert node.pods() == {} and node.gpu(GPU).compute_mode == DEFAULT
    finally:
        new.kill()


def test_chaos_sigkill_at_random_points_loses_no_share_and_leaks_no_daemon(node):
    """Shares come and go on two GPUs while the driver is SIGKILLed at random moments; after
    each restart the kubelet retries what it had asked. At the end the daemons, compute
    modes and records are exactly what the prepared claims need."""
    import random
    import threading

    rng = random.Random(1234)
    prepared: dict[str, Claim] = {}
    for round_ in range(6):
        device = (GPU, GPU2)[round_ % 2]
        wanted = [new_claim(node.api, f"chaos-{round_}-{i}", [share(device, "5Gi", "10")]) for i in range(3)]
        leaving = list(prepared.values())[:2]
        work = threading.Thread(target=lambda: (_quietly(node.kubelet.prepare, wanted, timeout=30),
                                                _quietly(node.kubelet.unprepare, leaving, timeout=30)))
        work.start()
        time.sleep(rng.uniform(0.05, 1.5))
        node.driver.proc.send_signal(signal.SIGKILL)
        node.driver.proc.wait(10)
        work.join()
        node.restart()
        # The kubelet retries every call that did not answer, until one does.
        reply = node.kubelet.prepare(wanted, timeout=60)
        assert all(not reply.claims[c.uid].error for c in wanted), reply
        reply = node.kubelet.unprepare(leaving, timeout=60)
        assert all(not reply.claims[c.uid].error for c in leaving), reply
        for claim in leaving:
            prepared.pop(claim.uid)
        prepared.update({c.uid: c for c in wanted})
        _assert_sharing_matches(node, prepared)
    reply = node.kubelet.unprepare(list(prepared.values()), timeout=60)
    assert all(not e.error for e in reply.claims.values())
    _assert_sharing_matches(node, {})


def _assert_sharing_matches(node: Node, prepared: dict[str, Claim]) -> None:
    records = {p.stem: json.loads(p.read_text()) for p in (node.dirs.state / "claims").glob("*.json")}
    assert set(records) == set(prepared)
    needed = {d["device"] for r in records.values() for d in r["devices"]}
    # Orphans are stopped by the periodic reconcile (1 s here).
    def daemons():
        return {p["metadata"]["labels"][f"{DRIVER}/device"] for p in node.pods().values()}

    node.wait(lambda: daemons() == needed and len(node.runner.processes()) == len(needed),
              what=f"daemons for exactly {needed}",
              seen=lambda: f"pods for {daemons()}, processes {node.runner.processes()}, device "
                           f"states {sorted(p.stem for p in (node.dirs.state / 'devices').glob('*.json'))}")
    states = {p.stem for p in (node.dirs.state / "devices").glob("*.json")}
    assert states == needed
    for device in (GPU, GPU2):
        assert node.gpu(device).compute_mode == (EXCLUSIVE_PROCESS if device in needed else DEFAULT)


def _fstype(path: Path) -> str | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == str(path):
            return fields[2]
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI is root)")
def test_the_gpus_mps_shm_is_a_tmpfs_while_its_daemon_runs(node):
    claim = new_claim(node.api, "shm", [share(GPU, "10Gi", "20")])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    shm = node.mps_dir(GPU) / "shm"
    assert _fstype(shm) == "tmpfs", "MPS traffic must not go to the node's disk"
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert _fstype(shm) is None and not shm.exists()


def test_a_prepare_waits_for_a_new_daemon_without_holding_other_claims_up(node):
    import threading

    node.runner.start_delay = 3.0  # the daemon's image pull and container start
    shared = new_claim(node.api, "slow-daemon", [share(GPU, "10Gi", "20")])
    plain = new_claim(node.api, "plain", [{"request": "gpu", "driver": DRIVER, "pool": "node-a",
                                           "device": GPU2}])
    done: list[str] = []
    replies = {}

    def prepare(claim):
        replies[claim.name] = node.kubelet.prepare([claim]).claims[claim.uid].error
        done.append(claim.name)

    first = threading.Thread(target=prepare, args=(shared,))
    first.start()
    node.wait(lambda: "mps_daemon_wait" in node.driver.log(), what="the wait for the daemon")
    prepare(plain)  # needs the cross-process lock, which the waiting prepare let go of
    assert done == ["plain"], "the exclusive claim was held up by another claim's daemon start"
    first.join()
    assert replies == {"plain": "", "slow-daemon": ""}


def test_a_daemon_slower_than_the_wait_fails_the_claim_in_time_and_the_retry_finds_it(node):
    node.kubelet.close()
    node.driver.kill()
    node.driver = DriverProcess(node.api, node.dirs, profile="h100x8",
                                extra=[*MPS_ARGS, "--mps-start-timeout", "1"]).start()
    node.kubelet = node.driver.kubelet()
    node.runner.start_delay = 4.0
    claim = new_claim(node.api, "late", [share(GPU, "10Gi", "20")])
    error = node.kubelet.prepare([claim]).claims[claim.uid].error
    pod = next(iter(node.pods()))
    assert "default/late" in error and "did not answer within 1s" in error, error
    assert pod in error and "ContainerCreating" in error and "retries" in error, error
    # The reconcile passes (every second here) keep the setup for the kubelet's retry.
    node.wait(lambda: (node.mps_dir(GPU) / "ready").exists(), what="the daemon to answer")
    assert list(node.pods()) == [pod]
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert node.pods() == {}


def _workload_pod(api, name: str, claims: dict[str, str], uid: int | None = None,
                  containers: dict[str, list[str]] | None = None) -> None:
    """A pod of a user (not bound to the emulated node: the pod runner leaves it alone)
    that references `claims` (entry name -> ResourceClaim name)."""
    containers = containers or {"main": list(claims)}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
           "spec": {"resourceClaims": [{"name": k, "resourceClaimName": v} for k, v in claims.items()],
                    "containers": [{"name": c, "image": "busybox",
                                    "resources": {"claims": [{"name": k} for k in refs]}}
                                   for c, refs in containers.items()]}}
    if uid is not None:
        pod["spec"]["securityContext"] = {"runAsUser": uid}
    with api.state.lock:
        api.state.pods[("default", name)] = pod


def _reserve(api, claim: Claim, pod: str) -> None:
    with api.state.lock:
        stored = next(c for c in api.state.claims.values() if c["metadata"]["uid"] == claim.uid)
        stored["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": "x"}]


def test_a_share_running_as_another_uid_is_refused_naming_both_claims(node):
    a = new_claim(node.api, "as-1000", [share(GPU, "10Gi", "20")])
    b = new_claim(node.api, "as-2000", [share(GPU, "10Gi", "20")])
    c = new_claim(node.api, "also-1000", [share(GPU, "10Gi", "20")])
    for claim, pod, uid in ((a, "pa", 1000), (b, "pb", 2000), (c, "pc", 1000)):
        _workload_pod(node.api, pod, {"gpu": claim.name}, uid)
        _reserve(node.api, claim, pod)
    assert node.kubelet.prepare([a]).claims[a.uid].error == ""
    error = node.kubelet.prepare([b]).claims[b.uid].error
    assert "default/as-2000" in error and "default/as-1000" in error, error
    assert "UID 2000" in error and "one UID at a time" in error, error
    assert not (node.dirs.cdi / f"{DRIVER}-claim_{b.uid}.json").exists()
    assert node.kubelet.prepare([c]).claims[c.uid].error == "", "the same UID joins"
    records = [json.loads(p.read_text()) for p in node.dirs.state.rglob(f"{a.uid}.json")]
    (record,) = [r for r in records if r.get("state") and "devices" in r]
    assert record["run_as"] == [1000]


def test_a_container_that_needs_two_gpus_mps_daemons_is_refused(node):
    a = new_claim(node.api, "mps-one", [share(GPU, "10Gi", "20")])
    b = new_claim(node.api, "mps-two", [share(GPU2, "10Gi", "20")])
    _workload_pod(node.api, "both", {"one": a.name, "two": b.name})
    for claim in (a, b):
        _reserve(node.api, claim, "both")
    assert node.kubelet.prepare([a]).claims[a.uid].error == ""
    error = node.kubelet.prepare([b]).claims[b.uid].error
    assert "default/mps-two" in error and "both/main" in error and "default/mps-one" in error, error
    assert "one MPS control daemon" in error, error
    # In separate containers of the same pod, they are fine.
    _workload_pod(node.api, "both", {"one": a.name, "two": b.name},
                  containers={"first": ["one"], "second": ["two"]})
    assert node.kubelet.prepare([b]).claims[b.uid].error == ""


def test_a_whole_gpu_share_keeps_its_mps_config_defaults(node):
    """A claim that asked for no capacity on a consumable GPU holds all of it; its
    mpsConfig server defaults must not be overridden by client limits of the whole GPU
    (the gpu-mps-shared-claim example showed 100 and 80896M instead of 50 and 20Gi)."""
    claim = new_claim(node.api, "whole-mps", [share(GPU, "79Gi", "0")],
                      [gpu_config({"strategy": "MPS", "mpsConfig": {
                          "defaultActiveThreadPercentage": 50,
                          "defaultPinnedDeviceMemoryLimit": "20Gi"}})])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    env = env_of(node.spec(claim))
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    log = (node.mps_dir(GPU) / "log" / "control.log").read_text()
    assert "set_default_active_thread_percentage 50" in log
    assert "set_default_device_pinned_mem_limit 0 20480M" in log


def test_multi_user_mps_lets_pods_of_several_uids_share_a_gpu(node):
    """mpsConfig.multiUser (issue 38, item 6): the daemon runs with -M (one root server for
    every UID's clients), so shares running as UIDs 1000 and 2000 both prepare; a claim that
    does not ask for it cannot join that daemon, and without it mixed UIDs are still
    refused (test_a_share_running_as_another_uid_is_refused_naming_both_claims)."""
    multi = [gpu_config({"strategy": "MPS", "mpsConfig": {"multiUser": True}})]
    a = new_claim(node.api, "multi-1000", [share(GPU, "10Gi", "20")], multi)
    b = new_claim(node.api, "multi-2000", [share(GPU, "10Gi", "20")], multi)
    single = new_claim(node.api, "single-1000", [share(GPU, "10Gi", "20")])
    for claim, pod, uid in ((a, "pa", 1000), (b, "pb", 2000), (single, "ps", 1000)):
        _workload_pod(node.api, pod, {"gpu": claim.name}, uid)
        _reserve(node.api, claim, pod)
    assert node.kubelet.prepare([a]).claims[a.uid].error == ""
    assert node.kubelet.prepare([b]).claims[b.uid].error == "", "another UID joins under -M"
    log = (node.mps_dir(GPU) / "log" / "control.log").read_text()
    assert "multi-user mode on" in log, log
    (daemon,) = [p for p in node.pods().values() if p["metadata"].get("namespace") == NAMESPACE]
    assert "--multi-user" in daemon["spec"]["containers"][0]["command"]
    error = node.kubelet.prepare([single]).claims[single.uid].error
    assert "default/single-1000" in error and "multiUser=true" in error, error
    for claim in (a, b):
        assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert not [p for p in node.pods().values() if p["metadata"].get("namespace") == NAMESPACE]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI is root)")
def test_the_mps_shm_tmpfs_has_the_size_asked_for(node):
    """Issue 38, item 10(b): the tmpfs gets an explicit size (--mps-shm-size), not the
    kernel's default of half the node's memory."""
    node.kubelet.close()
    node.driver.kill()
    node.driver = DriverProcess(node.api, node.dirs, profile="h100x8",
                                extra=[*MPS_ARGS, "--mps-shm-size", "64Mi"]).start()
    node.kubelet = node.driver.kubelet()
    claim = new_claim(node.api, "sized", [share(GPU, "10Gi", "20")])
    assert node.kubelet.prepare([claim]).claims[claim.uid].error == ""
    shm = str(node.mps_dir(GPU) / "shm")
    (options,) = [line.split()[3] for line in Path("/proc/self/mounts").read_text().splitlines()
                  if line.split()[1] == shm]
    assert "size=65536k" in options.split(","), options
    assert node.kubelet.unprepare([claim]).claims[claim.uid].error == ""
