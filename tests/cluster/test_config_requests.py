"""A GpuConfig aimed at an FPGA request on the real cluster (issue 38, item 9).

kube-scheduler clears a config's `requests` in the allocation when they name every request
of the claim (or its chosen subrequest, `req/sub`); the driver reads the aim from the
claim's spec, so prepare fails with one line naming the claim, the config kind and the
device, as `dra-driver explain` predicts, instead of the pod running without its config.
The fast tests run the same claims on the API emulator (tests/test_config_requests.py)."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import release_minor
from tests.cluster.driverhost import DRIVER, HostDriver, explain, install
from tests.cluster.workloads import apply, events, get, namespace, pod, wait

FPGA_CLASS = f"fpga.{DRIVER}"
GPU_CONFIG = {"driver": DRIVER, "parameters": {"apiVersion": "accel.dra.io/v1alpha1",
                                               "kind": "GpuConfig", "env": {"TUNED": "yes"}}}


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


@pytest.fixture(scope="module")
def driver(cluster, chart, tmp_path_factory):
    import local_cluster

    drv = HostDriver(cluster, chart, tmp_path_factory.mktemp("drv"), local_cluster.NODE,
                     fresh_node=True, extra_env={"MOCK_PROFILE": "mixed"}).start()
    drv.wait_ready()
    yield drv
    assert drv.stop() == 0, drv.log()[-3000:]


def aimed_claim(name: str, request: dict, aimed_at: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [request],
                                 "config": [{"requests": [aimed_at], "opaque": GPU_CONFIG}]}}}


CLAIMS = {
    "by-request": (aimed_claim("by-request", {"name": "dev", "exactly": {"deviceClassName": FPGA_CLASS}},
                               "dev")),
    "by-subrequest": (aimed_claim("by-subrequest", {"name": "dev", "firstAvailable": [
        {"name": "fpga", "deviceClassName": FPGA_CLASS}]}, "dev/fpga")),
}


def test_a_gpu_config_aimed_at_an_fpga_fails_prepare_with_one_line(cluster, driver):
    ns = namespace(cluster, "aimed")
    # a subrequest (firstAvailable) needs 1.33 (DRAPrioritizedList); a config aimed at a
    # whole request is the case on 1.32
    claims = {k: v for k, v in CLAIMS.items() if k != "by-subrequest" or release_minor() >= 33}
    apply(cluster, ns, *claims.values())
    for name in claims:  # what explain predicts, before the scheduler has a pod for it
        code, out = explain(cluster, name, "-n", ns)
        (verdict,) = out["claims"]
        assert code == 1 and verdict["nodes"] and all(
            "prepare would fail: GpuConfig cannot configure fpga device" in n["why"]
            for n in verdict["nodes"]), verdict
    apply(cluster, ns, *(pod(f"{name}-pod", name) for name in claims))
    for name in claims:
        claim = wait(f"claim {name} allocated",
                     lambda: (c := get(cluster, ns, "resourceclaim", name)) and
                     (c.get("status") or {}).get("allocation") and c, 90)
        devices = claim["status"]["allocation"]["devices"]
        (config,) = devices["config"]
        # the fact the driver must live with: the scheduler of 1.37 writes the config down
        # as claim-wide; 1.34's keeps the request it named (either way the driver must
        # refuse a GpuConfig on an FPGA)
        assert config["opaque"] == GPU_CONFIG, config
        assert "requests" not in config or release_minor() < 37, config
        (result,) = devices["results"]
        expected = (f"claim {ns}/{name}: GpuConfig cannot configure fpga device {result['device']}")
        wait(f"pod {name}-pod fails to prepare with our line",
             lambda: expected in events(cluster, ns), 90,
             explain=lambda: f"\nevents:\n{events(cluster, ns)}\ndriver:\n{driver.log()[-3000:]}")
        assert (get(cluster, ns, "pod", f"{name}-pod") or {}).get("status", {}).get("phase") == "Pending"
    failed = [line for line in driver.log().splitlines() if '"claim_failed"' in line and ns in line]
    assert failed and all("Traceback" not in line for line in failed), driver.log()[-3000:]
    assert "FailedPrepareDynamicResources" in events(cluster, ns)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
