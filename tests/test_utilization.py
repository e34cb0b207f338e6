"""Utilization and idle claims (driver/monitoring/utilization/): the fake NVML library's scripted load
read through the real nvidia-ml-py, the sampler, metrics joined with claims, idle timers
across restarts, one Event per idle period, the Idle condition, and `dra-driver status`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from driver.monitoring import devicemetrics
from driver.state.checkpoint import ClaimRecord, PreparedDevice, State
from driver.devices.discovery import discover
from driver.devices.mock import load as load_profile
from driver.devices.mock import tree
from driver.kube.client import ApiError
from driver.metrics import Metrics
from driver.sim import events as server_events
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import FakeKubelet
from driver.monitoring.utilization.idle import Holder, IdleTracker, is_idle
from driver.monitoring.utilization.monitor import DeviceView, UtilizationMonitor, duration
from driver.monitoring.utilization.sampler import Sample, Sampler
from driver.devices.model import DeviceKind
from tests.driverproc import DRIVER, DriverDirs
from tests.inprocess import InProcessPlugin
from tests.test_claim_status import ours, wait
from tests.test_plugin_integration import GPU, GPU2, new_claim, result
from tests.test_sysread import open_descriptors

REPO = Path(__file__).resolve().parent.parent

GIB = 1 << 30


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Events:
    """Stands in for the API server's events endpoint: what was posted, or an error."""

    def __init__(self) -> None:
        self.posted = []
        self.error: ApiError | None = None

    def post(self, event, when=None) -> None:
        if self.error is not None:
            raise self.error
        self.posted.append(event)


def node_of(tmp_path: Path, profile: str = "mixed"):
    node = tree.build(load_profile(profile), tmp_path / "mock")
    inventory = discover(node.sources()).inventory
    return node, inventory


def record(uid: str, device: str, name: str = "train", share: str | None = None,
           admin: bool = False) -> ClaimRecord:
    return ClaimRecord(uid, "team-a", name, State.PREPARE_COMPLETED, "boot",
                       (PreparedDevice("gpu", "node-a", device, (f"{DRIVER}/claim={uid}",),
                                       share_id=share, admin_access=admin),))


def series(metrics: Metrics, name: str) -> dict[tuple, float]:
    """{(device, claim_uid, share): value} of one family."""
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name == f"dra_driver_device_{name}":
                found[(s.labels["device"], s.labels["claim_uid"], s.labels["share"])] = s.value
    return found


# -- the fake library, through nvidia-ml-py ----------------------------------------------------
def test_scripted_load_reads_back_through_nvidia_ml_py(tmp_path):
    node, _ = node_of(tmp_path)
    nv, library = node.nvml, node.library
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        uuid = library.gpus[0].uuid
        assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []  # the count-0 SUCCESS path
        library.loads.set(uuid, sm_percent=87, processes=[(4242, 3 * GIB), (4243, GIB)])
        assert nv.nvmlDeviceGetUtilizationRates(handle).gpu == 87
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)  # INSUFFICIENT_SIZE, then the list
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 3 * GIB), (4243, GIB)]
        assert nv.nvmlDeviceGetMemoryInfo(handle).used == 4 * GIB
        assert nv.nvmlDeviceGetPowerUsage(handle) == 70_000 + 3_000 * 87
        kind, samples = nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
        assert kind == nv.NVML_VALUE_TYPE_UNSIGNED_INT and 1 <= len(samples) <= 120
        # NVML: nothing newer than lastSeenTimeStamp is an error, not an empty list.
        with pytest.raises(nv.NVMLError_NotFound):
            nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES,
                                    samples[-1].timeStamp + 10_000_000)
    finally:
        nv.nvmlShutdown()
    assert library.errors == []


def test_mig_devices_and_gpus_in_mig_mode_have_no_utilization_counter(tmp_path):
    node, inventory = node_of(tmp_path, "a100-mig")
    nv, library = node.nvml, node.library
    mig = next(d for d in inventory.devices if d.kind is DeviceKind.MIG)
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(mig.attributes["uuid"])
        with pytest.raises(nv.NVMLError_NotSupported):
            nv.nvmlDeviceGetUtilizationRates(handle)
        parent = nv.nvmlDeviceGetHandleByUUID(mig.attributes["parentUUID"])
        with pytest.raises(nv.NVMLError_NotSupported):
            nv.nvmlDeviceGetSamples(parent, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
        library.loads.set(mig.attributes["uuid"], processes=[(77, 2 * GIB)])
        (proc,) = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        assert proc.pid == 77 and proc.gpuInstanceId == mig.attributes["gpuInstanceID"]
        # The parent's list has its MIG devices' processes, each naming its instance.
        assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(parent)] == [77]
    finally:
        nv.nvmlShutdown()
    sample = Sampler(nv, node.sysfs, lambda: inventory).sample()[mig.name]
    assert sample.utilization is None and sample.processes == 1 and sample.memory_used == 2 * GIB
    assert is_idle(sample, 0.05) is False
    library.loads.set(mig.attributes["uuid"], processes=[])
    assert is_idle(Sampler(nv, node.sysfs, lambda: inventory).sample()[mig.name], 0.05) is True


def test_a_burst_between_two_samples_is_seen(tmp_path):
    node, inventory = node_of(tmp_path)
    sampler = Sampler(node.nvml, node.sysfs, lambda: inventory)
    try:
        first = sampler.sample()[GPU]
        assert first.peak == 0.0 and first.utilization == 0.0 and first.processes == 0
        uuid = inventory.get(GPU).attributes["uuid"]
        node.library.loads.set(uuid, sm_percent=90)
        time.sleep(0.4)
        node.library.loads.set(uuid, sm_percent=0)
        time.sleep(0.2)
        second = sampler.sample()[GPU]
        # The last period alone (what nvmlDeviceGetUtilizationRates says) is 0%; the
        # samples since the previous read hold the burst.
        assert second.peak == 0.9 and 0 < second.utilization < 0.9
        assert is_idle(second, 0.05) is False
    finally:
        sampler.close()


def test_nic_counters_come_from_sysfs(tmp_path):
    node, inventory = node_of(tmp_path)
    nic = next(d for d in inventory.devices if d.kind is DeviceKind.NIC)
    stats = node.sysfs / "class" / "net" / nic.attributes["ifName"] / "statistics"
    (stats / "rx_bytes").write_text("123456\n")
    (stats / "tx_bytes").write_text("789\n")
    sample = Sampler(node.nvml, node.sysfs, lambda: inventory).sample()[nic.name]
    assert (sample.rx_bytes, sample.tx_bytes) == (123456, 789)


def test_nic_counters_are_read_when_metrics_are_scraped_not_every_tick(tmp_path):
    """The tick samples what idle detection judges (GPUs); a scrape reads every NIC's
    counters then, so it shows them as they are at the scrape."""
    node, inventory = node_of(tmp_path)
    nics = [d for d in inventory.devices if d.kind is DeviceKind.NIC]
    nic = nics[0]
    stats = node.sysfs / "class" / "net" / nic.attributes["ifName"] / "statistics"
    sampler = Sampler(node.nvml, node.sysfs, lambda: inventory)
    monitor = UtilizationMonitor(sampler, IdleTracker(tmp_path / "state", "me", 0.05, 1800),
                                 lambda: [record("uid-n", nic.name)], "node-a")
    metrics = Metrics(DRIVER)
    metrics.watch_utilization(devicemetrics.DeviceSeries(monitor.views, metrics.driver))
    try:
        assert series(metrics, "allocated") == {}, "nothing to show before the first tick"
        (stats / "rx_bytes").write_text("1000\n")
        before = open_descriptors(tmp_path)
        monitor.tick()
        monitor.tick()
        assert open_descriptors(tmp_path) == before, "a tick opened NIC counter files"
        (stats / "rx_bytes").write_text("5000\n")  # after the ticks: the scrape must see it
        (stats / "tx_bytes").write_text("7\n")
        assert series(metrics, "network_receive_bytes_total")[(nic.name, "uid-n", "")] == 5000
        assert series(metrics, "network_transmit_bytes_total")[(nic.name, "uid-n", "")] == 7
        assert open_descriptors(tmp_path) == before + 2 * len(nics), "the scrape keeps the counters open"
        (stats / "rx_bytes").write_text("9000\n")  # in place, as the kernel changes it
        assert series(metrics, "network_receive_bytes_total")[(nic.name, "uid-n", "")] == 9000
        allocated = series(metrics, "allocated")
        assert allocated[(nic.name, "uid-n", "")] == 1
        assert {d for d, _, _ in allocated} == {d.name for d in inventory.devices}, \
            "every device has a series, held or not"
    finally:
        sampler.close()
    assert open_descriptors(tmp_path) == before
    # A scrape after the sampler closed (the driver stopping) still answers, holding nothing.
    assert series(metrics, "network_receive_bytes_total")[(nic.name, "uid-n", "")] == 9000
    assert open_descriptors(tmp_path) == before


# -- metrics joined with claims ---------------------------------------------------------------
def monitored(tmp_path):
    """The mixed node with three claims (one whole GPU, two shares of the other), its
    monitor sampled once, and the metrics that show it."""
    node, inventory = node_of(tmp_path)
    records = [record("uid-a", GPU), record("uid-b", GPU2, "infer", share="s1"),
               record("uid-c", GPU2, "infer-2", share="s2")]
    clock = Clock()
    monitor = UtilizationMonitor(Sampler(node.nvml, node.sysfs, lambda: inventory),
                                 IdleTracker(tmp_path / "state", "me", 0.05, 1800),
                                 lambda: records, "node-a", clock=clock)
    metrics = Metrics(DRIVER)
    metrics.watch_utilization(devicemetrics.DeviceSeries(monitor.views, metrics.driver))
    monitor.tick()
    return node, inventory, records, clock, monitor, metrics


def test_metrics_carry_the_claim_of_each_device_and_its_series_go_with_it(tmp_path):
    node, inventory, records, clock, monitor, metrics = monitored(tmp_path)
    node.library.loads.set(inventory.get(GPU).attributes["uuid"], sm_percent=40,
                           processes=[(1, 10 * GIB)])
    time.sleep(0.5)  # three NVML sample periods
    monitor.tick()
    allocated = series(metrics, "allocated")
    assert allocated[(GPU, "uid-a", "")] == 1
    assert allocated[(GPU2, "uid-b", "s1")] == 1 and allocated[(GPU2, "uid-c", "s2")] == 1
    free = [k for k, v in allocated.items() if v == 0]
    assert free and all(uid == "" for _, uid, _ in free), "free devices: one series, no claim"
    assert 0.2 <= series(metrics, "kernel_active_ratio")[(GPU, "uid-a", "")] <= 0.4
    assert series(metrics, "kernel_active_peak_ratio")[(GPU, "uid-a", "")] == 0.4
    # The deprecated names carry the same values for one release.
    assert series(metrics, "utilization_ratio") == series(metrics, "kernel_active_ratio")
    assert series(metrics, "utilization_peak_ratio") == series(metrics, "kernel_active_peak_ratio")
    assert series(metrics, "memory_used_bytes")[(GPU, "uid-a", "")] == 10 * GIB
    assert series(metrics, "compute_processes")[(GPU, "uid-a", "")] == 1
    assert series(metrics, "power_watts")[(GPU, "uid-a", "")] == 70 + 3 * 40
    # GPU2 is idle: both shares' timers run; GPU is busy.
    clock.now += 60
    monitor.tick()
    idle = series(metrics, "idle_seconds")
    assert idle[(GPU, "uid-a", "")] == 0
    assert idle[(GPU2, "uid-b", "s1")] == 60 and idle[(GPU2, "uid-c", "s2")] == 60
    # A claim unprepared: its series go; the device left with nobody gets the free series.
    records[:] = [record("uid-b", GPU2, "infer", share="s1")]
    monitor.tick()
    allocated = series(metrics, "allocated")
    assert not any(uid in ("uid-a", "uid-c") for _, uid, _ in allocated)
    assert allocated[(GPU, "", "")] == 0
    assert len([k for k in allocated if k[0] == GPU2]) == 1


def by_the_library(views, driver: str = "") -> bytes:
    """The same series as prometheus_client writes them: the reference for our exposition."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families = {f: (CounterMetricFamily if f.counter else GaugeMetricFamily)(
        f"dra_driver_device_{f.name}", f.help, labels=list(devicemetrics.LABELS))
        for f in devicemetrics.FAMILIES}
    for family, labels, value in devicemetrics.rows(views, driver):
        families[family].add_metric(list(labels), value)

    class Families:
        def collect(self):
            return iter(families.values())

    return generate_latest(Families())


def test_device_series_are_written_as_prometheus_client_writes_them(tmp_path):
    """Our exposition of the per-device series is byte for byte the library's, on a node
    with shared GPUs, NICs and free devices, after claims come and go (the label texts kept
    between scrapes), and with label values that need escaping."""
    node, inventory, records, clock, monitor, metrics = monitored(tmp_path)
    node.library.loads.set(inventory.get(GPU).attributes["uuid"], sm_percent=40, processes=[(1, 10 * GIB)])
    clock.now += 60
    monitor.tick()
    kinds = {line.split('kind="')[1].split('"')[0] for line in metrics.devices.render().decode().splitlines()
             if 'kind="' in line}
    assert kinds >= {"gpu", "nic", "fpga"}, kinds
    for step in range(3):
        views = monitor.views()
        assert metrics.devices.render() == by_the_library(views, DRIVER), f"step {step}"
        records[:] = records[1:]  # a claim leaves: its series go, its device's free one comes
        monitor.tick()
    assert len(metrics.devices._labels) == len(set((l) for _, l, _ in devicemetrics.rows(monitor.views(), DRIVER)))

    odd = Holder("uid-odd", 'ns"x', "back\\slash\nnew line", share="s")
    views = [DeviceView(idle_sample(GPU, busy=True), (odd,), {"uid-odd": 1.5})]
    assert devicemetrics.DeviceSeries(lambda: views).render() == by_the_library(views)
    exposed = metrics.exposition().decode()
    assert exposed.startswith(generate_latest(metrics.registry).decode())
    names = [f.name for f in text_string_to_metric_families(exposed)]
    assert len(names) == len(set(names)) and "dra_driver_device_network_receive_bytes" in names


# -- idle periods: across restarts, one Event each, none for admin access ---------------------
def idle_sample(device: str, busy: bool = False, at: float = 0.0) -> Sample:
    value = 0.5 if busy else 0.0
    return Sample(device, DeviceKind.GPU, at, value, value, 312 << 20, 80 * GIB, 70.0, 1)


def test_idle_timer_survives_a_restart_and_each_period_is_reported_once(tmp_path):
    state = tmp_path / "state"
    clock = Clock()
    held = {GPU: [record("uid-a", GPU)]}
    from driver.monitoring.utilization.monitor import holders_of

    holders = holders_of(held[GPU])
    tracker = IdleTracker(state, "me", 0.05, 1800)
    assert tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders).due == []
    clock.now += 1000
    assert tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders).due == []
    # The driver restarts: the timer goes on from the file.
    tracker = IdleTracker(state, "me", 0.05, 1800)
    assert tracker.idle_for(GPU, "uid-a", clock.now) == 1000
    clock.now += 800
    (due,) = tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders).due
    assert (due.device, due.claim_uid, clock.now - due.since) == (GPU, "uid-a", 1800)
    tracker.reported(due)
    # Reported: not again, also after another restart.
    tracker = IdleTracker(state, "me", 0.05, 1800)
    clock.now += 600
    assert tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders).due == []
    # Busy again: the period ends (its Idle condition is cleared) and a new one starts later.
    changes = tracker.update(clock.now, {GPU: idle_sample(GPU, busy=True)}, holders)
    assert [p.claim_uid for p in changes.ended] == ["uid-a"] and tracker.idle_for(GPU, "uid-a", clock.now) == 0
    tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders)
    clock.now += 1800
    assert len(tracker.update(clock.now, {GPU: idle_sample(GPU)}, holders).due) == 1
    # A sample that could not be taken neither starts nor ends a period.
    unknown = Sample(GPU, DeviceKind.GPU, clock.now)
    assert is_idle(unknown, 0.05) is None
    assert tracker.update(clock.now, {GPU: unknown}, holders).ended == []


def test_one_event_per_idle_period_and_none_for_admin_access(tmp_path):
    node, inventory = node_of(tmp_path)
    clock = Clock()
    records = [record("uid-a", GPU), record("uid-adm", GPU2, "monitor", admin=True)]
    events = Events()
    monitor = UtilizationMonitor(Sampler(node.nvml, node.sysfs, lambda: inventory),
                                 IdleTracker(tmp_path / "state", "me", 0.05, 1800),
                                 lambda: records, "node-a", events=events, clock=clock)
    node.library.loads.set(inventory.get(GPU).attributes["uuid"], memory_used_bytes=312 << 20)
    monitor.tick()
    clock.now += 1799
    monitor.tick()
    assert events.posted == []
    clock.now += 1
    monitor.tick()
    (event,) = events.posted
    assert (event.namespace, event.claim_name, event.claim_uid) == ("team-a", "train", "uid-a")
    assert (event.reason, event.action, event.type) == ("DeviceIdle", "Idle", "Normal")
    assert event.note == f"GPU {GPU} idle for 30m; kernels active 0% of the time, 312 MiB used"
    for _ in range(3):
        clock.now += 600
        monitor.tick()
    assert len(events.posted) == 1, "one Event per idle period; the admin claim gets none"
    # An API server that cannot take it now: tried again next sample; one that rejects
    # it (RBAC, validation): given up, not posted every 10 s forever.
    node.library.loads.set(inventory.get(GPU).attributes["uuid"], sm_percent=50)
    monitor.tick()
    def idle_again() -> None:
        node.library.loads.set(inventory.get(GPU).attributes["uuid"], sm_percent=0)
        time.sleep(0.4)  # past the samples that still hold the busy load
        monitor.tick()
        time.sleep(0.2)
        monitor.tick()
        clock.now += 1800

    idle_again()
    events.error = ApiError(503, "unavailable")
    monitor.tick()
    assert len(events.posted) == 1
    events.error = None
    clock.now += 10
    monitor.tick()
    assert len(events.posted) == 2, "a new idle period, a new Event (after the retry)"
    node.library.loads.set(inventory.get(GPU).attributes["uuid"], sm_percent=50)
    time.sleep(0.2)
    monitor.tick()
    idle_again()
    events.error = ApiError(403, "forbidden")
    monitor.tick()
    events.error = None
    clock.now += 10
    monitor.tick()
    assert len(events.posted) == 2, "a rejected Event is not retried every sample"
    assert duration(1800) == "30m" and duration(3900) == "1h5m" and duration(45) == "45s"


def test_the_emulator_rejects_events_the_server_rejects():
    good = {"metadata": {"name": "train.17f", "namespace": "team-a"},
            "eventTime": "2026-12-03T10:00:00.000000Z", "reportingController": "accel.dra.io",
            "reportingInstance": "accel.dra.io/node-a", "action": "Idle", "reason": "DeviceIdle",
            "note": "x", "type": "Normal",
            "regarding": {"kind": "ResourceClaim", "namespace": "team-a", "name": "train"}}
    assert server_events.errors(good, "team-a") == []
    for change, message in (({"eventTime": None}, "eventTime: Required"),
                            ({"eventTime": "2026-12-03T10:00:00Z"}, "eventTime: Required"),
                            ({"action": ""}, "action: Required"),
                            ({"reason": "R" * 129}, "reason: Too long"),
                            ({"note": "n" * 1025}, "note: Too long"),
                            ({"type": "Info"}, "type: Unsupported"),
                            ({"reportingController": "not a name"}, "reportingController: Invalid"),
                            ({"regarding": {"namespace": "other"}}, "regarding.namespace")):
        assert any(message in e for e in server_events.errors({**good, **change}, "team-a")), change


# -- the running driver: Event, Idle condition, metrics endpoint, `dra-driver status` ---------
@pytest.fixture
def running():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        with InProcessPlugin(api, dirs, "mixed", "--utilization-interval", "1",
                             "--idle-after", "2") as plugin:
            kubelet = FakeKubelet(dirs.registry)
            kubelet.register()
            assert api.wait_for(lambda: len(api.state.slices) > 0)
            yield api, plugin, kubelet, dirs
            kubelet.close()
    dirs.cleanup()


def reserve(api, claim, *pods: str) -> None:
    with api.state.lock:
        stored = api.state.claims[(claim.namespace, claim.name)]
        stored["status"]["reservedFor"] = [{"resource": "pods", "name": p, "uid": f"uid-{p}"}
                                           for p in pods]


def scrape(plugin) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_an_idle_claim_gets_an_event_and_an_idle_condition_until_its_gpu_works(running):
    api, plugin, kubelet, dirs = running
    library = plugin.plugin.node.mock.library
    uuid = plugin.plugin.holder.inventory.get(GPU).attributes["uuid"]
    library.loads.set(uuid, sm_percent=0, memory_used_bytes=312 << 20)
    claim = new_claim(api, "notebook", [result("gpu", GPU)], namespace="team-a")
    reserve(api, claim, "nb-0")
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    # A second pod of the claim: the kubelet prepares it again; the record learns the pod.
    reserve(api, claim, "nb-0", "nb-1")
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    ready_at = wait(lambda: ours(api, claim).get(GPU), "the Ready entry")["conditions"][0]["lastTransitionTime"]
    events = wait(lambda: api.state.events, "the idle Event", timeout=20)
    (event,) = events
    assert event["regarding"]["uid"] == claim.uid and event["regarding"]["kind"] == "ResourceClaim"
    assert event["reason"] == "DeviceIdle" and event["metadata"]["namespace"] == "team-a"
    assert event["note"].startswith(f"GPU {GPU} idle for ") and "kernels active 0% of the time, 312 MiB used" in event["note"]
    conditions = wait(lambda: len(ours(api, claim)[GPU]["conditions"]) == 2
                      and ours(api, claim)[GPU]["conditions"], "the Idle condition")
    ready, idle = conditions
    assert (idle["type"], idle["status"], idle["reason"]) == ("Idle", "True", "DeviceIdle")
    assert ready["type"] == "Ready" and ready["lastTransitionTime"] == ready_at
    assert f'claim_uid="{claim.uid}"' in scrape(plugin)
    # `dra-driver status` beside the running driver: no API server, its files only.
    shown = subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "mixed",
                            "--state-dir", str(dirs.state), "-o", "json"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    row = next(r for r in json.loads(shown.stdout) if r["device"] == GPU)
    assert row["claim"] == "team-a/notebook" and row["claim_uid"] == claim.uid
    assert row["pods"] == ["nb-0", "nb-1"]
    assert row["idle_seconds"] >= 2 and row["memory_used_mib"] == 312 and row["health"] == "Healthy"
    # The GPU works again: the condition goes, Ready stays as it was.
    library.loads.set(uuid, sm_percent=60)
    wait(lambda: [c["type"] for c in ours(api, claim)[GPU]["conditions"]] == ["Ready"],
         "the Idle condition to go", timeout=20)
    assert ours(api, claim)[GPU]["conditions"][0]["lastTransitionTime"] == ready_at
    assert len(api.state.events) == 1
    # Unprepared: the claim's series leave the metrics.
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    wait(lambda: f'claim_uid="{claim.uid}"' not in scrape(plugin), "the claim's series to go")
    assert ("create", "events.k8s.io", "events") in api.state.access


def series_names() -> set[str]:
    """The metric names the driver exports for devices (for the dashboard's queries)."""
    views = [DeviceView(Sample("gpu-x", DeviceKind.GPU, 0.0, 0.1, 0.2, 1, 2, 3.0, 1),
                        (Holder("u", "ns", "c"),), {"u": 5.0}),
             DeviceView(Sample("nic-x", DeviceKind.NIC, 0.0, rx_bytes=1, tx_bytes=2))]
    names = set()
    for family in text_string_to_metric_families(devicemetrics.DeviceSeries(lambda: views).render().decode()):
        for s in family.samples:
            names.add(s.name)
            assert set(s.labels) == set(devicemetrics.LABELS)
    # and the fragmentation gauges (driver/explain/capacitymetrics.py), on a node that has all their kinds
    from driver.explain.capacitymetrics import CapacityCollector
    from driver.publish import mocknode

    objects = mocknode.mock_objects("mixed", "accel.dra.io", "consumable", "dynamic")
    names |= {s.name for f in CapacityCollector("accel.dra.io", lambda taints: objects, list).collect() for s in f.samples}
    return names


def test_utilization_options_are_checked_once_with_the_option_named():
    import argparse

    from driver.service.config import ConfigError, add_arguments, build

    def config(*args, command="run"):
        parser = argparse.ArgumentParser()
        add_arguments(parser, command)
        return build(parser.parse_args(list(args)), {}, command=command)

    default = config()
    assert (default.utilization_interval, default.idle_after, default.idle_threshold) == (10, 1800, 0.05)
    off = config("--utilization-interval", "0", "--idle-after", "0", "--idle-threshold", "0")
    assert (off.utilization_interval, off.idle_after, off.idle_threshold) == (0, 0, 0)
    for args, message in ((("--utilization-interval", "0.5"), "--utilization-interval: 0.5 is outside 1..86400 seconds"),
                          (("--idle-after", "soon"), "--idle-after: 'soon' is not a number of seconds"),
                          (("--idle-threshold", "101"), "--idle-threshold: 101.0 is outside 0..100 percent")):
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            config(*args)
    # `status` reads the state dir and the threshold; it has no sockets or API server.
    assert config("--state-dir", "/tmp/s", "--idle-threshold", "10", command="status").idle_threshold == 0.1
    with pytest.raises(SystemExit):
        config("--kubeconfig", "/k", command="status")


def test_status_without_a_driver_says_so_and_still_lists_the_devices(tmp_path):
    shown = subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "a100-mig",
                            "--state-dir", str(tmp_path / "none")], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"no driver state at {tmp_path / 'none'} (--state-dir)" in shown.stderr
    header, *lines = shown.stdout.splitlines()
    assert header.split() == ["DEVICE", "KIND", "HEALTH", "CLAIM", "PODS", "SHARE", "KERNEL", "MEMORY",
                              "POWER", "PROCS", "IDLE"]
    migs = [line.split() for line in lines if line.startswith("mig-")]
    assert migs and all(cols[6] == "-" for cols in migs), "MIG devices have no kernel-time counter"
    assert not (tmp_path / "none").exists(), "status only reads"


def test_a_new_driver_process_replaces_health_a_previous_one_left_for_status():
    dirs = DriverDirs.make()
    stale = dirs.state / "utilization" / "health.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({GPU: [{"reason": "gpu-xid", "value": "79", "message": "old",
                                        "since": 1.0}]}))
    with ApiServer() as api:
        api.add_node("node-a")
        with InProcessPlugin(api, dirs, "mixed", "--utilization-interval", "0"):
            assert json.loads(stale.read_text()) == {}, "the old condition does not hold any more"
    dirs.cleanup()


def labelled(metrics: Metrics, name: str) -> list[dict]:
    return [dict(s.labels) for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples if s.name == f"dra_driver_device_{name}"]


def test_series_carry_the_labels_dcgm_exporter_users_join_on(tmp_path):
    """dcgm-exporter labels a GPU's series with its UUID (a MIG device's with the parent
    GPU's UUID and GPU_I_ID) and, for devices of the driver gpu.nvidia.com only,
    dra_driver_name, dra_pool_name, dra_device_name, dra_claim_namespace and dra_claim_name:
    ours carry the same; `on(UUID, GPU_I_ID)` is the join that matches this driver's GPUs."""
    node, inventory, records, clock, monitor, metrics = monitored(tmp_path)
    held = {(s["dra_device_name"], s["dra_claim_name"]): s for s in labelled(metrics, "kernel_active_ratio")}
    gpu = held[(GPU, "train")]
    assert gpu["UUID"] == inventory.get(GPU).attributes["uuid"] and gpu["dra_driver_name"] == DRIVER
    assert gpu["dra_pool_name"] == "node-a" and gpu["dra_claim_namespace"] == "team-a"
    # A whole GPU has no GPU instance: the label is empty, which Prometheus stores as absent.
    assert gpu["GPU_I_ID"] == ""
    nic = next(s for s in labelled(metrics, "allocated") if s["kind"] == "nic")
    assert nic["UUID"] == "" and nic["dra_device_name"] == nic["device"]

    mig_node, mig_inventory = node_of(tmp_path / "mig", "a100-mig")
    mig = next(d for d in mig_inventory.devices if d.kind is DeviceKind.MIG)
    mig_monitor = UtilizationMonitor(Sampler(mig_node.nvml, mig_node.sysfs, lambda: mig_inventory),
                                     IdleTracker(tmp_path / "mig-state", "me", 0.05, 1800),
                                     lambda: [record("uid-m", mig.name)], "node-b")
    mig_metrics = Metrics(DRIVER)
    mig_metrics.watch_utilization(devicemetrics.DeviceSeries(mig_monitor.views, mig_metrics.driver))
    mig_monitor.tick()
    (found,) = [s for s in labelled(mig_metrics, "memory_used_bytes") if s["device"] == mig.name]
    assert found["UUID"] == mig.attributes["parentUUID"], "dcgm-exporter: the parent GPU's UUID"
    assert found["GPU_I_ID"] == str(mig.attributes["gpuInstanceID"])
    assert (found["dra_pool_name"], found["dra_claim_name"]) == ("node-b", "train")


# The labels dcgm-exporter puts on a GPU's series when the driver that handed the GPU out is
# not gpu.nvidia.com (its internal/pkg/rendermetrics template; the dra_* labels come only
# for DRAGPUDriverName = "gpu.nvidia.com", internal/pkg/transformation/kubernetes.go).
DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "GPU_I_PROFILE", "GPU_I_ID"}


def test_dcgm_exporter_is_joined_on_uuid_and_gpu_instance_with_group_right(tmp_path):
    """Issue 38, item 7: the documented join on the dra_* labels never matched this
    driver's GPUs. Every query of the dashboard and docs/utilization.md that reads a DCGM
    series joins on labels dcgm-exporter sets for them and ours carry, and an arithmetic join
    says group_right: a GPU shared by two claims has one DCGM series and two of ours."""
    import re

    dashboard = json.loads((REPO / "charts" / "dra-accel-driver" / "dashboards" /
                            "dra-accel-driver.json").read_text())
    panels = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if "DCGM_" in t["expr"]]
    doc = (REPO / "docs" / "utilization.md").read_text()
    documented = [q for q in re.findall(r"```promql\n(.*?)```", doc, re.S) + re.findall(r"`([^`]*)`", doc)
                  if "DCGM_" in q and " on " in q]
    assert panels and len(documented) >= 2, (panels, documented)
    for query in panels + documented:
        for operator, on, group in re.findall(r"([-+*/]|\band|\bor|\bunless)\s+on\s*\(([^)]*)\)\s*(group_\w+)?",
                                              query):
            labels = {label.strip() for label in on.split(",")}
            assert labels == {"UUID", "GPU_I_ID"}, query
            assert labels <= DCGM_LABELS and labels <= set(devicemetrics.LABELS), query
            if operator in "+-*/":
                assert group == "group_right", query
        assert "on (" in query or "on(" in query, query
    # Why group_right: after the query's `max by (UUID, GPU_I_ID, claim_namespace, claim_name)`
    # our side has several series for one GPU (two shares of GPU2), dcgm-exporter's one.
    _, inventory, *_, metrics = monitored(tmp_path)
    per_gpu: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for s in labelled(metrics, "allocated"):
        if s["claim_uid"] and s["UUID"]:
            per_gpu.setdefault((s["UUID"], s["GPU_I_ID"]), set()).add((s["claim_namespace"], s["claim_name"]))
    assert len(per_gpu[(inventory.get(GPU2).attributes["uuid"], "")]) == 2, per_gpu


def test_the_kernel_time_is_not_called_sm_utilization():
    """NVML's GPU utilization is the share of time a kernel ran; the metric says so, and the
    old name that said "SM utilization" is marked deprecated in its help and the docs."""
    families = {f.name: f for f in devicemetrics.FAMILIES}
    assert "kernel" in families["kernel_active_ratio"].help and "not SM" in families["kernel_active_ratio"].help
    for old in ("utilization_ratio", "utilization_peak_ratio"):
        assert families[old].help.startswith("DEPRECATED")
        doc = (REPO / "docs" / "utilization.md").read_text()
        assert f"`dra_driver_device_{old}`" in doc and "deprecated" in doc.split(f"`dra_driver_device_{old}`")[1][:200]
    assert "mean SM utilization" not in (REPO / "docs" / "utilization.md").read_text(), "the old wording"
