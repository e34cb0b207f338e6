"""The sriov-large node (2,048 VFs, 16 slices): discovery, rediscovery after a VF comes,
the periodic health probe and counters, and no-change reconciles of the publisher."""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import DRIVER, NODE, wait
from bench.table import Table
from driver.kube.client import Kube, api_client
from driver.monitoring.devicemetrics import DeviceSeries
from driver.sim.apiserver import ApiServer

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


def bench_large_node(table: Table, scratch: Path, runs: int) -> None:
    """Where a large node's publish time goes, in-process: writing the mock tree,
    discovery, rediscovery, the periodic checks and no-change reconciles."""
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
