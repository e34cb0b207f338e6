"""GPU sharing and dynamic MIG: the prepares that start an MPS daemon or create a MIG
instance, against an exclusive prepare of the same run."""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from pathlib import Path

from bench.harness import DRIVER, GPU, NODE, Driver, share_claim, wait
from bench.table import Table
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim


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
    with ApiServer() as api:
        api.add_node(NODE)
        driver = Driver(api, "h100x8", ["--mig-mode", "dynamic"])
        started = driver.start()
        ok = wait(lambda: any("partitions" in n for n in api.state.slices), 120)
        time.sleep(0.5)
        stored = api.slices()
        devices = sum(len(s["spec"].get("devices", [])) for s in stored)
        size = sum(len(json.dumps(s)) for s in stored)
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
