"""driver/nri/plugin.py against a runtime speaking NRI's wire protocol: the Python fake of
tests/nri_runtime.py, and NRI's own Go runtime code (hack/nri-runtime) where Go is here."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from driver._proto.nri.v1alpha1 import api_pb2 as api
from driver.nri import ttrpc
from driver.nri.plugin import NriOptions, NriPlugin, event_mask, netns_path
from tests import nri_runtime
from tests.nri_runtime import FakeRuntime, pod


class Recorder:
    """PodEvents that remember what they were told; `delay` makes run_pod_sandbox slow."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.delay = delay
        self.fail = fail
        self.finished = asyncio.Event()

    async def synchronize(self, pods) -> None:
        self.calls.append(("sync", tuple(sorted(p.uid for p in pods))))

    async def run_pod_sandbox(self, sandbox) -> None:
        self.calls.append(("run", (sandbox.uid, netns_path(sandbox) or "")))
        if self.delay:
            await asyncio.sleep(self.delay)
            self.finished.set()
        if self.fail:
            raise ValueError(self.fail)

    async def stop_pod_sandbox(self, sandbox) -> None:
        self.calls.append(("stop", (sandbox.uid,)))

    async def remove_pod_sandbox(self, sandbox) -> None:
        self.calls.append(("remove", (sandbox.uid,)))

    async def create_container(self, sandbox, container) -> None:
        self.calls.append(("create", (sandbox.uid, container.name)))


def options(socket: Path) -> NriOptions:
    return NriOptions(socket=socket, backoff_initial=0.05, backoff_max=0.2)


async def wait(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


@pytest.fixture
def sock(tmp_path_factory) -> Path:
    # Short: unix socket paths end at 107 bytes.
    import tempfile
    directory = Path(tempfile.mkdtemp(prefix="dra-nri-"))
    yield directory / "nri.sock"
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


def test_register_configure_split_sync_and_pod_events(sock: Path) -> None:
    async def main() -> None:
        runtime = FakeRuntime(sock, pods=[pod("a", "/run/netns/a"), pod("b"), pod("c")],
                              sync_chunk=1)
        await runtime.start()
        events = Recorder()
        plugin = NriPlugin(options(sock), events)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(runtime.synchronized.wait(), 10)
        await asyncio.wait_for(plugin.ready.wait(), 5)
        assert [(r.plugin_name, r.plugin_idx) for r in runtime.registrations] == [
            ("dra-accel-driver", "10")]
        # Bits 1-4: RunPodSandbox, StopPodSandbox, RemovePodSandbox, CreateContainer.
        assert runtime.subscribed == event_mask(
            api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX,
            api.CREATE_CONTAINER) == 0b1111
        # Three Synchronize messages (more, more, last) reach the handler as one list.
        assert events.calls == [("sync", ("a", "b", "c"))]

        sandbox = pod("d", "/run/netns/d", namespace="ml", name="trainer")
        for method, message in [("RunPodSandbox", api.RunPodSandboxRequest(pod=sandbox)),
                                ("StopPodSandbox", api.StopPodSandboxRequest(pod=sandbox)),
                                ("RemovePodSandbox", api.RemovePodSandboxRequest(pod=sandbox))]:
            answer = await runtime.call(method, message)
            assert (answer.code, answer.message) == (0, "")
        answer = await runtime.call("CreateContainer", api.CreateContainerRequest(
            pod=sandbox, container=api.Container(id="c1", name="main", pod_sandbox_id="sb-d")))
        assert (answer.code, answer.message) == (0, "")
        # No adjustment of the container: an empty CreateContainerResponse.
        assert api.CreateContainerResponse.FromString(answer.payload) == \
            api.CreateContainerResponse()
        assert events.calls[1:] == [("run", ("d", "/run/netns/d")), ("stop", ("d",)),
                                    ("remove", ("d",)), ("create", ("d", "main"))]
        # Events it did not subscribe to are not served.
        answer = await runtime.call("StartContainer", api.StartContainerRequest(pod=sandbox))
        assert answer.code == ttrpc.Code.UNIMPLEMENTED
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())


def test_a_failing_event_is_the_runtimes_error_and_the_plugin_stays(sock: Path) -> None:
    async def main() -> None:
        runtime = FakeRuntime(sock)
        await runtime.start()
        plugin = NriPlugin(options(sock), Recorder(fail="NIC nic-0000-41-00-2 is gone"))
        seen = []
        plugin.observe = lambda event, seconds, failed: seen.append((event, failed))
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 10)
        answer = await runtime.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod("x")))
        assert answer.code == ttrpc.Code.UNKNOWN
        assert answer.message == "RunPodSandbox: NIC nic-0000-41-00-2 is gone"
        answer = await runtime.call("StopPodSandbox", api.StopPodSandboxRequest(pod=pod("x")))
        assert answer.code == 0
        assert len(runtime.registrations) == 1
        assert seen == [("Synchronize", False), ("RunPodSandbox", True),
                        ("StopPodSandbox", False)]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())


def test_event_times_and_errors_reach_the_drivers_metrics(tmp_path) -> None:
    from driver.devices.model import Inventory
    from driver.metrics import Metrics
    from driver.nri import setup

    metrics = Metrics("accel.dra.io")
    plugin, _ = setup.make(tmp_path / "nri.sock", tmp_path, Path("/proc"),
                           lambda: Inventory(devices=()), lambda: [], None, False, "t", metrics)
    plugin.observe("RunPodSandbox", 0.03, False)
    plugin.observe("RunPodSandbox", 1.7, True)
    sample = metrics.registry.get_sample_value
    assert sample("dra_driver_nri_event_duration_seconds_count", {"event": "RunPodSandbox"}) == 2
    assert sample("dra_driver_nri_event_duration_seconds_bucket",
                  {"event": "RunPodSandbox", "le": "0.05"}) == 1
    assert sample("dra_driver_nri_event_errors_total", {"event": "RunPodSandbox"}) == 1


def test_slow_work_is_answered_before_the_runtimes_deadline(sock: Path) -> None:
    """A RunPodSandbox that would outlast the request timeout is answered with an error
    in time (a timeout would make the runtime drop the plugin), and the work finishes."""
    async def main() -> None:
        runtime = FakeRuntime(sock, request_timeout_ms=400)
        await runtime.start()
        events = Recorder(delay=0.6)
        plugin = NriPlugin(options(sock), events)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 10)
        assert plugin.request_timeout == 0.4
        answer = await runtime.call("RunPodSandbox", api.RunPodSandboxRequest(pod=pod("s")))
        assert answer.code == ttrpc.Code.UNAVAILABLE
        assert "took longer than 0.30s" in answer.message
        assert answer.seconds < 0.4
        await asyncio.wait_for(events.finished.wait(), 5)  # shielded, not cancelled
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())


def test_runtime_restart_reregisters_and_resyncs(sock: Path) -> None:
    async def main() -> None:
        runtime = FakeRuntime(sock, pods=[pod("a")])
        await runtime.start()
        events = Recorder()
        plugin = NriPlugin(options(sock), events)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(runtime.synchronized.wait(), 10)
        await runtime.stop()
        await wait(lambda: not plugin.ready.is_set())
        # Down for a while: the plugin keeps dialling with backoff, without crashing.
        await asyncio.sleep(0.5)
        assert not task.done()
        restarted = FakeRuntime(sock, pods=[pod("a"), pod("b")])
        await restarted.start()
        await asyncio.wait_for(restarted.synchronized.wait(), 10)
        await wait(lambda: plugin.sessions == 2)
        assert events.calls == [("sync", ("a",)), ("sync", ("a", "b"))]
        assert len(restarted.registrations) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await restarted.stop()

    asyncio.run(main())


def test_plugin_restart_registers_again_with_the_same_runtime(sock: Path) -> None:
    async def main() -> None:
        runtime = FakeRuntime(sock, pods=[pod("a")])
        await runtime.start()
        first = asyncio.create_task(NriPlugin(options(sock), Recorder()).run())
        await asyncio.wait_for(runtime.synchronized.wait(), 10)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        events = Recorder()
        second_plugin = NriPlugin(options(sock), events)
        second = asyncio.create_task(second_plugin.run())
        await asyncio.wait_for(second_plugin.ready.wait(), 10)
        assert len(runtime.registrations) == 2
        assert events.calls == [("sync", ("a",))]
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())


def test_no_runtime_yet_is_not_an_error(sock: Path) -> None:
    """The driver may start before the runtime's socket exists (node boot)."""
    async def main() -> None:
        plugin = NriPlugin(options(sock), Recorder())
        task = asyncio.create_task(plugin.run())
        await asyncio.sleep(0.4)
        assert not task.done()
        runtime = FakeRuntime(sock)
        await runtime.start()
        await asyncio.wait_for(plugin.ready.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()

    asyncio.run(main())


@pytest.fixture(scope="module")
def go_runtime_binary(tmp_path_factory) -> Path:
    reason = nri_runtime.go_available()
    if reason:
        pytest.skip(reason)
    return nri_runtime.build_go_runtime(tmp_path_factory.mktemp("nri-runtime"))


def test_against_nris_own_runtime_code(go_runtime_binary: Path, sock: Path) -> None:
    """Registration, sync, pod events and a runtime restart against pkg/adaptation, with
    the time each RunPodSandbox took as the runtime measures it."""
    async def main() -> None:
        runtime = nri_runtime.GoRuntime(go_runtime_binary, sock)
        runtime.command("add", pod={"id": "sb-old", "uid": "old", "name": "old",
                                    "namespace": "default", "netns": "/run/netns/old"})
        events = Recorder()
        plugin = NriPlugin(options(sock), events)
        task = asyncio.create_task(plugin.run())
        try:
            await asyncio.wait_for(plugin.ready.wait(), 15)
            assert events.calls == [("sync", ("old",))]
            latencies = []
            for i in range(50):
                spec = {"id": f"sb-{i}", "uid": f"u{i}", "name": f"p{i}", "namespace": "ml",
                        "netns": f"/run/netns/p{i}"}
                answer = await asyncio.to_thread(runtime.command, "run", pod=spec)
                assert "error" not in answer, answer
                latencies.append(answer["ms"])
                for op in ("stop", "remove"):
                    answer = await asyncio.to_thread(runtime.command, op, id=f"sb-{i}")
                    assert "error" not in answer, answer
            assert [c for c in events.calls if c[0] == "run"][:2] == [
                ("run", ("u0", "/run/netns/p0")), ("run", ("u1", "/run/netns/p1"))]
            assert len(events.calls) == 1 + 3 * 50
            p50, p99 = statistics.quantiles(latencies, n=100)[49], max(latencies)
            print(f"RunPodSandbox round trip through NRI's runtime: p50 {p50:.2f} ms, "
                  f"max {p99:.2f} ms")
            assert p99 < 500

            events.fail = "no NIC"
            answer = await asyncio.to_thread(runtime.command, "run", pod={
                "id": "sb-bad", "uid": "bad", "name": "bad", "namespace": "ml", "netns": ""})
            assert "no NIC" in answer["error"]
            events.fail = None

            runtime.stop()
            await wait(lambda: not plugin.ready.is_set())
            runtime = nri_runtime.GoRuntime(go_runtime_binary, sock)
            runtime.command("add", pod={"id": "sb-x", "uid": "x", "name": "x",
                                        "namespace": "default", "netns": "/run/netns/x"})
            await wait(lambda: plugin.sessions == 2, 15)
            assert events.calls[-1][0] == "sync"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            runtime.stop()

    asyncio.run(main())
