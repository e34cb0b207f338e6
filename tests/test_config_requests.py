"""Which requests an opaque config is for (issue 38, item 9).

The real scheduler clears a config's `requests` in the allocation when they name every
request of the claim (k8s.io/dynamic-resource-allocation v0.37.2,
structured/internal/{stable,incubating,experimental}/allocator_*.go: "If a config applies
to all requests, clear its Requests field"), counting a chosen subrequest `req/sub` as its
request. The driver reads what the claim's author wrote from the claim's spec, so a config
aimed at a request whose device it cannot configure fails prepare however the scheduler
wrote it down. The API emulator clears `requests` as the scheduler does, so these run the
same claims the cluster tier does (tests/cluster/test_config_requests.py)."""

from __future__ import annotations

import json
import uuid

import pytest

from driver.prepare.claims import ClaimRef, allocation_for
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim
from tests.driverproc import DRIVER, DriverDirs, DriverProcess

GPU = "gpu-0000-11-00-0"
FPGA = "fpga-0000-31-00-1"
GPU_CONFIG = {"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig", "env": {"TUNED": "yes"}}
FPGA_CONFIG = {"apiVersion": "accel.dra.io/v1alpha1", "kind": "FpgaConfig", "env": {"SHELL": "u250"}}


def result(request: str, device: str) -> dict:
    return {"request": request, "driver": DRIVER, "pool": "node-a", "device": device}


def opaque(requests: list[str], parameters: dict, source: str = "FromClaim") -> dict:
    return {"source": source, "requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}


def test_the_emulator_clears_requests_that_name_every_request_as_the_scheduler_does():
    claim = claim_allocated("default", "c", "u-1", [result("gpu", GPU), result("fpga/u250", FPGA)], [
        opaque(["gpu", "fpga"], GPU_CONFIG),          # every request by name
        opaque(["gpu", "fpga/u250"], GPU_CONFIG),     # the chosen subrequest counts
        opaque(["fpga"], FPGA_CONFIG),                # one of two: kept
        opaque(["gpu", "fpga/u280"], GPU_CONFIG),     # a subrequest not chosen: kept
        opaque([], GPU_CONFIG),                       # claim-wide
        opaque(["gpu", "fpga"], GPU_CONFIG, source="FromClass"),
    ])
    status = claim["status"]["allocation"]["devices"]["config"]
    assert [c.get("requests") for c in status] == [
        None, None, ["fpga"], ["gpu", "fpga/u280"], [], None]
    # the spec keeps what the claim's author wrote, its own configs only
    assert [c.get("requests") for c in claim["spec"]["devices"]["config"]] == [
        ["gpu", "fpga"], ["gpu", "fpga/u250"], ["fpga"], ["gpu", "fpga/u280"], None]


def test_the_spec_says_which_configs_were_aimed_and_pairs_them_in_order():
    claim = claim_allocated("default", "c", "u-1", [result("gpu", GPU), result("fpga", FPGA)], [
        opaque([], GPU_CONFIG),                  # claim-wide
        opaque(["gpu", "fpga"], GPU_CONFIG),     # the same parameters, aimed at both
        opaque(["fpga"], FPGA_CONFIG),
        opaque(["fpga"], GPU_CONFIG, source="FromClass"),
    ])
    configs = allocation_for(claim, ClaimRef("default", "c", "u-1"), DRIVER).configs
    assert [(c.source, c.requests, c.aimed) for c in configs] == [
        ("FromClass", ("fpga",), False),  # the scheduler's bookkeeping, not the author's aim
        ("FromClaim", (), False),
        ("FromClaim", ("gpu", "fpga"), True),
        ("FromClaim", ("fpga",), True),
    ]


def test_an_allocation_config_the_spec_lacks_stays_claim_wide():
    claim = claim_allocated("default", "c", "u-1", [result("fpga", FPGA)], [opaque(["fpga"], GPU_CONFIG)])
    del claim["spec"]["devices"]["config"]
    (config,) = allocation_for(claim, ClaimRef("default", "c", "u-1"), DRIVER).configs
    assert (config.requests, config.aimed) == ((), False)


@pytest.fixture
def node():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        yield api, kubelet, dirs
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def new_claim(api, name: str, results: list[dict], config: list[dict]) -> Claim:
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated("default", name, uid, results, config))
    return Claim("default", name, uid)


@pytest.mark.parametrize("name, results, config", [
    ("one-request", [result("fpga", FPGA)], [opaque(["fpga"], GPU_CONFIG)]),
    ("subrequest", [result("fpga/u250", FPGA)], [opaque(["fpga/u250"], GPU_CONFIG)]),
    ("every-request", [result("gpu", GPU), result("fpga", FPGA)], [opaque(["gpu", "fpga"], GPU_CONFIG)]),
])
def test_a_gpu_config_aimed_at_the_fpga_fails_prepare_in_one_line(node, name, results, config):
    api, kubelet, dirs = node
    claim = new_claim(api, name, results, config)
    assert "requests" not in api_claim(api, claim)["status"]["allocation"]["devices"]["config"][0], \
        "the emulator clears them as the scheduler does"
    error = kubelet.prepare([claim]).claims[claim.uid].error
    assert error == f"claim default/{name}: GpuConfig cannot configure fpga device {FPGA}", error
    assert not list(dirs.cdi.glob(f"*{claim.uid}*")), "nothing prepared"


def test_a_claim_wide_gpu_config_leaves_the_fpga_alone(node):
    api, kubelet, dirs = node
    claim = new_claim(api, "claim-wide", [result("gpu", GPU), result("fpga", FPGA)], [opaque([], GPU_CONFIG)])
    reply = kubelet.prepare([claim]).claims[claim.uid]
    assert reply.error == ""
    env = {d["name"].removeprefix(claim.uid + "-"): d["containerEdits"]["env"]
           for d in json.loads(next(dirs.cdi.glob(f"*{claim.uid}*")).read_text())["devices"]}
    assert "TUNED=yes" in env[GPU] and "TUNED=yes" not in env[FPGA]
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""


def test_a_class_config_of_another_kind_is_left_out_whatever_requests_the_scheduler_wrote(node):
    """A DeviceClass's config is the admin's, for the devices it can configure; the
    scheduler lists the class's requests on it, which are no aim of the claim's author."""
    api, kubelet, dirs = node
    claim = new_claim(api, "class-config", [result("gpu", GPU), result("fpga", FPGA)],
                      [opaque(["fpga"], GPU_CONFIG, source="FromClass"), opaque(["fpga"], FPGA_CONFIG)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    env = {d["name"].removeprefix(claim.uid + "-"): d["containerEdits"]["env"]
           for d in json.loads(next(dirs.cdi.glob(f"*{claim.uid}*")).read_text())["devices"]}
    assert "SHELL=u250" in env[FPGA] and "TUNED=yes" not in env[FPGA] + env[GPU]
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""


def api_claim(api: ApiServer, claim: Claim) -> dict:
    with api.state.lock:
        return json.loads(json.dumps(api.state.claims[(claim.namespace, claim.name)]))
