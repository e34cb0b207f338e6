"""This checkout's driver against another's (`--against`), their prepares alternating
on one emulator so that both meet the same moments of a noisy machine."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.floor import Floor
from bench.harness import Driver, new_claim, settle, wait
from bench.table import Table, pct
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import FakeKubelet


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
