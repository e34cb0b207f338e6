"""Publishing as a user meets it: a driver process from start until all its slices are
stored, and the writes it makes when nothing changed."""

from __future__ import annotations

import time

from bench.harness import NODE, Driver, wait
from bench.table import Table
from driver.sim.apiserver import ApiServer


def bench_publish(table: Table) -> None:
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
