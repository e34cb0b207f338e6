"""ResourceClaim status.devices (KEP-4817): written by the real driver process with
server-side apply, checked by the API emulator as the real server checks it."""

from __future__ import annotations

import json
import time

import pytest

from driver.sim import claimstatus as server
from driver.sim.apiserver import ApiServer, Fault
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_plugin_integration import FPGA, GPU, NIC, new_claim, opaque, result

OTHER = "gpu.example.com"


@pytest.fixture
def env():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        yield api, driver, kubelet
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def devices(api, claim) -> list[dict]:
    with api.state.lock:
        return json.loads(json.dumps((api.state.claims[(claim.namespace, claim.name)].get("status") or {})
                                     .get("devices") or []))


def wait(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ours(api, claim) -> dict[str, dict]:
    return {d["device"]: d for d in devices(api, claim) if d["driver"] == DRIVER}


def test_prepare_writes_ready_entries_and_unprepare_removes_them(env):
    api, driver, kubelet = env
    claim = new_claim(api, "train", [result("gpu", GPU), result("nic", NIC), result("fpga", FPGA)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    entries = wait(lambda: len(ours(api, claim)) == 3 and ours(api, claim), "three entries")
    gpu = entries[GPU]
    assert gpu["pool"] == "node-a" and "shareID" not in gpu
    (ready,) = gpu["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    assert ready["message"] == f"CDI device {DRIVER}/claim={claim.uid}-{GPU}"
    assert gpu["data"]["type"] == "gpu" and gpu["data"]["uuid"].startswith("GPU-")
    assert gpu["data"]["pciBusID"] == "0000:11:00.0" and "networkData" not in gpu
    assert entries[FPGA]["data"]["type"] == "fpga"
    # The NIC: its interface as the pod sees it (not moved: the host's name), the host
    # interface's addresses, and the MAC the mock node gave it.
    nic = entries[NIC]
    mac = (driver.dirs.state / "mock" / "sys" / "class" / "net" / "enp18s0f0" / "address").read_text().strip()
    assert nic["networkData"] == {"interfaceName": "enp18s0f0", "hardwareAddress": mac,
                                  "ips": ["10.100.0.2/24", "fd00::2/64"]}
    assert nic["data"]["ifName"] == "enp18s0f0"
    assert server.validate(api.state.claims[(claim.namespace, claim.name)], list(entries.values())) == []
    # The kubelet repeats a prepare: the same state is not written again (the condition
    # keeps its lastTransitionTime, the claim its resourceVersion).
    version = api.state.claims[(claim.namespace, claim.name)]["metadata"]["resourceVersion"]
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    time.sleep(1.0)
    assert api.state.claims[(claim.namespace, claim.name)]["metadata"]["resourceVersion"] == version
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    wait(lambda: devices(api, claim) == [], "the entries to go")


def test_a_moved_interface_reports_its_pod_name_and_no_host_address(env):
    api, _, kubelet = env
    config = [opaque(["nic"], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "NicConfig",
                               "moveInterface": True, "interfaceName": "net1"})]
    claim = new_claim(api, "moved", [result("nic", NIC)], config)
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    nic = wait(lambda: ours(api, claim).get(NIC), "the NIC entry")
    assert nic["networkData"]["interfaceName"] == "net1" and "ips" not in nic["networkData"]


def test_another_drivers_entry_in_the_same_claim_is_left_alone(env):
    api, _, kubelet = env
    claim = new_claim(api, "mixed", [result("gpu", GPU), result("x", "x0", pool="node-a", driver=OTHER)])
    theirs = {"driver": OTHER, "pool": "node-a", "device": "x0", "data": {"mine": True}}
    with api.state.lock:  # the other driver applied its entry under its own field manager
        server.apply(api.state.claims[("default", "mixed")], api.state.status_owners.setdefault(
            ("default", "mixed"), {}), {"status": {"devices": [theirs]}}, OTHER, True,
            server.APPLY_CONTENT_TYPE)
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    wait(lambda: GPU in ours(api, claim), "our entry")
    assert theirs in devices(api, claim)
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    wait(lambda: GPU not in ours(api, claim), "our entry to go")
    assert devices(api, claim) == [theirs]


def test_a_failed_prepare_reports_why_in_the_ready_condition(env):
    api, _, kubelet = env
    blocker = new_claim(api, "first", [result("gpu", GPU)])
    assert kubelet.prepare([blocker]).claims[blocker.uid].error == ""
    claim = new_claim(api, "second", [result("gpu", GPU)])
    error = kubelet.prepare([claim]).claims[claim.uid].error
    assert "already prepared for claim default/first" in error
    entry = wait(lambda: ours(api, claim).get(GPU), "the failed entry")
    (ready,) = entry["conditions"]
    assert (ready["status"], ready["reason"]) == ("False", "PrepareFailed")
    assert ready["message"] == error


def test_a_rejected_status_write_is_retried_and_never_fails_the_prepare(env):
    api, driver, kubelet = env
    api.inject(Fault("PATCH", r"/resourceclaims/[^/]+/status$", status=403, times=2))
    claim = new_claim(api, "denied", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    wait(lambda: GPU in ours(api, claim), "the entry after two refusals")
    assert driver.log().count('"claim_status_write_failed"') == 2


def test_failed_writes_are_counted_in_the_metric(tmp_path):
    from driver.prepare.claimstatus import DeviceStatus, StatusWriter
    from driver.prepare.claims import ClaimRef
    from driver.kube.client import Kube, api_client
    from driver.metrics import Metrics
    from driver.sim.apiserver import claim_allocated

    metrics = Metrics(DRIVER)
    with ApiServer() as api:
        api.put_claim(claim_allocated("default", "c", "u-1", [result("gpu", GPU)]))
        api.inject(Fault("PATCH", r"/status$", status=500, times=3))
        writer = StatusWriter(Kube(api_client(api.kubeconfig(tmp_path))), DRIVER,
                              on_failure=metrics.status_write_failures.inc)
        writer.publish(ClaimRef("default", "c", "u-1"),
                       [DeviceStatus("node-a", GPU, None, True, "Prepared")])
        assert writer.wait_idle(20)
        writer.close()
        assert [d["device"] for d in api.state.claims[("default", "c")]["status"]["devices"]] == [GPU]
    value = metrics.registry.get_sample_value("dra_driver_claim_status_write_failures_total")
    assert value == 3


def test_a_recreated_claim_is_not_written(env):
    api, driver, kubelet = env
    claim = new_claim(api, "again", [result("gpu", GPU)])
    api.inject(Fault("PATCH", r"/status$", status=0, delay=1.0))
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    with api.state.lock:  # deleted and re-created under the same name meanwhile
        api.state.claims[("default", "again")]["metadata"]["uid"] = "another-uid"
    wait(lambda: "claim_status_claim_recreated" in driver.log(), "the write to be dropped")
    assert devices(api, claim) == []


# -- the emulator is as strict as the server ---------------------------------------------------------
def _claim() -> dict:
    return {"metadata": {"name": "c", "namespace": "default", "uid": "u"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": DRIVER, "pool": "p", "device": "d"}]}}}}


def _entry(**extra) -> dict:
    return {"driver": DRIVER, "pool": "p", "device": "d", **extra}


@pytest.mark.parametrize("entry, message", [
    (_entry(device="other"), "must be an allocated device in the claim"),
    (_entry(conditions=[{"type": "Ready", "status": "True", "reason": "bad reason",
                         "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]), "reason: Invalid value"),
    (_entry(conditions=[{"type": "Ready", "status": "Yes", "reason": "R", "message": "",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]), "status: Unsupported value"),
    (_entry(conditions=[{"type": "Ready", "status": "True", "reason": "R", "message": ""}]),
     "lastTransitionTime: Required value"),
    (_entry(data={"x": "y" * 11000}), "data: Too long"),
    (_entry(networkData={"ips": ["10.0.0.1"]}), "must be a valid address in CIDR form"),
    (_entry(networkData={"ips": ["10.0.0.1/24", "10.0.0.1/24"]}), "ips: Duplicate value"),
    (_entry(networkData={"interfaceName": "x" * 257}), "interfaceName: Too long"),
])
def test_the_emulator_rejects_what_the_server_rejects(entry, message):
    with pytest.raises(server.ApplyError) as raised:
        server.apply(_claim(), {}, {"status": {"devices": [entry]}}, DRIVER, True, server.APPLY_CONTENT_TYPE)
    assert raised.value.code == 422 and message in raised.value.message


def test_the_emulator_needs_apply_a_field_manager_and_the_right_uid():
    for args, code in [
        (({"status": {}}, DRIVER, True, "application/merge-patch+json"), 415),
        (({"status": {}}, None, True, server.APPLY_CONTENT_TYPE), 400),
        (({"metadata": {"uid": "other"}, "status": {}}, DRIVER, True, server.APPLY_CONTENT_TYPE), 409),
    ]:
        with pytest.raises(server.ApplyError) as raised:
            server.apply(_claim(), {}, *args)
        assert raised.value.code == code
    # Another manager's entry is a conflict without force.
    claim, owners = _claim(), {}
    server.apply(claim, owners, {"status": {"devices": [_entry()]}}, OTHER, True, server.APPLY_CONTENT_TYPE)
    with pytest.raises(server.ApplyError) as raised:
        server.apply(claim, owners, {"status": {"devices": [_entry()]}}, DRIVER, False, server.APPLY_CONTENT_TYPE)
    assert raised.value.code == 409


def test_claim_status_can_be_turned_off():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, extra=["--claim-status", "false"]).start()
        kubelet = driver.kubelet()
        try:
            claim = new_claim(api, "quiet", [result("gpu", GPU)])
            assert kubelet.prepare([claim]).claims[claim.uid].error == ""
            time.sleep(1.0)
            assert devices(api, claim) == []
            assert not any(a[2] == "resourceclaims/status" for a in api.state.access)
        finally:
            kubelet.close()
            driver.kill()
    dirs.cleanup()


def test_an_overlay_change_while_the_first_write_is_in_flight_is_written_after_it():
    """The NIC moved into the pod while prepare's first status write was on the wire: the
    writer had neither a pending nor a written state for the claim, the overlay found
    nothing to build on and NetworkReady was never written (seen on the cluster tier)."""
    import threading

    from driver.nri.netdev import NetworkData
    from driver.nri.status import NetworkConditions
    from driver.prepare.claimstatus import DeviceStatus, StatusWriter
    from driver.prepare.claims import ClaimRef

    on_the_wire, release = threading.Event(), threading.Event()
    bodies: list[dict] = []

    class SlowKube:
        def resource_version(self) -> str:
            return "v1"

        def request(self, method, path, query=None, body=None, content_type=None):
            if method == "GET":  # read_back: the server has no status yet
                return {"metadata": {"uid": "u-1"}, "status": {}}
            bodies.append(json.loads(body))
            if len(bodies) == 1:
                on_the_wire.set()
                assert release.wait(10)
            return {}

    writer = StatusWriter(SlowKube(), DRIVER)
    conditions = NetworkConditions(writer)
    ref = ClaimRef("ml", "vf", "u-1")
    writer.publish(ref, [DeviceStatus("node-a", NIC, None, True, "Prepared", "", {"type": "nic"},
                                      {"interfaceName": "net1"})])
    assert on_the_wire.wait(10)
    conditions.moved(ref, "node-a", NIC, NetworkData("net1", ("10.1.0.5/24",), "02:00:00:00:00:01"), "ml/p")
    release.set()
    assert writer.wait_idle(10)
    writer.close()
    assert len(bodies) == 2, bodies
    (entry,) = bodies[-1]["status"]["devices"]
    assert {c["type"] for c in entry["conditions"]} == {"Ready", "NetworkReady"}
    assert entry["networkData"]["ips"] == ["10.1.0.5/24"]


def test_a_nic_attached_again_in_the_same_pod_costs_no_status_write():
    """CreateContainer tries the move again for every container of the pod; a NIC already
    in place must keep its NetworkReady condition (and transition time) as it was."""
    from driver.nri.netdev import NetworkData
    from driver.nri.status import NetworkConditions
    from driver.prepare.claimstatus import DeviceStatus, StatusWriter
    from driver.prepare.claims import ClaimRef

    bodies: list[dict] = []

    class Kube:
        def resource_version(self) -> str:
            return "v1"

        def request(self, method, path, query=None, body=None, content_type=None):
            if method == "GET":
                return {"metadata": {"uid": "u-2"}, "status": {}}
            bodies.append(json.loads(body))
            return {}

    writer = StatusWriter(Kube(), DRIVER)
    conditions = NetworkConditions(writer)
    ref = ClaimRef("ml", "vf", "u-2")
    writer.publish(ref, [DeviceStatus("node-a", NIC, None, True, "Prepared", "", {"type": "nic"},
                                      {"interfaceName": "net1"})])
    data = NetworkData("net1", ("10.1.0.5/24",), "02:00:00:00:00:01")
    conditions.moved(ref, "node-a", NIC, data, "ml/p")
    assert writer.wait_idle(10)
    written = len(bodies)
    for _ in range(3):  # three more containers of the pod
        conditions.moved(ref, "node-a", NIC, data, "ml/p")
    assert writer.wait_idle(10)
    writer.close()
    assert len(bodies) == written, bodies[written:]


def test_a_burst_of_claims_is_written_several_at_a_time_and_each_claim_in_order():
    """A node's burst (64 pods at once) was 64 applies one after another on one thread:
    ~5 ms each against a real API server, the last claim's status ~0.35 s after the
    first. Now WRITERS claims are written at once, never more, and a newer state of a
    claim whose write is on the wire waits for it (states land in order)."""
    import threading

    from driver.prepare.claimstatus import WRITERS, DeviceStatus, StatusWriter
    from driver.prepare.claims import ClaimRef

    lock, release = threading.Lock(), threading.Event()
    on_the_wire: list[str] = []
    most, same_claim_twice = 0, []
    written: list[tuple[str, bool]] = []

    class HeldKube:
        def resource_version(self) -> str:
            return "v1"

        def request(self, method, path, query=None, body=None, content_type=None):
            nonlocal most
            with lock:
                if path in on_the_wire:
                    same_claim_twice.append(path)
                on_the_wire.append(path)
                most = max(most, len(on_the_wire))
            assert release.wait(10)
            with lock:
                on_the_wire.remove(path)
                ready = json.loads(body)["status"]["devices"][0]["conditions"][0]["status"]
                written.append((path.split("/")[-2], ready == "True"))
            return {}

    writer = StatusWriter(HeldKube(), DRIVER)
    refs = [ClaimRef("ml", f"c{i}", f"u-{i}") for i in range(WRITERS + 4)]
    for ref in refs:
        writer.publish(ref, [DeviceStatus("node-a", GPU, None, True, "Prepared")])
    try:
        wait(lambda: most >= WRITERS, f"{WRITERS} writes on the wire at once", timeout=5)
        with lock:
            first = next(p.split("/")[-2] for p in on_the_wire)
        # a newer state of a claim on the wire: written after the first, not beside it
        writer.publish(next(r for r in refs if r.name == first),
                       [DeviceStatus("node-a", GPU, None, False, "PrepareFailed", "gone")])
        time.sleep(DELAY_AND_A_BIT)
    finally:
        release.set()
    assert writer.wait_idle(10)
    writer.close()
    assert most == WRITERS, most
    assert same_claim_twice == []
    assert len(written) == len(refs) + 1
    assert [ready for name, ready in written if name == first] == [True, False]


DELAY_AND_A_BIT = 0.4  # the writer's DELAY (0.2 s) and then some


class _RecordingKube:
    """Answers every status apply at once and notes when each arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def resource_version(self) -> str:
        return "v1"

    def request(self, method, path, query=None, body=None, content_type=None):
        self.times.append(time.monotonic())
        return {}


@pytest.fixture
def recording_writer(monkeypatch):
    """make(delay) -> a StatusWriter with the given DELAY, writing to a _RecordingKube."""
    from driver.prepare import claimstatus

    made = []

    def make(delay: float):
        monkeypatch.setattr(claimstatus, "DELAY", delay)
        kube = _RecordingKube()
        made.append(claimstatus.StatusWriter(kube, DRIVER))
        return made[-1], kube

    yield make
    for writer in made:
        writer.close()


def _ready(writer, name: str = "c1") -> None:
    from driver.prepare.claimstatus import DeviceStatus
    from driver.prepare.claims import ClaimRef

    writer.publish(ClaimRef("ml", name, f"u-{name}"), [DeviceStatus("node-a", GPU, None, True, "Prepared")])


def test_a_burst_s_status_writes_go_when_its_last_claim_is_done(recording_writer):
    """A fixed DELAY after each claim put a 64-pod burst's last status ~0.45 s after its
    start against ~0.15 s for the same API calls alone: a state now waits for the claims
    in hand, not for the clock (DELAY stays its bound)."""
    writer, kube = recording_writer(30.0)  # far beyond what the test waits
    with writer.in_hand():
        with writer.in_hand():
            _ready(writer)
        time.sleep(0.3)
        assert kube.times == [], "written while another claim of the burst was in hand"
        released = time.monotonic()
    assert writer.wait_idle(5)
    (written,) = kube.times
    assert written - released < 2


def test_a_state_known_with_no_claim_in_hand_is_written_at_once(recording_writer):
    writer, kube = recording_writer(30.0)
    _ready(writer)
    assert writer.wait_idle(5)
    assert len(kube.times) == 1


def test_a_long_burst_holds_a_state_back_no_longer_than_delay(recording_writer):
    """A claim that takes seconds (an FPGA programmed, an MPS daemon started) must not hold
    back the status of the claims prepared beside it."""
    writer, kube = recording_writer(0.3)
    with writer.in_hand():
        with writer.in_hand():
            _ready(writer)
        assert writer.wait_idle(5), "still waiting for the slow claim beside it"
        assert len(kube.times) == 1


def test_the_preparer_holds_each_claim_in_hand_while_it_publishes_its_state(tmp_path):
    """The burst trigger needs the preparer to say which claims it has in hand: the Ready
    state of a real prepare is published while that claim is in hand, and none is after."""
    import asyncio

    from driver.prepare import cdi
    from driver.state.checkpoint import Checkpoint
    from driver.prepare.claims import ClaimRef
    from driver.prepare.claimstatus import StatusWriter
    from driver.prepare.preparer import Preparer
    from driver.state.instance import Instance
    from driver.state.locks import ProcessLock
    from tests.conftest import discover_profile

    node, found = discover_profile("mixed", tmp_path / "m")
    instance = Instance.register(tmp_path / "state", None)
    in_hand: list[int] = []

    class Status(StatusWriter):
        def publish(self, ref, devices):
            in_hand.append(self._in_hand)

    class Reader:
        async def read(self, ref):
            return {"metadata": {"uid": ref.uid}, "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": DRIVER, "pool": "n", "device": GPU}]}}}}

    status = Status(_RecordingKube(), DRIVER)
    preparer = Preparer(driver=DRIVER, pool="n", inventory=lambda: found.inventory, claims=Reader(),
                        cdi_writer=cdi.CdiWriter(tmp_path / "cdi", DRIVER, instance),
                        checkpoint=Checkpoint(tmp_path / "state", instance), boot_id="b", dev_root=node.dev,
                        process_lock=ProcessLock(tmp_path / "lock"), status=status)
    try:
        claim = ClaimRef("ml", "c1", "0a-1")
        assert asyncio.run(preparer.prepare([claim]))[claim.uid].error == ""
        assert in_hand == [1] and status._in_hand == 0
    finally:
        preparer.committer.close()
        status.close()
