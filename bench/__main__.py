"""Benchmarks of the real driver process in mock mode, against the API server emulator and
a fake kubelet. Prints median and p99 per figure, and ratios against the primitives the
driver cannot avoid, measured in the same run on the same machine.

    python -m bench [--runs 200] [--idle-seconds 30] [--quick] [--startup-only] [--idle-large 600]
    python -m bench --against OTHER_CHECKOUT [--runs 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc

from driver.state import atomic

from driver import logs
from driver.monitoring.devicemetrics import DeviceSeries
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kube.client import Kube, api_client
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim, FakeKubelet

DRIVER = "accel.dra.io"
NODE = "bench-node"
GPU = "gpu-0000-11-00-0"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def latency(self, name: str, seconds: list[float], note: str = "") -> float:
        median = statistics.median(seconds)
        self.rows.append((name, f"{median * 1000:.3f} ms", f"{pct(seconds, 0.99) * 1000:.3f} ms", note))
        return median

    def value(self, name: str, value: str, note: str = "") -> None:
        self.rows.append((name, value, "", note))

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows + [("figure", "median", "p99", "note")]) for i in range(4)]
        header = ("figure", "median", "p99", "note")
        for row in [header] + self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def pq_ratio(with_status: float, without: list[float]) -> str:
    return f"with status writes: {with_status / statistics.median(without):.2f}x"


def file_system(path: Path) -> str:
    """The file system `path` is on, as far as a prepare's cost goes: its type, and for
    ext4 whether it has a journal. Without one (this development VM's root) the kernel
    skips recently deleted inodes when it allocates one (fs/ext4/ialloc.c,
    recently_deleted), so creating a file costs more with every file deleted in the
    last minutes; nodes run ext4 with a journal, or xfs."""
    best, fstype, source = "", "unknown", ""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            point = left.split()[4]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, (fstype, source) = point, right.split()[:2]
    except (OSError, ValueError, IndexError):
        return "unknown"
    if fstype != "ext4":
        return fstype
    device = os.path.basename(source)
    journaled = any(e.startswith(f"{device}-") for e in os.listdir("/proc/fs/jbd2")) \
        if os.path.isdir("/proc/fs/jbd2") else None
    return {True: "ext4 with a journal", False: "ext4 WITHOUT a journal"}.get(journaled, "ext4")


def settle(api: ApiServer, quiet: float = 0.5, limit: float = 15.0) -> None:
    """Wait until the API server has had no request for `quiet` seconds: the claim status
    writes of the last phase (0.2 s after each prepare and unprepare) must not run inside
    the next phase's measurement."""
    deadline = time.monotonic() + limit
    seen = api.state.requests
    calm_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if api.state.requests != seen:
            seen, calm_since = api.state.requests, time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return


def throughput(table: Table, api: ApiServer, kubelet: FakeKubelet, label: str = "") -> tuple[float, float]:
    """256 distinct claims in one request, then 64 concurrent one-claim requests."""
    batch = [new_claim(api) for _ in range(256)]
    settle(api)
    t = time.perf_counter()
    response = kubelet.prepare(batch, timeout=120)
    elapsed = time.perf_counter() - t
    assert all(not e.error for e in response.claims.values()), response
    batch_rate = 256 / elapsed
    table.value(f"throughput: 256 claims in one request{label}", f"{batch_rate:.0f} claims/s",
                f"{elapsed * 1000:.0f} ms")
    kubelet.unprepare(batch, timeout=120)
    singles = [new_claim(api) for _ in range(64)]
    settle(api)
    t = time.perf_counter()
    responses = kubelet.prepare_each(singles, timeout=120)
    elapsed = time.perf_counter() - t
    assert not any(r.claims[c.uid].error for c, r in zip(singles, responses)), responses
    concurrent_rate = 64 / elapsed
    table.value(f"throughput: 64 concurrent 1-claim requests{label}", f"{concurrent_rate:.0f} claims/s",
                f"{elapsed * 1000:.0f} ms")
    kubelet.unprepare(singles, timeout=120)
    return batch_rate, concurrent_rate


class Driver:
    def __init__(self, api: ApiServer, profile: str, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, checkout: Path | None = None,
                 node: str = NODE) -> None:
        """`checkout`: run the driver of that source tree (an A/B against another commit)."""
        self.dir = Path(tempfile.mkdtemp(prefix="dra-bench-"))
        self.api = api
        self.env = env
        self.checkout = checkout
        if checkout is not None:
            self.env = {**(env or os.environ), "PYTHONPATH": str(checkout)}
        self.args = [sys.executable, "-m", "driver", "run", "--node-name", node, "--driver-name", DRIVER,
                     "--mock", profile, "--kubeconfig", str(api.kubeconfig(self.dir)),
                     "--kubelet-registrar-dir", str(self.dir / "registry"),
                     "--kubelet-plugins-dir", str(self.dir / "plugins"), "--cdi-root", str(self.dir / "cdi"),
                     "--state-dir", str(self.dir / "state"), "--metrics-port", "0", "--healthz-port", "0",
                     "--log-level", "warning", *(extra or [])]

    def start(self) -> float:
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "wb"),
                                     env=self.env, cwd=self.checkout)
        self.started = started
        return started

    def kubelet(self) -> FakeKubelet:
        kubelet = FakeKubelet(self.dir / "registry")
        kubelet.register(timeout=60)
        return kubelet

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def with_bytecode(scratch: Path) -> dict[str, str]:
    """The environment of a driver process that reads and writes bytecode, as the image's
    (pip compiles at install), in a cache of the bench's own: this machine sets
    PYTHONDONTWRITEBYTECODE and the package is installed editable, so each start would
    otherwise compile the driver's modules again."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    return env


def bench_startup(table: Table, api: ApiServer, scratch: Path, starts: int) -> float:
    """Process start -> GetInfo answered on the registration socket, the median of
    `starts` starts with bytecode, beside the floor of any Python driver measured in the
    same run: the interpreter starting and importing driver.plugin (what serving needs)."""
    env = with_bytecode(scratch)
    subprocess.run([sys.executable, "-c", "import driver.plugin, driver.cli"], env=env, check=True)
    imports = []
    for _ in range(starts):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import driver.plugin"], env=env, check=True)
        imports.append(time.perf_counter() - t)
    times = []
    for _ in range(starts):
        driver = Driver(api, "mixed", env=env)
        started = driver.start()
        reg = driver.dir / "registry" / f"{DRIVER}-reg.sock"
        wait(reg.exists, 60)
        # wait_for_ready, not channel_ready_future: the latter added ~200 ms of its own
        # (measured: GetInfo on an idle driver took 203 ms after it, 2 ms without).
        with grpc.insecure_channel(f"unix://{reg}") as channel:
            reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=10, wait_for_ready=True)
        times.append(time.perf_counter() - started)
        driver.stop()
        shutil.rmtree(driver.dir, ignore_errors=True)
    floor = table.latency("start-up floor: python -c 'import driver.plugin'", imports)
    median = table.latency("start-up: process start -> GetInfo answered", times,
                           f"{starts} starts, with bytecode; the mock node's sysfs tree is written first")
    table.value("start-up / floor", f"{median / floor:.2f}x")
    return median


def new_claim(api: ApiServer, device: str = GPU, node: str = NODE) -> Claim:
    """A claim for the mixed node's first GPU. Many of them are prepared at once below, so
    they hold it with admin access: the exclusivity check lets such claims sit side by
    side, and the prepare path is otherwise the same."""
    uid = str(uuid.uuid4())
    name = f"c-{uid[:8]}"
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "r", "driver": DRIVER, "pool": node, "device": device, "adminAccess": True}]))
    return Claim("default", name, uid)


class _Echo(reg_grpc.RegistrationServicer):
    def GetInfo(self, request, context):
        return reg_pb2.PluginInfo()


class Floor:
    """What a prepare cannot avoid, one primitive at a time: a gRPC round trip on a unix
    socket, a claim GET with the driver's client, an atomic write of a new file with and
    without fsync, and (for unprepare) a durable remove. Sampled between the prepares it
    is compared with (`sample`), so that both meet the same state of the machine: this
    VM's disk is much slower for a while after a burst of file creation (a durable write
    0.4 ms, then 1.2 ms a minute later), and a floor measured before the start-up section
    that writes the mock trees was not the floor the prepares met."""

    def __init__(self, api: ApiServer, scratch: Path) -> None:
        directory = self.directory = Path(tempfile.mkdtemp(prefix="floor-", dir=scratch))
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        reg_grpc.add_RegistrationServicer_to_server(_Echo(), self.server)
        self.server.add_insecure_port(f"unix://{directory / 'echo.sock'}")
        self.server.start()
        self.channel = grpc.insecure_channel(f"unix://{directory / 'echo.sock'}")
        self.stub = reg_grpc.RegistrationStub(self.channel)
        self.kube = Kube(api_client(api.kubeconfig(directory)))
        self.claim_path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{new_claim(api).name}"
        self.stub.GetInfo(reg_pb2.InfoRequest())
        self.kube.request("GET", self.claim_path)
        self.times: dict[str, list[float]] = {"grpc": [], "get": [], "write": [], "write_cached": [],
                                              "remove": []}
        self._previous: Path | None = None

    def grpc(self) -> float:
        t = time.perf_counter()
        self.stub.GetInfo(reg_pb2.InfoRequest())
        return self._note("grpc", t)

    def get(self) -> float:
        t = time.perf_counter()
        self.kube.request("GET", self.claim_path)
        return self._note("get", t)

    def write(self) -> float:
        """A file of a new name, as a prepare writes for a new claim's UID."""
        path = self.directory / f"w-{uuid.uuid4()}.json"
        t = time.perf_counter()
        atomic.write(path, b"{" + b" " * 600 + b"}")
        self._previous = path
        return self._note("write", t)

    def write_cached(self) -> float:
        """The same without fsync, as the CDI spec is written (docs/crash-safety.md)."""
        path = self.directory / f"c-{uuid.uuid4()}.json"
        t = time.perf_counter()
        atomic.write(path, b"{" + b" " * 600 + b"}", durable=False)
        elapsed = self._note("write_cached", t)
        path.unlink()
        return elapsed

    def remove(self) -> float:
        """The file `write` made, removed durably, as an unprepare removes a spec."""
        assert self._previous is not None
        t = time.perf_counter()
        atomic.remove(self._previous)
        return self._note("remove", t)

    def sample(self) -> None:
        self.grpc(), self.get(), self.write(), self.write_cached(), self.remove()

    def _note(self, what: str, started: float) -> float:
        elapsed = time.perf_counter() - started
        self.times[what].append(elapsed)
        return elapsed

    def prepare(self) -> float:
        """gRPC + GET + the two writes: the CDI spec (not fsynced since 2026-12-04), then
        the checkpoint record (durable)."""
        return (statistics.median(self.times["grpc"]) + statistics.median(self.times["get"])
                + statistics.median(self.times["write_cached"]) + statistics.median(self.times["write"]))

    def unprepare(self) -> float:
        """gRPC + two durable removes (the spec, then the record)."""
        return statistics.median(self.times["grpc"]) + 2 * statistics.median(self.times["remove"])

    def rows(self, table: Table, label: str = "") -> None:
        table.latency(f"baseline: gRPC unary, unix socket{label}", self.times["grpc"])
        table.latency(f"baseline: claim GET (the driver's client){label}", self.times["get"])
        table.latency(f"baseline: atomic write+fsync+rename, a new file{label}", self.times["write"])
        table.latency(f"baseline: the same without fsync{label}", self.times["write_cached"])
        table.latency(f"baseline: unlink+fsync of the directory{label}", self.times["remove"])

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


def wait(predicate, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def share_claim(api: ApiServer, device: str, memory: str, compute: str) -> Claim:
    uid = str(uuid.uuid4())
    name = f"s-{uid[:8]}"
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "r", "driver": DRIVER, "pool": NODE, "device": device, "shareID": str(uuid.uuid4()),
         "consumedCapacity": {"memory": memory, "compute": compute}}]))
    return Claim("default", name, uid)


def bench_sharing(table: Table, rounds: int, exclusive_prepare: float) -> None:
    """The first share of a GPU creates its MPS daemon pod and waits for the daemon (run by
    the emulator's pod runner as a local process, as a kubelet would run the pod); later
    shares only check and write. The last unprepare deletes the pod and waits for it."""
    from driver.sim.pods import PodRunner

    extra = ["--gpu-sharing", "consumable", "--mps-image", "bench", "--namespace", "bench"]
    with ApiServer() as api, PodRunner(api, NODE, Path(tempfile.mkdtemp(prefix="dra-bench-pods-"))):
        api.add_node(NODE)
        driver = Driver(api, "h100x8", extra)
        driver.start()
        kubelet = driver.kubelet()
        wait(lambda: len(api.state.slices) == 2)
        first, later, last_out = [], [], []
        for _ in range(rounds):
            claims = [share_claim(api, GPU, "10Gi", "10") for _ in range(6)]
            for i, claim in enumerate(claims):
                t = time.perf_counter()
                response = kubelet.prepare([claim], timeout=60)
                (first if i == 0 else later).append(time.perf_counter() - t)
                assert response.claims[claim.uid].error == "", response
            for i, claim in enumerate(claims):
                t = time.perf_counter()
                kubelet.unprepare([claim], timeout=60)
                if i == len(claims) - 1:
                    last_out.append(time.perf_counter() - t)
        f = table.latency("sharing: first share of a GPU (starts MPS daemon pod)", first)
        later_median = table.latency("sharing: later share of the same GPU", later)
        table.latency("sharing: last unprepare (stops the daemon pod)", last_out)
        table.value("sharing: later share / exclusive prepare", f"{later_median / exclusive_prepare:.2f}x")
        table.value("sharing: first share / later share", f"{f / later_median:.0f}x",
                    "process start of the daemon dominates")
        kubelet.close()
        driver.stop()


def bench_dynamic_mig(table: Table, rounds: int, exclusive_prepare: float) -> None:
    import json as _json

    with ApiServer() as api:
        api.add_node(NODE)
        driver = Driver(api, "h100x8", ["--mig-mode", "dynamic"])
        started = driver.start()
        ok = wait(lambda: any("partitions" in n for n in api.state.slices), 120)
        time.sleep(0.5)
        stored = api.slices()
        devices = sum(len(s["spec"].get("devices", [])) for s in stored)
        size = sum(len(_json.dumps(s)) for s in stored)
        table.value("dynamic MIG h100x8: start -> all slices",
                    f"{(time.perf_counter() - started) * 1000:.0f} ms" if ok else "timeout",
                    f"{devices} devices, {len(stored)} slices, {size // 1024} KiB of JSON")
        kubelet = driver.kubelet()
        prep, unprep = [], []
        for i in range(rounds):
            uid = str(uuid.uuid4())
            device = f"gpu-0000-{(i % 8 + 1):x}1-00-0-mig-1g-10gb-{i % 7}"
            api.put_claim(claim_allocated("default", f"m-{uid[:8]}", uid, [
                {"request": "r", "driver": DRIVER, "pool": NODE, "device": device}]))
            claim = Claim("default", f"m-{uid[:8]}", uid)
            t = time.perf_counter()
            response = kubelet.prepare([claim], timeout=60)
            prep.append(time.perf_counter() - t)
            assert response.claims[uid].error == "", response
            t = time.perf_counter()
            kubelet.unprepare([claim], timeout=60)
            unprep.append(time.perf_counter() - t)
        m = table.latency("dynamic MIG: prepare creating a 1g.10gb", prep)
        table.latency("dynamic MIG: unprepare destroying it", unprep)
        table.value("dynamic MIG: prepare with creation / exclusive prepare", f"{m / exclusive_prepare:.2f}x")
        kubelet.close()
        driver.stop()


def mig_profile(directory: Path, migs: int) -> Path:
    """A node of A100s carved into `migs` 1g.5gb MIG devices (7 per GPU)."""
    gpus = []
    while migs > 0:
        gpus.append("      - {type: gpu, model: a100-sxm4-40gb, mig: [%s]}" % ", ".join(["1g.5gb"] * min(7, migs)))
        migs -= 7
    path = directory / f"mig{len(gpus)}.yaml"
    path.write_text("description: MIG sampling bench\n"
                    "nvidia: {driverVersion: \"535.104.05\", cudaDriverVersion: 12020}\n"
                    "roots:\n  - numa: 0\n    devices:\n" + "\n".join(gpus) + "\n")
    return path


def bench_utilization(table: Table, scratch: Path, rounds: int, interval: float = 10.0) -> None:
    """CPU of one utilization sample (and of the monitor's join with claims and the idle
    timers), beside what the NVML calls alone cost through the same fake library."""
    from driver.state.checkpoint import ClaimRecord, PreparedDevice, State
    from driver.devices import mock
    from driver.devices.discovery import discover
    from driver.metrics import Metrics
    from driver.monitoring.utilization.idle import IdleTracker
    from driver.monitoring.utilization.monitor import UtilizationMonitor
    from driver.monitoring.utilization.sampler import Sampler

    for label, profile in (("8 GPUs", "h100x8"), ("64 MIG devices", str(mig_profile(scratch, 64)))):
        node = mock.build(mock.load(profile), scratch / f"util-{len(label)}")
        inventory = discover(node.sources()).inventory
        devices = [d for d in inventory.devices if d.attributes.get("uuid")]
        records = [ClaimRecord(f"uid-{i}", "default", f"c-{i}", State.PREPARE_COMPLETED, "b",
                               (PreparedDevice("r", NODE, d.name, ("x",)),)) for i, d in enumerate(devices)]
        sampler = Sampler(node.nvml, node.sysfs, lambda: inventory)
        monitor = UtilizationMonitor(sampler, IdleTracker(scratch / f"state-{len(label)}", "bench", 0.05, 1800),
                                     lambda: records, NODE)
        metrics = Metrics(DRIVER)
        metrics.watch_utilization(DeviceSeries(monitor.views, metrics.driver))
        monitor.tick()  # handles looked up, NVML initialized
        calls_before = sum(node.library.calls.values())
        cpu = []
        for _ in range(rounds):
            t = time.process_time()
            sampler.activity()
            cpu.append(time.process_time() - t)
        calls = (sum(node.library.calls.values()) - calls_before) / rounds
        ticks, scrapes = [], []
        for _ in range(rounds):
            t = time.process_time()
            monitor.tick()
            ticks.append(time.process_time() - t)
            t = time.process_time()
            metrics.exposition()
            scrapes.append(time.process_time() - t)
        # The floor: the same number of NVML calls, through the same fake library, alone.
        nv = node.nvml
        handle = nv.nvmlDeviceGetHandleByUUID(str(devices[0].attributes["uuid"]))
        t = time.process_time()
        for _ in range(1000):
            nv.nvmlDeviceGetMemoryInfo(handle)
        per_call = (time.process_time() - t) / 1000
        sample = table.latency(f"utilization: one sample, {label} (CPU)", cpu,
                               f"{calls:.0f} NVML calls; floor {calls * per_call * 1000:.2f} ms "
                               f"({statistics.median(cpu) / (calls * per_call):.2f}x)")
        tick = table.latency(f"utilization: sample + claims + idle timers, {label} (CPU)", ticks,
                             f"{len(records)} claims")
        table.latency(f"utilization: /metrics scrape, {label} (CPU)", scrapes)
        table.value(f"utilization: share of a core at {interval:g} s, {label}",
                    f"{tick / interval * 100:.3f} %", f"sample alone {sample / interval * 100:.3f} %")
        sampler.close()


def idle_cpu(api: ApiServer, profile: str, extra: list[str], seconds: float) -> float:
    """CPU seconds a started, idle driver process uses in `seconds`."""
    driver = Driver(api, profile, extra)
    driver.start()
    kubelet = driver.kubelet()
    time.sleep(2.0)  # past start-up and the first publish
    cpu0 = driver.cpu_seconds()
    time.sleep(seconds)
    used = driver.cpu_seconds() - cpu0
    kubelet.close()
    driver.stop()
    return used


def idle_large(api: ApiServer, seconds: float) -> None:
    """Issue 17's idle figure: a driver on the sriov-large node (2,048 VFs, 16 slices) with
    the default intervals, its CPU over `seconds` once all slices are published, minute by
    minute (the periodic rediscovery runs every 60 s, the publisher's resync every 300 s)."""
    cache = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    driver = Driver(api, "sriov-large", env=with_bytecode(cache))
    driver.start()
    kubelet = driver.kubelet()
    wait(lambda: len(api.state.slices) >= 16, 180)
    time.sleep(5.0)  # past the first publish
    start = driver.cpu_seconds()
    began = time.monotonic()
    minutes = []
    while time.monotonic() - began < seconds:
        before = driver.cpu_seconds()
        time.sleep(min(60.0, seconds - (time.monotonic() - began)))
        minutes.append(driver.cpu_seconds() - before)
    used = driver.cpu_seconds() - start
    elapsed = time.monotonic() - began
    kubelet.close()
    driver.stop()
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(driver.dir, ignore_errors=True)
    print(f"sriov-large idle {elapsed:.0f} s, default intervals: {used:.2f} CPU-s = "
          f"{used / elapsed * 100:.3f} % of a core; per minute: "
          + ", ".join(f"{m:.2f}" for m in minutes), flush=True)


LARGE_MINUS_ONE = """
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    repeat: 8
    devices:
      - {type: nic, model: connectx-6dx, vfs: 127, rdma: true}
  - numa: 1
    repeat: 7
    devices:
      - {type: nic, model: connectx-6dx, vfs: 127, rdma: true}
  - numa: 1
    devices:
      - {type: nic, model: connectx-6dx, vfs: %d, rdma: true}
"""


def bench_periodic_checks(table: Table, sysfs: Path, dev: Path, result) -> None:
    """sriov-large: the CPU of one health probe (every --health-interval, 5 s) and of the
    NIC counters a /metrics scrape reads, over 2,048 VFs, beside their floor measured in
    the same run (the same directory listings and preads of the same files, alone) and the
    same checks made path by path, as they were before; and the utilization tick (every
    --utilization-interval, 10 s), which reads no NIC counter, and a whole scrape."""
    from driver.devices import sysread
    from driver.devices.model import DeviceKind
    from driver.monitoring.health import HealthState, Prober
    from driver.metrics import Metrics
    from driver.monitoring.utilization.idle import IdleTracker
    from driver.monitoring.utilization.monitor import UtilizationMonitor
    from driver.monitoring.utilization.sampler import Sampler

    sysread.raise_descriptor_limit()  # as `dra-driver run` does, so that files are held
    inventory = result.inventory
    prober = Prober(HealthState(DRIVER, lambda: inventory), sysfs, dev, None)
    sampler = Sampler(None, sysfs, lambda: inventory)
    state = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    monitor = UtilizationMonitor(sampler, IdleTracker(state, "bench", 0.05, 1800), lambda: (), NODE)
    metrics = Metrics(DRIVER)
    metrics.watch_utilization(DeviceSeries(monitor.views, metrics.driver))
    nics = [d for d in inventory.devices if d.kind is DeviceKind.NIC and d.net_interface]
    stats = [f"{sysfs}/bus/pci/devices/{d.pci.bus_id}" for d in nics if d.pci is not None]
    stats += [f"{dev}/{n.removeprefix('/dev/')}" for d in nics for n in d.device_nodes]
    reads = [f"{sysfs}/class/net/{d.net_interface}/{leaf}" for d in nics
             for leaf in ("operstate", "statistics/rx_bytes", "statistics/tx_bytes")]

    held = [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in reads]
    directories = sorted({os.path.dirname(path) for path in stats})

    def floor() -> None:  # what the probe and the sample cannot avoid: a listing, a pread
        for directory in directories:
            os.listdir(directory)
        for fd in held:
            os.pread(fd, 256, 0)

    def one_by_one() -> None:  # the same checks a path at a time, as before: a stat each,
        for path in stats:     # and each file opened, read and closed
            try:
                os.stat(path)
            except OSError:
                pass
        for path in reads:
            sysread.read_small(path)

    figures = {}
    for name, step in (("floor", floor), ("one by one", one_by_one), ("probe", prober.probe),
                       ("counters", sampler.counters), ("tick", monitor.tick),
                       ("scrape", lambda: metrics.exposition())):
        step()
        cpu = []
        for _ in range(15):
            t = time.process_time()
            step()
            cpu.append(time.process_time() - t)
        figures[name] = statistics.median(cpu)
    for fd in held:
        os.close(fd)
    prober.close()
    sampler.close()
    shutil.rmtree(state, ignore_errors=True)
    probe, counters, base = figures["probe"], figures["counters"], figures["floor"]
    table.value("sriov-large: health probe, 2,048 VFs", f"{probe * 1000:.1f} ms CPU",
                f"{probe / 5 * 100:.2f} % of a core at 5 s")
    table.value("sriov-large: NIC counters of a /metrics scrape, 2,048 VFs", f"{counters * 1000:.1f} ms CPU",
                f"{counters / 30 * 100:.2f} % of a core at a 30 s scrape interval")
    table.value("sriov-large: utilization tick, 2,048 VFs", f"{figures['tick'] * 1000:.2f} ms CPU",
                f"{figures['tick'] / 10 * 100:.3f} % of a core at 10 s; no NIC counter read")
    table.value("sriov-large: whole /metrics scrape, 2,048 VFs", f"{figures['scrape'] * 1000:.1f} ms CPU",
                "views, counters, text exposition")
    table.value("sriov-large: probe + counters / their syscalls alone", f"{(probe + counters) / base:.2f}x",
                f"floor {base * 1000:.1f} ms CPU ({len(directories)} listings, {len(reads)} preads)")
    table.value("sriov-large: those checks path by path / as done",
                f"{figures['one by one'] / base:.2f}x",
                f"{len(stats)} stats and {len(reads)} open-read-close: "
                f"{figures['one by one'] * 1000:.1f} ms CPU against {base * 1000:.1f} ms")


def bench_rediscovery(table: Table, scratch: Path, sources, result, full: float) -> None:
    """sriov-large: the periodic pass (fingerprint, then what differs) against a full
    discovery, and one VF added through its uevents: the scoped rediscovery and the
    publish it causes, in this thread's CPU (the emulator serves on other threads)."""
    from driver.devices import fingerprint, mock
    from driver.devices.discovery import Changes, discover
    from driver.devices.sysread import HeldDirs
    from driver.publish.publisher import Publisher

    dirs = HeldDirs()  # as the driver takes the fingerprint: directories kept open
    baseline = fingerprint.fingerprint(sources.sysfs, dirs)
    times, cpu = [], []
    current = result
    for _ in range(5):
        t, c = time.perf_counter(), time.thread_time()
        now = fingerprint.fingerprint(sources.sysfs, dirs)
        current = discover(sources, current, fingerprint.changes(baseline, now))
        baseline = now
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    assert current == result
    table.latency("sriov-large: periodic rediscovery, nothing changed", times,
                  f"{statistics.median(cpu) * 1000:.0f} ms CPU; full / this "
                  f"{full / statistics.median(times):.1f}x; at the default 60 s: "
                  f"{statistics.median(cpu) / 60 * 100:.2f} % of a core")
    by_path, held = [], []
    for _ in range(5):
        c = time.thread_time()
        fingerprint.fingerprint(sources.sysfs)
        by_path.append(time.thread_time() - c)
        c = time.thread_time()
        fingerprint.fingerprint(sources.sysfs, dirs)
        held.append(time.thread_time() - c)
    table.value("sriov-large: the fingerprint alone, by path / directories held",
                f"{statistics.median(by_path) / statistics.median(held):.2f}x",
                f"{statistics.median(by_path) * 1000:.0f} ms / {statistics.median(held) * 1000:.0f} ms CPU, "
                f"{len(dirs)} directories held")
    dirs.close()

    root = scratch / "large-vf"
    node = mock.build(mock.parse(LARGE_MINUS_ONE % 126, "large-vf.yaml"), root)
    vf_sources = node.sources()
    before_result = discover(vf_sources)

    def listing() -> tuple[set, set]:
        return (set(os.listdir(vf_sources.sysfs / "bus" / "pci" / "devices")),
                set(os.listdir(vf_sources.sysfs / "class" / "net")))

    with ApiServer() as api:
        api.add_node(NODE)
        holder = [before_result.inventory]
        publisher = Publisher(Kube(api_client(api.kubeconfig(scratch))), DRIVER, NODE,
                              inventory=lambda: holder[0])
        publisher.reconcile()
        publisher.cache.replace(*publisher._list())  # what the watch keeps while it runs
        publisher.reconcile()  # as after the watch echoes its writes: nothing to write
        before = listing()
        mock.build(mock.parse(LARGE_MINUS_ONE % 127, "large-vf.yaml"), root)
        after = listing()
        changes = Changes(frozenset(before[0] ^ after[0]), frozenset(before[1] ^ after[1]))
        api.reset_writes()
        c0 = time.thread_time()
        added = discover(vf_sources, before_result, changes)
        c1 = time.thread_time()
        holder[0] = added.inventory
        writes = publisher.reconcile()
        c2 = time.thread_time()
        assert added == discover(vf_sources) and len(added.inventory.devices) == 2048
        table.value("sriov-large: one VF added (uevents) -> rediscovery", f"{(c1 - c0) * 1000:.1f} ms CPU",
                    f"read again: {sorted(changes.functions)} + its PF, {sorted(changes.interfaces)}")
        generations = sorted({s["spec"]["pool"]["generation"] for s in api.slices()})
        table.value("sriov-large: ... -> its publish", f"{(c2 - c1) * 1000:.1f} ms CPU",
                    f"{writes} slice write(s), pool generation now {generations}; "
                    f"both together {(c2 - c0) * 1000:.1f} ms CPU")


def bench_against(other: Path, runs: int) -> None:
    """This checkout's driver and `other`'s side by side against one emulator, their
    prepares alternating (one claim each, then batches and concurrent requests, in turns),
    so that both meet the same moments of a noisy machine."""
    checkouts = {"this": Path(__file__).resolve().parent.parent, "other": other}
    table = Table()
    with ApiServer() as api:
        drivers: dict[str, tuple[Driver, FakeKubelet, str]] = {}
        for label, checkout in checkouts.items():
            node = f"bench-{label}"
            api.add_node(node)
            driver = Driver(api, "mixed", checkout=checkout, node=node)
            driver.start()
            drivers[label] = (driver, driver.kubelet(), node)
        wait(lambda: len(api.state.slices) == 3 * len(drivers))
        time.sleep(1.0)
        scratch = Path(tempfile.mkdtemp(prefix="dra-bench-base-"))
        floor_sampler = Floor(api, scratch)
        latency: dict[str, list[float]] = {label: [] for label in drivers}
        for _ in range(runs):
            for label, (_, kubelet, node) in drivers.items():
                claim = new_claim(api, node=node)
                t = time.perf_counter()
                response = kubelet.prepare([claim])
                latency[label].append(time.perf_counter() - t)
                assert response.claims[claim.uid].error == "", response
                kubelet.unprepare([claim])
            floor_sampler.sample()
        floor_sampler.rows(table, " (between the prepares)")
        floor = floor_sampler.prepare()
        floor_sampler.close()
        medians = {}
        for label, (driver, _, _) in drivers.items():
            medians[label] = table.latency(f"{label}: prepare, 1 claim", latency[label],
                                           f"p50 {statistics.median(latency[label]) / floor:.2f}x, "
                                           f"p99 {pct(latency[label], 0.99) / floor:.2f}x the floor")
        table.value("prepare: this / other", f"{medians['this'] / medians['other']:.2f}x")
        rates: dict[str, list[float]] = {label: [] for label in drivers}
        concurrent: dict[str, list[float]] = {label: [] for label in drivers}
        cpu: dict[str, list[float]] = {label: [] for label in drivers}
        for _ in range(4):
            for label, (driver, kubelet, node) in drivers.items():
                batch = [new_claim(api, node=node) for _ in range(256)]
                settle(api)
                c0, t = driver.cpu_seconds(), time.perf_counter()
                response = kubelet.prepare(batch, timeout=120)
                rates[label].append(256 / (time.perf_counter() - t))
                cpu[label].append((driver.cpu_seconds() - c0) / 256)
                assert all(not e.error for e in response.claims.values()), response
                kubelet.unprepare(batch, timeout=120)
                singles = [new_claim(api, node=node) for _ in range(64)]
                settle(api)
                t = time.perf_counter()
                responses = kubelet.prepare_each(singles, timeout=120)
                concurrent[label].append(64 / (time.perf_counter() - t))
                errors = [r.claims[c.uid].error for c, r in zip(singles, responses)]
                assert not any(errors), errors
                kubelet.unprepare(singles, timeout=120)
        for label, (driver, kubelet, _) in drivers.items():
            table.value(f"{label}: 256 claims in one request", f"{statistics.median(rates[label]):.0f} claims/s",
                        "4 rounds: " + ", ".join(f"{r:.0f}" for r in rates[label]))
            table.value(f"{label}: 64 concurrent 1-claim requests", f"{statistics.median(concurrent[label]):.0f} claims/s",
                        "4 rounds: " + ", ".join(f"{r:.0f}" for r in concurrent[label]))
            table.value(f"{label}: driver CPU a claim in a batch", f"{statistics.median(cpu[label]) * 1000:.2f} ms")
            table.value(f"{label}: RSS after it all", f"{driver.rss_mib():.1f} MiB")
            kubelet.close()
            driver.stop()
    table.print()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="fewer runs, 5 s idle (smoke test)")
    parser.add_argument("--startup-only", action="store_true", help="the baselines and start-up alone")
    parser.add_argument("--idle-large", type=float, metavar="SECONDS", default=0.0,
                        help="only the idle CPU of a driver on sriov-large over SECONDS (issue 17: 600)")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="only prepare latency, throughput, CPU and RSS, alternating with the driver "
                             "of another source tree (git worktree add /tmp/old REV)")
    args = parser.parse_args()
    logs.configure("console", "warning")
    if args.quick:
        args.runs, args.idle_seconds = 30, 5.0
    runs = args.runs
    table = Table()
    scratch = Path(tempfile.mkdtemp(prefix="dra-bench-base-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.platform()}; runs={runs}", flush=True)
    print(f"driver directories under {scratch.parent}: {file_system(scratch)} "
          "(TMPDIR chooses; a node has /var/run/cdi on tmpfs and its state on a journaled disk)",
          flush=True)

    if args.against:
        if not (args.against / "driver" / "__main__.py").is_file():
            parser.error(f"--against {args.against}: not a checkout of this driver (no driver/__main__.py)")
        bench_against(args.against.resolve(), runs)
        return 0
    if args.idle_large:
        with ApiServer() as api:
            api.add_node(NODE)
            idle_large(api, args.idle_large)
        return 0
    with ApiServer() as api:
        api.add_node(NODE)
        # -- baselines (again between the prepares below, for their ratios) ------------------
        base = Floor(api, scratch)
        for _ in range(runs):
            base.sample()
        base.rows(table)
        base.close()

        # -- start-up ---------------------------------------------------------------------------
        bench_startup(table, api, scratch, 5 if args.quick else 10)
        if args.startup_only:
            table.print()
            return 0
        driver = Driver(api, "mixed")
        driver.start()
        kubelet = driver.kubelet()
        wait(lambda: len(api.state.slices) == 3)
        time.sleep(1.0)
        table.value("memory: RSS after start", f"{driver.rss_mib():.1f} MiB")

        # -- prepare / unprepare latency ------------------------------------------------------
        prep, unprep = [], []
        between = Floor(api, scratch)
        for _ in range(runs):
            claim = new_claim(api)
            t = time.perf_counter()
            response = kubelet.prepare([claim])
            prep.append(time.perf_counter() - t)
            assert response.claims[claim.uid].error == "", response
            t = time.perf_counter()
            kubelet.unprepare([claim])
            unprep.append(time.perf_counter() - t)
            between.sample()
        floor, unprep_floor = between.prepare(), between.unprepare()
        between.rows(table, " (between the prepares)")
        between.close()
        p = table.latency("prepare: 1 claim, 1 device (v1)", prep, f"floor {floor * 1000:.3f} ms")
        u = table.latency("unprepare: 1 claim (v1)", unprep, f"floor {unprep_floor * 1000:.3f} ms")
        table.value("prepare / floor (gRPC + GET + spec + durable record)", f"{p / floor:.2f}x",
                    f"p99 {pct(prep, 0.99) / floor:.2f}x; the floor before start-up: "
                    f"{base.prepare() * 1000:.3f} ms")
        table.value("unprepare / floor (gRPC + 2 removes)", f"{u / unprep_floor:.2f}x")

        # -- throughput ---------------------------------------------------------------------------
        batch_rate, concurrent_rate = throughput(table, api, kubelet)
        # -- scaling with prepared claims -----------------------------------------------------------
        held = [new_claim(api) for _ in range(1000)]
        for i in range(0, 1000, 100):
            kubelet.prepare(held[i:i + 100], timeout=120)
        scaled = []
        for _ in range(runs):
            claim = new_claim(api)
            t = time.perf_counter()
            kubelet.prepare([claim])
            scaled.append(time.perf_counter() - t)
            kubelet.unprepare([claim])
        s = table.latency("prepare with 1,000 claims already prepared", scaled)
        table.value("scaling: 1,000 prepared / 0 prepared", f"{s / p:.2f}x")
        time.sleep(1.0)
        table.value("memory: RSS with 1,000 prepared claims", f"{driver.rss_mib():.1f} MiB")
        cpu0 = driver.cpu_seconds()
        time.sleep(args.idle_seconds)
        table.value(f"CPU during {args.idle_seconds:.0f} s idle", f"{driver.cpu_seconds() - cpu0:.2f} s")
        kubelet.close()
        driver.stop()

        # -- the same without claim status writes (A/B in this run) ----------------------------
        # Each prepare and unprepare also applies status.devices; on a node the API server
        # is elsewhere, here the emulator serves those PATCHes on the same two cores.
        quiet = Driver(api, "mixed", ["--claim-status", "false"])
        quiet.start()
        quiet_kubelet = quiet.kubelet()
        wait(lambda: len(api.state.slices) == 3)
        prep_q, unprep_q = [], []
        quiet_floor = Floor(api, scratch)
        for _ in range(runs):
            claim = new_claim(api)
            t = time.perf_counter()
            assert quiet_kubelet.prepare([claim]).claims[claim.uid].error == ""
            prep_q.append(time.perf_counter() - t)
            t = time.perf_counter()
            quiet_kubelet.unprepare([claim])
            unprep_q.append(time.perf_counter() - t)
            quiet_floor.sample()
        quiet_floor.close()
        pq = table.latency("prepare: 1 claim (no status writes)", prep_q, f"{pq_ratio(p, prep_q)}")
        uq = table.latency("unprepare: 1 claim (no status writes)", unprep_q, f"{pq_ratio(u, unprep_q)}")
        table.value("prepare / floor (no status writes)", f"{pq / quiet_floor.prepare():.2f}x",
                    f"unprepare {uq / quiet_floor.unprepare():.2f}x; the floor sampled between these")
        b, c = throughput(table, api, quiet_kubelet, " (no status writes)")
        table.value("throughput: with / without status writes", f"{batch_rate / b:.2f}x",
                    f"64 concurrent: {concurrent_rate / c:.2f}x")
        quiet_kubelet.close()
        quiet.stop()

        # -- the claim pool at Python's size for this host (A/B in this run) -------------------
        # Before --claim-workers the pool was the default executor: min(32, CPUs + 4).
        cpu_sized = min(32, (os.cpu_count() or 1) + 4)
        narrow = Driver(api, "mixed", ["--claim-workers", str(cpu_sized)])
        narrow.start()
        narrow_kubelet = narrow.kubelet()
        wait(lambda: len(api.state.slices) == 3)
        b, c = throughput(table, api, narrow_kubelet, f" ({cpu_sized} claim workers)")
        table.value(f"throughput: 32 / {cpu_sized} claim workers", f"{batch_rate / b:.2f}x",
                    f"64 concurrent: {concurrent_rate / c:.2f}x")
        narrow_kubelet.close()
        narrow.stop()

        # -- idle CPU with sampling on and off (A/B in this run) ---------------------------------
        on = idle_cpu(api, "h100x8", [], args.idle_seconds)
        off = idle_cpu(api, "h100x8", ["--utilization-interval", "0"], args.idle_seconds)
        table.value(f"h100x8: CPU during {args.idle_seconds:.0f} s idle, sampling every 10 s",
                    f"{on:.2f} s", f"{on / args.idle_seconds * 100:.2f} % of a core")
        table.value(f"h100x8: CPU during {args.idle_seconds:.0f} s idle, no sampling",
                    f"{off:.2f} s", f"{off / args.idle_seconds * 100:.2f} % of a core")

    # -- utilization sampling: CPU per sample -------------------------------------------------
    bench_utilization(table, scratch, max(20, runs // 4))

    # -- GPU sharing: shares of consumable capacity under the GPU's MPS daemon ------------------
    bench_sharing(table, max(10, runs // 10), p)
    # -- dynamic MIG: publish 8 H100s' partitions, create one at each prepare -------------------
    bench_dynamic_mig(table, max(10, runs // 5), p)

    # -- where a large node's publish time goes (in-process) ------------------------------------
    from driver.devices import mock
    from driver.devices.discovery import discover
    from driver.publish.publisher import Publisher

    t = time.perf_counter()
    node = mock.build(mock.load("sriov-large"), scratch / "large")
    table.value("sriov-large: write the mock sysfs tree", f"{(time.perf_counter() - t) * 1000:.0f} ms",
                "mock-only cost, no real node pays it")
    sources = node.sources()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        result = discover(sources)
        times.append(time.perf_counter() - t)
    full = table.latency("sriov-large: discovery of 2,048 devices", times)
    bench_rediscovery(table, scratch, sources, result, full)
    bench_periodic_checks(table, sources.sysfs, node.dev, result)
    with ApiServer() as api:
        api.add_node(NODE)
        publisher = Publisher(Kube(api_client(api.kubeconfig(scratch))), DRIVER, NODE,
                              inventory=lambda: result.inventory)
        t = time.perf_counter()
        writes = publisher.reconcile()
        table.value("sriov-large: first reconcile (16 slices)", f"{(time.perf_counter() - t) * 1000:.0f} ms",
                    f"{writes} writes")
        # B: a LIST on every pass (what a reconcile does while the watch is down).
        times, cpu = [], time.process_time()
        for _ in range(5):
            t = time.perf_counter()
            publisher._relist = True
            assert publisher.reconcile() == 0
            times.append(time.perf_counter() - t)
        listing_cpu = (time.process_time() - cpu) / 5
        listing = table.latency("sriov-large: no-change reconcile, LIST each pass", times,
                                f"0 writes; {listing_cpu * 1000:.1f} ms CPU incl. the emulator's encoding")
        # A: the copy the watch keeps (list once, then watch), as the driver runs.
        publisher.resync_seconds = 3600
        loop = asyncio.new_event_loop()

        async def publishing() -> None:
            try:
                await publisher.run()
            except asyncio.CancelledError:
                pass  # the benchmark is done with it

        runner = threading.Thread(target=loop.run_until_complete, args=(publishing(),), daemon=True)
        runner.start()
        wait(lambda: publisher.cache.synced, 30)
        time.sleep(0.5)
        times, cpu, lists = [], time.process_time(), publisher.stats.lists
        for _ in range(max(20, runs)):
            t = time.perf_counter()
            assert publisher.reconcile() == 0
            times.append(time.perf_counter() - t)
        cached_cpu = (time.process_time() - cpu) / len(times)
        assert publisher.stats.lists == lists
        cached = table.latency("sriov-large: no-change reconcile, the watch's copy", times,
                               f"0 writes, 0 requests; {cached_cpu * 1000:.3f} ms CPU")
        table.value("sriov-large: no-change reconcile, LIST / watch's copy", f"{listing / cached:.0f}x")
        loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
        runner.join(10)

    # -- publish -------------------------------------------------------------------------------
    for profile, expected in (("mixed", 3), ("sriov-large", 16)):
        with ApiServer() as api:
            api.add_node(NODE)
            driver = Driver(api, profile)
            started = driver.start()
            ok = wait(lambda: len(api.state.slices) == expected and
                      sum(len(s["spec"]["devices"]) for s in api.state.slices.values()) > 0, 300)
            elapsed = time.perf_counter() - started
            devices = sum(len(s["spec"]["devices"]) for s in api.slices())
            writes = len(api.writes())
            table.value(f"publish {profile}: start -> all slices", f"{elapsed * 1000:.0f} ms" if ok else "timeout",
                        f"{devices} devices, {expected} slices, {writes} writes")
            api.reset_writes()
            # A republish with no change: force reconciles via the watch (touch nothing) and a
            # rediscovery; count writes.
            time.sleep(2.0)
            table.value(f"publish {profile}: writes when nothing changed", str(len(api.writes())))
            driver.stop()
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
