"""bench.realapi's measurement against the real API server, in a few runs: the claims it
makes are valid for the real server (a spec the API accepts, an allocation written to
status), the driver with the chart's token reads them and prepares each without an error,
and every figure comes out. The full run is `python3 -m bench.realapi` (bench/RESULTS.md)."""

from __future__ import annotations

import json

from bench.realapi import NAMESPACE, RealApi, admin_namespace, measure, real_claim
from tests.cluster.driverhost import NAMESPACE as DRIVER_NAMESPACE
from tests.cluster.driverhost import install, service_account, token


def test_the_real_api_bench_prepares_claims_read_from_the_real_server(cluster, tmp_path):
    import local_cluster

    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                                "mock": {"enabled": True}})
    admin_namespace(cluster, True)
    try:
        real = RealApi(cluster, token(cluster, service_account(objects), local_cluster.NODE), local_cluster.NODE)
        claim = real_claim(real)
        stored = json.loads(cluster.kubectl("get", "resourceclaim", "-n", NAMESPACE, claim.name, "-o", "json").stdout)
        assert stored["metadata"]["uid"] == claim.uid
        (result,) = stored["status"]["allocation"]["devices"]["results"]
        assert result["pool"] == local_cluster.NODE and result["adminAccess"] is True, result
        figures = measure(real, lambda: real_claim(real), 5, tmp_path, local_cluster.NODE, 3,
                          namespace=DRIVER_NAMESPACE)
        assert len(figures.prep) == 5 and all(0 < p < 5 for p in figures.prep), figures
        assert figures.floor > 0 and figures.batch > 0 and figures.concurrent > 0, figures
    finally:
        cluster.kubectl("delete", "resourceclaims", "-n", NAMESPACE, "--all", "--wait=false", check=False)
        admin_namespace(cluster, False)


def test_the_burst_measures_the_driver_and_its_api_floor_on_the_real_server(cluster, tmp_path):
    """bench.burst (issue 42 item 5), one small round of each: the driver's status applies
    are accepted by the real server (the bench's claims were no node's, and a node-bound
    ServiceAccount's apply of status.devices got 422 from the API server, retried with
    backoff inside the measurement), the floor's GETs and applies too, and the audit log
    gives every step of every claim."""
    import local_cluster

    from bench import burst

    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                                "mock": {"enabled": True}})
    admin_namespace(cluster, True)
    try:
        real = RealApi(cluster, token(cluster, service_account(objects), local_cluster.NODE), local_cluster.NODE)
        servers = {"kube-apiserver": int((cluster.root / "pids" / "kube-apiserver").read_text())}
        found: list[burst.BurstFigures] = []

        def measure_burst(driver, kubelet) -> None:
            found.append(burst.measure(real, driver, kubelet, lambda: real_claim(real),
                                       real.kubeconfig(tmp_path / "floor"), cluster.logs / "audit.log",
                                       servers, rounds=1, size=8))

        measure(real, lambda: real_claim(real), 1, tmp_path, local_cluster.NODE, 3,
                namespace=DRIVER_NAMESPACE, burst=measure_burst, only_burst=True)
        (figures,) = found
        for rounds in (figures.answered, figures.applied, figures.floor):
            (one,) = rounds
            assert len(one.latencies) == 8 and 0 < max(one.latencies) <= one.seconds < 60, one
        # a claim's status is applied after its prepare was answered
        assert all(a >= p for a, p in zip(figures.applied[0].latencies, figures.answered[0].latencies))
        assert len(figures.steps["apply in the API server"]) == 8
        assert figures.cpu["driver"][0] > 0
    finally:
        cluster.kubectl("delete", "resourceclaims", "-n", NAMESPACE, "--all", "--wait=false", check=False)
        admin_namespace(cluster, False)
