"""A seamless upgrade as it happens on a node, and registration against a strict kubelet.

The two-instance test starts both driver processes exactly as the chart does: default
ports, the same host directories, two pod UIDs, each process in a network namespace of its
own (pods without hostNetwork). The kubelet is driver/sim/kubelet.py's PluginWatcher, which
like the real one registers each socket once and never retries a rejected one.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from driver._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.sim.apiserver import TOKEN, ApiServer
from driver.sim.kubelet import PluginWatcher
from tests import netns
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_crash_safety import assert_consistent
from tests.test_plugin_integration import GPU, GPU2, NIC, VF, new_claim, result

NETNS_MISSING = netns.available()
CI = os.environ.get("CI") == "true"
NETNS_SCRIPT = str(Path(netns.__file__).resolve())


def wait(predicate, timeout: float = 20.0, what="condition") -> None:
    """`what` may be a callable: evaluated on time-out (a driver log read then, not now)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


def registered(watcher: PluginWatcher, uid: str) -> bool:
    return any(uid in name for name in watcher.registered)


def socket_of(watcher: PluginWatcher, uid: str) -> str:
    return next(name for name in watcher.registered if uid in name)


def get(sock: Path, path: str) -> int:
    try:
        return netns.http_get(sock, path)[0]
    except OSError:
        return 0


@pytest.mark.skipif(NETNS_MISSING is not None and not CI, reason=f"needs network namespaces: {NETNS_MISSING}")
def test_two_instances_as_the_chart_starts_them():
    assert NETNS_MISSING is None, f"CI must be able to run this: {NETNS_MISSING}"
    dirs = DriverDirs.make()
    old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
    quiet: set[str] = set()  # pod UIDs whose registration the kubelet leaves unanswered

    def decide(info, path):
        return PluginWatcher.SILENT if any(uid in path.name for uid in quiet) else None

    with ApiServer() as api, PluginWatcher(dirs.registry, decide=decide) as kubelet:
        api.add_node("node-a")
        port = api.httpd.server_address[1]
        api_socket = dirs.root / "api.sock"
        netns.Forwarder(netns.unix_listener(str(api_socket)), netns.to_tcp(port))

        def pod(uid: str) -> DriverProcess:
            wrapper = ["unshare", "--net", sys.executable, NETNS_SCRIPT,
                       f"--tcp-to-unix={port}={api_socket}",
                       f"--unix-to-tcp={dirs.root}/healthz-{uid[:8]}.sock=9401",
                       f"--unix-to-tcp={dirs.root}/metrics-{uid[:8]}.sock=9400", "--"]
            return DriverProcess(api, dirs, wrapper=wrapper, disable_ports=False,
                                 extra=["--pod-uid", uid, "--registration-timeout", "2"])

        def healthz(uid: str, path: str = "/readyz") -> int:
            return get(dirs.root / f"healthz-{uid[:8]}.sock", path)

        old = pod(old_uid).start()
        wait(lambda: registered(kubelet, old_uid), what=lambda: f"old pod registered; log:\n{old.log()}")
        wait(lambda: healthz(old_uid) == 200, what="old pod ready")
        wait(lambda: len(api.slices()) == 3, what="slices published")
        old_client = kubelet.client(socket_of(kubelet, old_uid))
        first = new_claim(api, "before", [result("gpu", GPU)])
        assert old_client.prepare([first]).claims[first.uid].error == ""
        api.reset_writes()

        # The surge pod starts while the old one serves; the kubelet does not answer its
        # first registration. Its readiness must say so, whatever the old pod answers.
        quiet.add(new_uid)
        new = pod(new_uid).start()
        wait(lambda: any(new_uid in a.socket and a.outcome == "no answer" for a in kubelet.attempts),
             what=lambda: f"new pod offered its registration; log:\n{new.log()}")
        wait(lambda: healthz(new_uid, "/livez") == 200, what="new pod live")
        assert healthz(new_uid) == 503, "not registered yet: not ready"
        assert healthz(old_uid) == 200
        assert get(dirs.root / f"metrics-{new_uid[:8]}.sock", "/metrics") == 200
        assert get(dirs.root / f"metrics-{old_uid[:8]}.sock", "/metrics") == 200

        # It re-offers a new socket (the kubelet never retries one), which is accepted.
        quiet.clear()
        wait(lambda: registered(kubelet, new_uid), what=lambda: f"new pod re-registered; log:\n{new.log()}")
        wait(lambda: healthz(new_uid) == 200, what="new pod ready")
        assert "kubelet_registration_retry" in new.log()
        new_client = kubelet.client(socket_of(kubelet, new_uid))
        assert new_client.prepare([first]).claims[first.uid] == old_client.prepare([first]).claims[first.uid]

        # A burst through both instances leaves one consistent state.
        devices = [GPU2, NIC, VF, "nic-0000-22-00-0", "nic-0000-41-00-3", "nic-0000-41-00-4"]
        claims = [new_claim(api, f"burst{i}", [result("r", d)]) for i, d in enumerate(devices)]
        errors: list[str] = []

        def churn(client, seed):
            rng = random.Random(seed)
            for _ in range(30):
                claim = rng.choice(claims)
                if rng.random() < 0.5:
                    errors.extend(e.error for e in client.prepare([claim]).claims.values() if e.error)
                else:
                    errors.extend(e.error for e in client.unprepare([claim]).claims.values() if e.error)

        threads = [threading.Thread(target=churn, args=(c, s))
                   for s, c in enumerate([old_client, new_client, old_client, new_client])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        keep = {c.uid for c in claims[:3]}
        for claim in claims:
            (new_client.prepare if claim.uid in keep else old_client.unprepare)([claim])
        assert_consistent(dirs, keep | {first.uid}, {c.uid for c in claims} - keep)
        assert api.writes() == [], "the overlap with an unchanged inventory writes no slice"

        # The old pod goes; the new one keeps serving alone.
        assert old.terminate() == 0, old.log()
        old_client.close()
        assert sorted(p.name for p in dirs.registry.glob("*.sock")) == [socket_of(kubelet, new_uid)]
        assert healthz(new_uid) == 200
        assert new_client.unprepare([first]).claims[first.uid].error == ""
        for claim in claims[:3]:
            assert new_client.unprepare([claim]).claims[claim.uid].error == ""
        assert_consistent(dirs, set(), {first.uid} | {c.uid for c in claims})
        assert api.writes() == []
        new_client.close()
        assert new.terminate() == 0, new.log()
    dirs.cleanup()


def test_a_rejected_registration_is_offered_again_on_a_new_socket():
    dirs = DriverDirs.make()
    rejections = ["kubelet is not ready for DRA plugins yet"] * 2

    def decide(info, path):
        return rejections.pop(0) if rejections else None

    with ApiServer() as api, PluginWatcher(dirs.registry, decide=decide) as kubelet:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, extra=["--registration-timeout", "30"]).start()
        wait(lambda: kubelet.registered, what=lambda: f"registered after two rejections; log:\n{driver.log()}")
        outcomes = [a.outcome for a in kubelet.attempts]
        assert outcomes == ["rejected: kubelet is not ready for DRA plugins yet"] * 2 + ["registered"]
        sockets = {(a.inode, a.changed_ns) for a in kubelet.attempts}
        assert len(sockets) == 3, "each retry is a new socket at the same name"
        assert len({a.socket for a in kubelet.attempts}) == 1
        log = driver.log()
        assert log.count("kubelet_registration_retry") == 2
        assert "kubelet is not ready for DRA plugins yet" in log
        client = kubelet.client(f"{DRIVER}-reg.sock")
        claim = new_claim(api, "after-retry", [result("gpu", GPU)])
        assert client.prepare([claim]).claims[claim.uid].error == ""
        client.close()
        assert driver.terminate() == 0
    dirs.cleanup()


def test_a_registration_never_confirmed_is_offered_again():
    dirs = DriverDirs.make()
    answered = []

    def decide(info, path):
        if not answered:
            answered.append(path)
            return PluginWatcher.SILENT
        return None

    with ApiServer() as api, PluginWatcher(dirs.registry, decide=decide) as kubelet:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, extra=["--registration-timeout", "1"]).start()
        wait(lambda: kubelet.registered, what=lambda: f"registered on the second offer; log:\n{driver.log()}")
        assert [a.outcome for a in kubelet.attempts] == ["no answer", "registered"]
        assert "no NotifyRegistrationStatus from the kubelet within 1s" in driver.log()
        driver.kill()
    dirs.cleanup()


def test_a_40_character_driver_name_with_seamless_upgrades_works():
    """Directories about as long as the kubelet's on a node: the names with the full pod UID
    exceed 107 bytes; the short hash of the UID (the upstream helper's fallback) fits."""
    dirs = DriverDirs.make()
    driver_name = "gpu-accelerators.infrastructure.examples"
    assert len(driver_name) == 40
    registry, plugins = dirs.root / "plugins_registry", dirs.root / "plugins"
    uid = str(uuid.uuid4())
    with ApiServer() as api, PluginWatcher(registry) as kubelet:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, driver=driver_name, extra=[
            "--pod-uid", uid, "--kubelet-registrar-dir", str(registry),
            "--kubelet-plugins-dir", str(plugins)]).start()
        wait(lambda: kubelet.registered, what=lambda: f"registered; log:\n{driver.log()}")
        (name, info), = kubelet.registered.items()
        assert uid not in name and name.startswith(f"{driver_name}-") and name.endswith("-reg.sock")
        assert len(name) == len(driver_name) + 1 + 8 + len("-reg.sock")
        assert len(str(registry / name)) <= 107 and len(info.endpoint) <= 107
        client = kubelet.client(name)
        claim = new_claim(api, "long", [result("gpu", GPU, driver=driver_name)])
        assert client.prepare([claim]).claims[claim.uid].error == ""
        client.close()
        assert driver.terminate() == 0
    dirs.cleanup()


class _Plugin(reg_grpc.RegistrationServicer):
    def GetInfo(self, request, context):
        return reg_pb2.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint="/nowhere/dra.sock",
                                  supported_versions=["v1.DRAPlugin"])

    def NotifyRegistrationStatus(self, request, context):
        return reg_pb2.RegistrationStatusResponse()


def test_the_kubelet_emulator_registers_each_new_socket_even_on_a_reused_inode_number():
    """As the driver re-offers registration: a new socket renamed over the name, then the
    old one closed. Freed inode numbers come back, and the real kubelet, which reacts to
    the create or rename event, still registers every socket."""
    dirs = DriverDirs.make()
    dirs.registry.mkdir(parents=True)
    name = dirs.registry / f"{DRIVER}-reg.sock"
    offered: list[int] = []
    with PluginWatcher(dirs.registry, decide=lambda info, path: "not yet") as kubelet:
        previous = None
        for i in range(6):
            server = grpc.server(futures.ThreadPoolExecutor(2))
            reg_grpc.add_RegistrationServicer_to_server(_Plugin(), server)
            staging = dirs.registry / f".staging-{i}.sock"
            server.add_insecure_port(f"unix://{staging}")
            server.start()
            os.replace(staging, name)
            offered.append(name.stat().st_ino)
            assert kubelet.wait(lambda k: len(k.attempts) == i + 1, timeout=15), kubelet.attempts
            if previous is not None:
                previous.stop(None)
            previous = server
        previous.stop(None)
    dirs.cleanup()
    assert [a.outcome for a in kubelet.attempts] == ["rejected: not yet"] * 6
    if len(set(offered)) == len(offered):
        pytest.skip(f"this file system gave every socket a new inode number: {offered}")


# -- unhealthy devices across a restart and an upgrade (issue 28.13) ----------------------------
# The sriov mock has an E810 whose PF and 16 VFs have their link down: each is published with a
# link-down taint, and the taints decide how the devices are cut into slices.

def _tainted(api) -> dict[str, list]:
    return {d["name"]: d["taints"] for s in api.slices() for d in s["spec"].get("devices", [])
            if d.get("taints")}


def _settled(api, proc: DriverProcess) -> None:
    """Waits until the instance says its first publish pass is done (or, on a driver that
    does not say so, until it writes), then for a few health passes more."""
    wait(lambda: "slices_in_sync" in proc.log() or api.writes(), timeout=40,
         what=lambda: f"first publish pass; log:\n{proc.log()[-3000:]}")
    time.sleep(3)  # later health passes (every second here) must not write either


def _first_start(api, dirs, uid: str) -> tuple[DriverProcess, dict]:
    proc = DriverProcess(api, dirs, profile="sriov",
                         extra=["--pod-uid", uid, "--health-interval", "1"]).start()
    wait(lambda: len(_tainted(api)) == 17, timeout=40,
         what=lambda: f"17 link-down NICs tainted; log:\n{proc.log()[-3000:]}")
    _settled(api, proc)
    names = sorted(s["metadata"]["name"] for s in api.slices())
    # Nothing was published before the first health pass: each slice written once, with
    # its taints, not an untainted generation first.
    assert sorted(api.writes()) == [("create", n) for n in names], api.writes()
    return proc, _tainted(api)


def test_a_restart_with_unhealthy_devices_writes_nothing():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        old, taints = _first_start(api, dirs, str(uuid.uuid4()))
        assert old.terminate() == 0, old.log()
        api.reset_writes()
        time.sleep(1.1)  # the new process's conditions begin a second later than the old's
        new = DriverProcess(api, dirs, profile="sriov",
                            extra=["--pod-uid", str(uuid.uuid4()), "--health-interval", "1"]).start()
        try:
            _settled(api, new)
            assert api.writes() == [], "an unchanged inventory, unhealthy devices included"
            assert _tainted(api) == taints, "the taints' timeAdded is the first instance's"
        finally:
            new.kill()
    dirs.cleanup()


def test_an_upgrade_with_unhealthy_devices_writes_nothing():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        old, taints = _first_start(api, dirs, str(uuid.uuid4()))
        api.reset_writes()
        time.sleep(1.1)
        new = DriverProcess(api, dirs, profile="sriov",
                            extra=["--pod-uid", str(uuid.uuid4()), "--health-interval", "1"]).start()
        try:
            _settled(api, new)
            assert api.writes() == [], "two instances, an unchanged inventory: no write"
            assert old.terminate() == 0, old.log()
            time.sleep(2)
            assert api.writes() == [] and _tainted(api) == taints
        finally:
            old.kill()
            new.kill()
    dirs.cleanup()


def test_a_new_instance_that_cannot_reach_the_api_server_leaves_the_node_to_the_old_one():
    """The kubelet sends every new call to the newest registration: a surge pod with a bad
    token must not register (nor be ready) while the old pod serves; with no other
    instance left it registers, since nobody else could serve the node."""
    from tests.inprocess import free_port

    dirs = DriverDirs.make()
    old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
    with ApiServer() as api, PluginWatcher(dirs.registry) as kubelet:
        api.add_node("node-a")
        old = DriverProcess(api, dirs, extra=["--pod-uid", old_uid]).start()
        wait(lambda: registered(kubelet, old_uid), what=lambda: f"old pod registered; log:\n{old.log()}")
        bad = dirs.root / "bad-token.kubeconfig"
        bad.write_text(api.kubeconfig(dirs.root).read_text().replace(TOKEN, "revoked-token"))
        port = free_port()
        new = DriverProcess(api, dirs, extra=["--pod-uid", new_uid, "--kubeconfig", str(bad),
                                              "--healthz-port", str(port)]).start()
        wait(lambda: new.log().count('"publish_failed"') >= 2, what=lambda: f"new pod failing; log:\n{new.log()}")
        assert not [a for a in kubelet.attempts if new_uid in a.socket], kubelet.attempts
        assert '"registration_deferred"' in new.log()
        status, body = _get_tcp(port)
        assert status == 503 and "not registering yet" in body and "serve the node" in body, body
        # The node's pods keep being prepared by the old pod.
        client = kubelet.client(socket_of(kubelet, old_uid))
        claim = new_claim(api, "during-a-broken-rollout", [result("gpu", GPU)])
        assert client.prepare([claim]).claims[claim.uid].error == ""
        assert client.unprepare([claim]).claims[claim.uid].error == ""
        client.close()
        # The old pod goes (deleted by hand): the new one is all the node has.
        assert old.terminate() == 0, old.log()
        wait(lambda: registered(kubelet, new_uid), what=lambda: f"new pod registered; log:\n{new.log()}")
        assert '"registration_offered_unpublished"' in new.log()
        assert new.terminate() == 0, new.log()
    dirs.cleanup()


def _get_tcp(port: int) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
