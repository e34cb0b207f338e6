"""The real Plugin in this process, on an event loop in a background thread, so tests
can reach the mock's fake NVML (inject XIDs) and the loop itself (block it)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from concurrent.futures import Future

from driver.explain.capacitymetrics import CapacityCollector
from driver.service.config import add_arguments, build
from driver.kube.client import Kube
from driver.service.plugin import Plugin
from driver.sim.apiserver import ApiServer
from tests.driverproc import DRIVER, DriverDirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessPlugin:
    def __init__(self, api: ApiServer, dirs: DriverDirs, profile: str = "mixed", *extra: str) -> None:
        self.metrics_port = free_port()
        self.healthz_port = free_port()
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args([
            "--node-name", "node-a", "--driver-name", DRIVER, "--mock", profile,
            "--kubeconfig", str(api.kubeconfig(dirs.root)),
            "--kubelet-registrar-dir", str(dirs.registry), "--kubelet-plugins-dir", str(dirs.plugins),
            "--cdi-root", str(dirs.cdi), "--state-dir", str(dirs.state),
            "--metrics-port", str(self.metrics_port), "--healthz-port", str(self.healthz_port),
            "--health-interval", "1", *extra,
        ])
        self.config = build(args, {})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.plugin: Plugin | None = None
        self.kube: Kube | None = None  # set before entering to give the plugin this client

    def call(self, coroutine, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __enter__(self) -> "InProcessPlugin":
        self.thread.start()
        self.plugin = Plugin.create(self.config, self.kube, capacity_gauges=CapacityCollector)  # as `run` does
        self.call(self.plugin.start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self.plugin.stop())
            # stop() gives up on a task after a grace period rather than hang; here a task
            # that outlived it is a bug (one that swallowed its cancellation), not a pass.
            running = [t.get_name() for t in self.plugin._tasks if not t.done()]
            assert not running, f"tasks still running after Plugin.stop(): {running}"
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def block_loop(self, seconds: float) -> Future:
        import time

        done: Future = Future()

        def blocker():
            time.sleep(seconds)
            done.set_result(True)

        self.loop.call_soon_threadsafe(blocker)
        return done
