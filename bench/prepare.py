"""Prepare and unprepare: latency of one claim against the floor sampled between the
prepares, throughput of batches and concurrent requests, scaling with 1,000 prepared
claims, and the A/Bs of one run (claim status writes off, a narrower claim pool,
utilization sampling off)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.floor import Floor
from bench.harness import Driver, new_claim, settle, wait
from bench.idle import idle_cpu
from bench.table import Table, pct, pq_ratio
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import FakeKubelet


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


def bench_prepare(table: Table, api: ApiServer, scratch: Path, runs: int, idle_seconds: float,
                  base: Floor) -> float:
    """The mixed node's driver: every figure of a prepare. `base`: the floor sampled
    before start-up, printed beside the one sampled between the prepares. Returns the
    median exclusive prepare, which later sections compare with."""
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
    time.sleep(idle_seconds)
    table.value(f"CPU during {idle_seconds:.0f} s idle", f"{driver.cpu_seconds() - cpu0:.2f} s")
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
    on = idle_cpu(api, "h100x8", [], idle_seconds)
    off = idle_cpu(api, "h100x8", ["--utilization-interval", "0"], idle_seconds)
    table.value(f"h100x8: CPU during {idle_seconds:.0f} s idle, sampling every 10 s",
                f"{on:.2f} s", f"{on / idle_seconds * 100:.2f} % of a core")
    table.value(f"h100x8: CPU during {idle_seconds:.0f} s idle, no sampling",
                f"{off:.2f} s", f"{off / idle_seconds * 100:.2f} % of a core")
    return p
