"""Start-up: process start until the kubelet's GetInfo is answered, against the floor of
any Python driver (the interpreter importing what serving needs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.harness import DRIVER, Driver, wait, with_bytecode
from bench.table import Table
from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.sim.apiserver import ApiServer


def bench_startup(table: Table, api: ApiServer, scratch: Path, starts: int) -> float:
    """Process start -> GetInfo answered on the registration socket, the median of
    `starts` starts with bytecode, beside the floor of any Python driver measured in the
    same run: the interpreter starting and importing driver.service.plugin (what serving needs)."""
    env = with_bytecode(scratch)
    subprocess.run([sys.executable, "-c", "import driver.service.plugin, driver.cli"], env=env, check=True)
    imports = []
    for _ in range(starts):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import driver.service.plugin"], env=env, check=True)
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
    floor = table.latency("start-up floor: python -c 'import driver.service.plugin'", imports)
    median = table.latency("start-up: process start -> GetInfo answered", times,
                           f"{starts} starts, with bytecode; the mock node's sysfs tree is written first")
    table.value("start-up / floor", f"{median / floor:.2f}x")
    return median
