"""What an idle driver costs: CPU of a started driver doing nothing, and the CPU of one
utilization sample, tick and scrape against the NVML calls alone."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import DRIVER, NODE, Driver, wait, with_bytecode
from bench.table import Table
from driver.monitoring.devicemetrics import DeviceSeries
from driver.sim.apiserver import ApiServer


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
