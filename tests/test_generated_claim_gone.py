"""A claim made from a ResourceClaimTemplate is deleted by the resourceclaim controller once
its pod is done, which on the real cluster (tests/cluster) comes before or beside the
kubelet's NodeUnprepareResources: the driver's status apply after the unprepare then gets
404. The API emulator now models that controller step (`pod_done`); the driver must take
the 404 quietly: one request, no retry, no warning, no failed-write count."""

from __future__ import annotations

import json
import time
import uuid

from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import Claim
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_plugin_integration import GPU, result


def wait(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_the_emulated_controller_deletes_only_the_done_pods_generated_claims():
    with ApiServer() as api:
        pod, other = str(uuid.uuid4()), str(uuid.uuid4())
        mine = api.claim_for_pod("ns", "train", pod, "gpu", str(uuid.uuid4()), [result("gpu", GPU)])
        theirs = api.claim_for_pod("ns", "serve", other, "gpu", str(uuid.uuid4()), [result("gpu", GPU)])
        assert mine["metadata"]["name"].startswith("train-gpu-")
        assert api.pod_done("ns", pod) == [mine["metadata"]["name"]]
        assert set(api.state.claims) == {("ns", theirs["metadata"]["name"])}


def test_a_status_apply_to_a_claim_the_controller_deleted_is_quiet():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        try:
            pod_uid = str(uuid.uuid4())
            made = api.claim_for_pod("default", "train", pod_uid, "gpu", str(uuid.uuid4()),
                                     [result("gpu", GPU)])
            meta = made["metadata"]
            claim = Claim("default", meta["name"], meta["uid"])
            assert kubelet.prepare([claim]).claims[claim.uid].error == ""
            wait(lambda: (claim.namespace, claim.name, 200) in api.state.status_patches, "the Ready entry")

            # the pod is done: the controller deletes the claim, then the kubelet unprepares
            assert api.pod_done("default", pod_uid) == [claim.name]
            assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
            wait(lambda: (claim.namespace, claim.name, 404) in api.state.status_patches, "the status apply")
            time.sleep(1.5)  # longer than the first retry's backoff (0.5 s)
            patches = [p for p in api.state.status_patches if p[:2] == (claim.namespace, claim.name)]
            assert [code for *_, code in patches] == [200, 404], patches
            for line in driver.log().splitlines():
                if claim.uid in line and line.startswith("{"):
                    assert json.loads(line)["level"] not in ("warning", "error"), line
            assert "claim_unprepared" in driver.log()
        finally:
            kubelet.close()
            driver.kill()
    dirs.cleanup()
