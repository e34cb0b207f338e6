"""No short-lived files in the kubelet's plugins_registry.

The real kubelet's plugin watcher stats every file created there before it ignores
dot-names, and logs an error for one that is already gone (seen on the local cluster of
tests/cluster: the driver's private socket name, renamed into place, and the preflight's
write probe). driver/sim/kubelet.py's PluginWatcher now does the same from inotify
events; these tests hold the driver to it."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from driver.kubelet.sockets import OwnedSocket, registration_ours, sweep_private, sweep_public
from driver.service.preflight import writable_directory
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import PluginWatcher
from tests.driverproc import DRIVER, DriverDirs, DriverProcess

LAG = 0.3  # a kubelet whose event loop is busy stats late; every short-lived name shows


def wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_emulated_watcher_reports_a_name_gone_before_its_stat(tmp_path):
    with PluginWatcher(tmp_path, stat_lag=LAG) as watcher:
        (tmp_path / ".kept").write_text("")
        gone = tmp_path / ".gone"
        gone.write_text("")
        gone.unlink()
        time.sleep(LAG + 0.3)
    assert len(watcher.errors) == 1 and str(gone) in watcher.errors[0], watcher.errors


def test_the_driver_leaves_no_short_lived_name_in_the_registry():
    dirs = DriverDirs.make()
    with ApiServer() as api, PluginWatcher(dirs.registry, stat_lag=LAG) as kubelet:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, extra=["--pod-uid", str(uuid.uuid4())]).start()
        wait(lambda: kubelet.registered, "registration")
        time.sleep(LAG + 0.3)
        assert kubelet.errors == [], kubelet.errors
        assert driver.terminate() == 0, driver.log()[-3000:]
        time.sleep(LAG + 0.3)
    assert kubelet.errors == [], kubelet.errors
    assert [p.name for p in dirs.registry.iterdir()] == [], "the driver left files behind"
    dirs.cleanup()


def test_the_write_probe_makes_no_name(tmp_path):
    with PluginWatcher(tmp_path, stat_lag=LAG) as watcher:
        writable_directory(tmp_path, "--kubelet-registrar-dir")
        time.sleep(LAG + 0.3)
    assert watcher.errors == [] and list(tmp_path.iterdir()) == []


def test_a_socket_offered_again_and_what_a_killed_instance_left(tmp_path):
    import socket

    def bound(sock: OwnedSocket) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.bind(sock.address().removeprefix("unix://"))
        s.listen()
        return s

    public = tmp_path / "drv-reg.sock"
    first = OwnedSocket(public, "aaaa")
    s1 = bound(first)
    first.publish()
    assert public.stat().st_ino == first.inode
    second = OwnedSocket(public, "aaaa")
    second._counter = first._counter  # the same instance's next private name
    s2 = bound(second)
    second.publish(replaces=first)
    assert public.stat().st_ino == second.inode != first.inode
    s1.close()
    (tmp_path / ".s-aaaa-0").unlink()  # what gRPC does when the first server stops
    assert second.remove() and not public.exists()
    assert not (tmp_path / ".s-aaaa-1").exists(), "remove() takes the private name too"
    s2.close()
    # a killed instance's private name stays behind; a live one's is kept
    dead, alive = tmp_path / ".s-dead-0", tmp_path / ".s-live-0"
    for p in (dead, alive):
        p.write_text("")
    states = {"dead": "dead", "live": "alive"}
    assert sweep_private(tmp_path, lambda t: states.get(t, "unknown")) == [dead]
    old = tmp_path / ".s-gone-3"
    old.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert sweep_private(tmp_path, lambda t: states.get(t, "unknown")) == [old]
    assert alive.exists()


def test_public_sockets_nobody_listens_on_are_swept_only_when_ours(tmp_path):
    import socket

    def bound(path: Path, listen: bool = True) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        if listen:
            s.listen()
        return s

    live = bound(tmp_path / "drv-live-reg.sock")
    dead = tmp_path / "drv-dead-reg.sock"
    bound(dead).close()  # the file stays, as after a SIGKILL: a connect is refused
    other = tmp_path / "other.example-dead-reg.sock"  # another driver's: not ours to judge
    bound(other).close()
    hashed = tmp_path / "dra-0123456789abcdef-reg.sock"
    bound(hashed).close()
    os.link(hashed, tmp_path / ".s-gone-0")  # the private name of a dead instance of ours
    kept = tmp_path / "dra-fedcba9876543210-reg.sock"
    bound(kept).close()
    states = {"gone": "dead"}
    removed = sweep_public(tmp_path, registration_ours("drv"), lambda t: states.get(t, "unknown"))
    assert sorted(removed) == sorted([dead, hashed])
    assert (tmp_path / "drv-live-reg.sock").exists() and other.exists() and kept.exists()
    live.close()


def test_a_killed_instances_sockets_are_gone_once_the_next_one_starts():
    """The real kubelet keeps a registration while its socket file is there and retries
    the dead plugin's health stream every 10 s; the next instance removes both files."""
    dirs = DriverDirs.make()
    with ApiServer() as api, PluginWatcher(dirs.registry) as kubelet:
        api.add_node("node-a")
        first_uid, second_uid = str(uuid.uuid4()), str(uuid.uuid4())
        first = DriverProcess(api, dirs, extra=["--pod-uid", first_uid]).start()
        wait(lambda: any(first_uid in n for n in kubelet.registered), "the first registration")
        plugin_dir = dirs.plugins / DRIVER
        assert (plugin_dir / f"dra-{first_uid}.sock").exists()
        first.kill()
        assert (dirs.registry / f"{DRIVER}-{first_uid}-reg.sock").exists(), "SIGKILL leaves it"
        second = DriverProcess(api, dirs, extra=["--pod-uid", second_uid]).start()
        wait(lambda: any(second_uid in n for n in kubelet.registered), "the second registration")
        wait(lambda: not any(first_uid in n for n in kubelet.registered), "the dead one deregistered")
        left = {p.name for d in (dirs.registry, plugin_dir) for p in d.iterdir()
                if not p.name.startswith(".")}
        assert left == {f"{DRIVER}-{second_uid}-reg.sock", f"dra-{second_uid}.sock"}, left
        assert "dead_instance_socket_removed" in second.log()
        assert second.terminate() == 0, second.log()[-3000:]
    dirs.cleanup()
