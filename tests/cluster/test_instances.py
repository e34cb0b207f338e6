"""Two instances of the driver on one node with the real kubelet, as a DaemonSet's rolling
update or a killed pod leaves them: a new instance that cannot reach the API server must
not take the node's prepares from the one that can (the kubelet sends new calls to the
newest registration), and the sockets of a killed instance must not keep the kubelet
calling a dead plugin."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import pytest

from driver.kubelet.sockets import dra_candidates, first_fitting, registration_candidates
from tests.cluster.conftest import release_minor
from tests.cluster.driverhost import DRIVER, HostDriver, install
from tests.cluster.workloads import apply, claim, events, get, namespace, pod, wait, wait_running

# What the real kubelet logs (pkg/kubelet/cm/dra/plugin/dra_plugin.go) each time its health
# stream to a registered plugin cannot be opened; it retries for as long as the plugin
# stays registered.
HEALTH_STREAM_FAILED = "NodeWatchResources RPC call failed"


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


@dataclass
class RevokedToken(HostDriver):
    """A driver pod whose service account token the API server does not accept (a bad
    token, CA or network policy: its first API call fails)."""

    def env(self) -> dict[str, str]:
        env = super().env()
        (self.workdir / "token").write_text("a-token-the-api-server-never-issued")
        return env


def new_driver(cluster, chart, tmp_path, kind: type[HostDriver] = HostDriver,
               fresh: bool = False) -> HostDriver:
    import local_cluster

    return kind(cluster, chart, tmp_path / uuid.uuid4().hex[:8], local_cluster.NODE,
                fresh_node=fresh, extra_env={"MOCK_PROFILE": "mixed"})


def logged(drv: HostDriver, event: str, claim_uid: str = "") -> list[dict]:
    return [json.loads(line) for line in drv.log().splitlines()
            if f'"{event}"' in line and claim_uid in line]


def kubelet_lines(cluster, *needles: str) -> list[str]:
    text = (cluster.logs / "kubelet.log").read_text(errors="replace")
    return [line for line in text.splitlines() if all(n in line for n in needles)]


@pytest.mark.release(33, "two instances of a driver on one node (kubelet rolling-update support)")
def test_a_new_instance_that_cannot_reach_the_api_server_leaves_prepares_to_the_old_one(
        cluster, chart, tmp_path):
    ns = namespace(cluster, "broken-rollout")
    old = new_driver(cluster, chart, tmp_path, fresh=True).start()
    broken = None
    try:
        old.wait_ready()
        broken = new_driver(cluster, chart, tmp_path, RevokedToken).start()
        broken.wait_log('"registration_deferred"', 60)
        broken.wait_log('"publish_failed"', 60)
        apply(cluster, ns, claim("during", "gpu.accel.dra.io"), pod("during", "during"))
        wait_running(cluster, ns, "during")
        uid = get(cluster, ns, "resourceclaim", "during")["metadata"]["uid"]
        assert logged(old, "claim_prepared", uid), old.log()[-3000:]
        assert "FailedPrepareDynamicResources" not in events(cluster, ns)
        assert not logged(broken, "kubelet_registration_succeeded"), broken.log()[-3000:]
        assert not first_fitting(registration_candidates(
            cluster.kubelet_dir / "plugins_registry", DRIVER, broken.pod_uid)).exists(), \
            "the broken instance offered a registration"
        # The old pod serves the pod's end too; the broken one is deleted (the rollout's fix).
        assert broken.stop() == 0, broken.log()[-3000:]
        cluster.kubectl("delete", "pod", "-n", ns, "during", "--wait=true", "--timeout=60s")
        wait(f"claim {uid} unprepared by the old driver", lambda: logged(old, "claim_unprepared", uid), 60)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        if broken is not None:
            broken.stop()
        assert old.stop() == 0, old.log()[-3000:]


@pytest.mark.release(33, "two instances of a driver on one node (kubelet rolling-update support)")
def test_a_killed_instances_sockets_go_and_the_kubelet_stops_calling_it(cluster, chart, tmp_path):
    killed = new_driver(cluster, chart, tmp_path, fresh=True).start()
    nxt = None
    try:
        killed.wait_ready()
        killed.proc.kill()
        killed.proc.wait(10)
        dead = killed.pod_uid
        # The names as the driver makes them (the registry's is the UID's short hash here:
        # the name with the whole UID is longer than a socket path may be).
        registration = first_fitting(registration_candidates(
            cluster.kubelet_dir / "plugins_registry", DRIVER, dead))
        service = first_fitting(dra_candidates(cluster.kubelet_dir / "plugins" / DRIVER, dead))
        assert registration.exists() and service.exists(), "SIGKILL leaves both sockets"
        # The kubelet keeps the dead registration and fails its health stream over and over
        # (from 1.34, whose kubelet opens a health stream to each plugin; 1.33's never dials
        # one, so there the sockets' removal is what this case can see).
        health_streams = release_minor() >= 34
        if health_streams:
            wait("the kubelet failing the killed plugin's health stream",
                 lambda: kubelet_lines(cluster, HEALTH_STREAM_FAILED, dead), 60)

        nxt = new_driver(cluster, chart, tmp_path).start()
        nxt.wait_ready()
        assert logged(nxt, "dead_instance_socket_removed"), nxt.log()[-3000:]
        assert not registration.exists() and not service.exists()
        if not health_streams:
            return
        # Deregistered, the errors stop: none for three of the kubelet's retry periods
        # (10 s seen); before the fix they went on forever, through later restarts.
        errors = Quiet(lambda: len(kubelet_lines(cluster, HEALTH_STREAM_FAILED, dead)))
        wait("the kubelet's errors for the killed plugin stopping", lambda: errors.for_(30), 120,
             explain=lambda: "\n".join(kubelet_lines(cluster, HEALTH_STREAM_FAILED, dead)[-3:]))
    finally:
        killed.stop()
        if nxt is not None:
            assert nxt.stop() == 0, nxt.log()[-3000:]


@dataclass
class Quiet:
    """Whether `count()` has stayed the same for a while (polled by `wait`)."""

    count: Callable[[], int]
    last: int = -1
    since: float = 0.0

    def for_(self, seconds: float) -> bool:
        now, count = time.monotonic(), self.count()
        if count != self.last:
            self.last, self.since = count, now
            return False
        return now - self.since >= seconds
