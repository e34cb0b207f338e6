"""A status.devices write without `associated-node:patch` on `resourceclaims/driver`: the
real API server (1.36+) refuses it with 422 Invalid (a Forbidden field error, not a 403;
seen in tests/cluster/test_claim_status.py); the API emulator now does the same, and the
driver retries until the grant is back, never failing the prepare."""

from __future__ import annotations

import json
import time

from driver.sim import claimstatus
from driver.sim.apiserver import ApiServer
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_plugin_integration import GPU, new_claim, result


def wait(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_modified_drivers_are_those_whose_entries_changed():
    entry = {"driver": DRIVER, "pool": "p", "device": "d", "conditions": []}
    other = {"driver": "other.example.com", "pool": "p", "device": "d"}
    old = {"status": {"devices": [entry, other]}}
    assert claimstatus.modified_drivers(old, old) == set()
    assert claimstatus.modified_drivers(old, {"status": {"devices": [other]}}) == {DRIVER}
    changed = dict(entry, conditions=[{"type": "Ready"}])
    assert claimstatus.modified_drivers(old, {"status": {"devices": [changed, other]}}) == {DRIVER}


def test_without_the_driver_grant_the_write_is_refused_422_and_retried():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        api.deny_status_writes(DRIVER)
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        try:
            claim = new_claim(api, "train", [result("gpu", GPU)])
            assert kubelet.prepare([claim]).claims[claim.uid].error == ""
            line = wait(lambda: [json.loads(x) for x in driver.log().splitlines()
                                 if '"claim_status_write_failed"' in x], "a refused write")[0]
            assert line["error"].startswith("HTTP 422: ") and (
                'status.devices: Forbidden: changing status.devices requires resource="resourceclaims/driver"'
                in line["error"]), line
            assert not (api.state.claims[("default", "train")].get("status") or {}).get("devices")
            api.deny_status_writes(DRIVER, denied=False)
            wait(lambda: (claim.namespace, claim.name, 200) in api.state.status_patches, "the retry landing")
            codes = [c for ns, n, c in api.state.status_patches if (ns, n) == ("default", "train")]
            assert codes[0] == 422 and codes[-1] == 200, codes
            entries = api.state.claims[("default", "train")]["status"]["devices"]
            assert [(e["driver"], e["device"]) for e in entries] == [(DRIVER, GPU)]
        finally:
            kubelet.close()
            driver.kill()
    dirs.cleanup()

