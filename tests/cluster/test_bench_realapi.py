"""bench.realapi's measurement against the real API server, in a few runs: the claims it
makes are valid for the real server (a spec the API accepts, an allocation written to
status), the driver with the chart's token reads them and prepares each without an error,
and every figure comes out. The full run is `python3 -m bench.realapi` (bench/RESULTS.md)."""

from __future__ import annotations

import json

from bench.realapi import NAMESPACE, RealApi, measure, real_claim
from tests.cluster.driverhost import NAMESPACE as DRIVER_NAMESPACE
from tests.cluster.driverhost import install, service_account, token


def test_the_real_api_bench_prepares_claims_read_from_the_real_server(cluster, tmp_path):
    import local_cluster

    objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                                "mock": {"enabled": True}})
    cluster.kubectl("label", "namespace", NAMESPACE, "resource.kubernetes.io/admin-access=true", "--overwrite")
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
        cluster.kubectl("label", "namespace", NAMESPACE, "resource.kubernetes.io/admin-access-", check=False)
