"""Start-up order: the registration socket before the API client on a starting node, the
API client first and the registration after the first publish during an upgrade, and what
a kubeconfig that only making the client rejects does in each case (one that reading it
rejects stops the driver in preflight)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from driver.state.instance import Instance
from driver.kube.client import Kube, api_client
from driver.sim.apiserver import ApiServer
from tests.driverproc import DRIVER, DriverDirs
from tests.inprocess import InProcessPlugin

# A kubeconfig that reads well, so preflight passes it; making the client then finds that
# its client certificate and key (files that exist, written by dirs_with) are not PEM.
# (A CA that is not a certificate is caught by preflight: tests/test_run_validates_first.py.)
BAD_CA = """apiVersion: v1
kind: Config
current-context: c
contexts: [{name: c, context: {cluster: k, user: u}}]
clusters: [{name: k, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {client-certificate: client.crt, client-key: client.key}}]
"""
# Preflight sees this one: its context names a cluster the file does not have.
DANGLING_CONTEXT = """apiVersion: v1
kind: Config
current-context: c
contexts: [{name: c, context: {cluster: gone, user: u}}]
clusters: []
users: [{name: u, user: {token: t}}]
"""


def recording_client(plugin: InProcessPlugin, seen: list[bool]) -> Kube:
    """A deferred client that notes whether the registration socket existed when made."""
    config = plugin.config

    def make():
        seen.append(config.registration_socket.exists())
        return api_client(config.kubeconfig, connections=config.api_connections)

    return Kube(None, make_client=make)


def test_a_starting_node_offers_registration_before_it_makes_the_api_client():
    dirs = DriverDirs.make()
    seen: list[bool] = []
    with ApiServer() as api:
        api.add_node("node-a")
        plugin = InProcessPlugin(api, dirs, "mixed", "--utilization-interval", "0")
        plugin.kube = recording_client(plugin, seen)
        with plugin:
            assert seen == [True], "made once, after the registration socket appeared"
            assert api.wait_for(lambda: len(api.state.slices) == 3), "and the client works"
    dirs.cleanup()


def test_during_an_upgrade_the_api_client_comes_before_the_registration_socket():
    dirs = DriverDirs.make()
    seen: list[bool] = []
    peer = Instance.register(dirs.state, "the-running-pod")
    try:
        with ApiServer() as api:
            api.add_node("node-a")
            plugin = InProcessPlugin(api, dirs, "mixed", "--utilization-interval", "0")
            plugin.kube = recording_client(plugin, seen)
            with plugin:
                # ... and the registration socket only once this instance has published.
                deadline = time.monotonic() + 20
                while not plugin.config.registration_socket.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert plugin.plugin.publisher.stats.published
                assert plugin.config.registration_socket.exists()
    finally:
        peer.release()
    assert seen == [False]
    dirs.cleanup()


def run_driver(dirs: DriverDirs, kubeconfig: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "driver", "run", "--node-name", "node-a", "--driver-name", DRIVER,
         "--mock", "mixed", "--kubeconfig", str(kubeconfig),
         "--kubelet-registrar-dir", str(dirs.registry), "--kubelet-plugins-dir", str(dirs.plugins),
         "--cdi-root", str(dirs.cdi), "--state-dir", str(dirs.state),
         "--metrics-port", "0", "--healthz-port", "0", "--log-format", "json"],
        capture_output=True, text=True, timeout=60)


def dirs_with(kubeconfig_text: str) -> tuple[DriverDirs, Path]:
    dirs = DriverDirs.make()
    kubeconfig = dirs.root / "kubeconfig"
    kubeconfig.write_text(kubeconfig_text)
    (dirs.root / "client.crt").write_text("not a certificate\n")
    (dirs.root / "client.key").write_text("not a key\n")
    return dirs, kubeconfig


def client_error(kubeconfig: Path) -> str:
    return f"dra-driver: configuration error: kubeconfig {kubeconfig}: cannot use its TLS settings: "


def test_a_kubeconfig_that_reads_wrong_stops_the_driver_before_it_offers_a_socket():
    dirs, kubeconfig = dirs_with(DANGLING_CONTEXT)
    proc = run_driver(dirs, kubeconfig)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dra-driver: configuration error: kubeconfig {kubeconfig}: not a usable kubeconfig "
        "file: context 'c' names cluster 'gone', which is not among its clusters"], \
        "preflight's one line, before anything started"
    assert not dirs.registry.exists() or list(dirs.registry.iterdir()) == []
    dirs.cleanup()


def test_a_kubeconfig_the_loader_rejects_ends_a_fresh_start_with_one_line_and_no_sockets():
    dirs, kubeconfig = dirs_with(BAD_CA)
    proc = run_driver(dirs, kubeconfig)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(client_error(kubeconfig)), proc.stderr
    assert '"discovery_done"' in proc.stderr, "past preflight: start-up had begun"
    assert "Traceback" not in proc.stderr
    left = [p.name for p in dirs.registry.iterdir()] + [p.name for p in dirs.plugins.rglob("*.sock")]
    assert left == [], "the sockets it offered are withdrawn"
    dirs.cleanup()


def test_during_an_upgrade_a_kubeconfig_the_loader_rejects_leaves_the_running_pod_its_sockets():
    dirs, kubeconfig = dirs_with(BAD_CA)
    peer = Instance.register(dirs.state, "the-running-pod")
    # The running pod's sockets, as the kubelet knows them.
    registration = dirs.registry / f"{DRIVER}-reg.sock"
    service = dirs.plugins / DRIVER / "dra.sock"
    listeners = []
    for path in (registration, service):
        path.parent.mkdir(parents=True, exist_ok=True)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.listen()
        listeners.append(listener)
    before = {p: os.stat(p).st_ino for p in (registration, service)}
    try:
        proc = run_driver(dirs, kubeconfig)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(client_error(kubeconfig)), proc.stderr
        assert "Traceback" not in proc.stderr
        assert {p: os.stat(p).st_ino for p in (registration, service)} == before, \
            "the new pod never touched the running pod's sockets"
    finally:
        for listener in listeners:
            listener.close()
        peer.release()
    dirs.cleanup()
