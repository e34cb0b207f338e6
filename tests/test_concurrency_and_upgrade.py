"""Concurrent calls for overlapping claims, and two driver processes (seamless upgrade)."""

from __future__ import annotations

import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from driver.sim.apiserver import ApiServer, Fault
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_claim_status import wait
from tests.test_crash_safety import assert_consistent
from tests.test_plugin_integration import GPU, GPU2, NIC, VF, new_claim, result, spec_files


def test_concurrent_overlapping_calls_equal_serial_outcome():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        # One device per claim: a device prepared for one claim is refused to another.
        devices = [GPU, GPU2, NIC, VF, "nic-0000-22-00-0", "nic-0000-41-00-3",
                   "nic-0000-41-00-4", "nic-0000-41-00-5"]
        claims = [new_claim(api, f"c{i}", [result("r", devices[i])]) for i in range(8)]
        rng = random.Random(1)
        plan = [(rng.choice(claims), rng.random() < 0.6) for _ in range(400)]
        answers: dict[str, set] = {c.uid: set() for c in claims}
        errors = []
        lock = threading.Lock()

        def call(step):
            claim, prepare = step
            if prepare:
                entry = kubelet.prepare([claim]).claims[claim.uid]
                with lock:
                    if entry.error:
                        errors.append(entry.error)
                    answers[claim.uid].add(entry.SerializeToString(deterministic=True))
            else:
                error = kubelet.unprepare([claim]).claims[claim.uid].error
                if error:
                    with lock:
                        errors.append(error)

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(call, plan))
        assert errors == []
        assert all(len(a) <= 1 for a in answers.values()), "every prepare of a claim answers the same"

        # The final serial word per claim decides; compare with a serial run's files.
        keep = {c.uid for c in claims[:5]}
        for claim in claims:
            if claim.uid in keep:
                kubelet.prepare([claim])
            else:
                kubelet.unprepare([claim])
        assert_consistent(dirs, keep, {c.uid for c in claims} - keep)
        concurrent_specs = {p.name: p.read_text() for p in spec_files(dirs)}
        for claim in claims:
            kubelet.unprepare([claim])
        for claim in claims:
            if claim.uid in keep:
                kubelet.prepare([claim])
        assert {p.name: p.read_text() for p in spec_files(dirs)} == concurrent_specs
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_many_claims_in_one_request():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs, profile="sriov").start()
        kubelet = driver.kubelet()
        vfs = [f"nic-0000-11-0{d}-{f}" for d in range(5) for f in range(8)][2:34]
        claims = [new_claim(api, f"vf{i}", [result("vf", dev)]) for i, dev in enumerate(vfs)]
        response = kubelet.prepare(claims)
        assert {uid: e.error for uid, e in response.claims.items()} == {c.uid: "" for c in claims}
        assert len(spec_files(dirs)) == 32
        response = kubelet.unprepare(claims)
        assert all(e.error == "" for e in response.claims.values()) and spec_files(dirs) == []
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_two_instances_serve_side_by_side_and_remove_only_their_sockets():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
        old = DriverProcess(api, dirs, extra=["--pod-uid", old_uid]).start()
        old_kubelet = old.kubelet()
        assert old_kubelet.info.endpoint.endswith(f"dra-{old_uid}.sock")
        claim = new_claim(api, "shared", [result("gpu", GPU)])
        first = old_kubelet.prepare([claim]).claims[claim.uid]

        new = DriverProcess(api, dirs, extra=["--pod-uid", new_uid]).start()
        import time

        deadline = time.monotonic() + 20
        while len(list(dirs.registry.glob("*.sock"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sockets = sorted(p.name for p in dirs.registry.glob("*.sock"))
        assert sockets == sorted([f"{DRIVER}-{old_uid}-reg.sock", f"{DRIVER}-{new_uid}-reg.sock"])
        from driver.sim.kubelet import FakeKubelet

        new_kubelet = FakeKubelet(dirs.registry)
        new_kubelet.wait_for_socket = lambda timeout=20: dirs.registry / f"{DRIVER}-{new_uid}-reg.sock"
        new_kubelet.register()
        # Both serve the same state: the new one answers what the old one prepared.
        assert new_kubelet.prepare([claim]).claims[claim.uid] == first

        # Concurrent calls through both processes for the same claims stay consistent.
        claims = [new_claim(api, f"both{i}", [result("nic", dev)]) for i, dev in enumerate(
            [GPU2, NIC, VF, "nic-0000-22-00-0", "nic-0000-41-00-3", "nic-0000-41-00-4"])]

        def churn(kubelet, seed):
            rng = random.Random(seed)
            for _ in range(40):
                c = rng.choice(claims)
                (kubelet.prepare if rng.random() < 0.5 else kubelet.unprepare)([c])

        threads = [threading.Thread(target=churn, args=(k, s))
                   for s, k in enumerate([old_kubelet, new_kubelet, old_kubelet, new_kubelet])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in claims:
            new_kubelet.unprepare([c])
        assert_consistent(dirs, {claim.uid}, {c.uid for c in claims})

        assert old.terminate() == 0
        remaining = sorted(p.name for p in dirs.registry.glob("*.sock"))
        assert remaining == [f"{DRIVER}-{new_uid}-reg.sock"]
        assert (dirs.plugins / DRIVER / f"dra-{new_uid}.sock").exists()
        assert not (dirs.plugins / DRIVER / f"dra-{old_uid}.sock").exists()
        assert new_kubelet.unprepare([claim]).claims[claim.uid].error == ""
        for k in (old_kubelet, new_kubelet):
            k.close()
        new.kill()
    dirs.cleanup()


def test_stale_socket_replaced_and_old_instance_leaves_new_socket_alone():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        crashed = DriverProcess(api, dirs).start()
        crashed.kubelet().close()
        crashed.kill()  # leaves both socket files behind
        reg = dirs.registry / f"{DRIVER}-reg.sock"
        assert reg.exists()

        first = DriverProcess(api, dirs).start()
        first.kubelet().close()
        second = DriverProcess(api, dirs).start()  # same names: replaces first's sockets
        import time

        inode = reg.stat().st_ino
        deadline = time.monotonic() + 20
        while reg.stat().st_ino == inode and time.monotonic() < deadline:
            time.sleep(0.05)
        kubelet = second.kubelet()
        assert first.terminate() == 0
        assert reg.exists(), "the old instance must not delete the new instance's socket"
        claim = new_claim(api, "after", [result("gpu", GPU)])
        assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        kubelet.close()
        second.kill()
    dirs.cleanup()


@pytest.mark.parametrize("workers, at_least, at_most", [(None, 8, 8), ("2", 2, 2)])
def test_claims_of_a_batch_run_in_the_configured_pool(workers, at_least, at_most):
    """Each claim's GET is held 0.5 s by the API server: with the default pool all eight
    claims of the batch wait together; --claim-workers 2 lets two through at a time."""
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        extra = ["--claim-workers", workers] if workers else []
        driver = DriverProcess(api, dirs, profile="h100x8", extra=extra).start()
        kubelet = driver.kubelet()
        try:
            gpus = wait(lambda: sorted(d["name"] for s in api.slices() for d in s["spec"]["devices"]
                                       if d["name"].startswith("gpu-")), "GPUs published", 30)
            assert len(gpus) == 8
            claims = [new_claim(api, f"batch-{i}", [result("gpu", gpu)]) for i, gpu in enumerate(gpus)]
            held = Fault("GET", r"/resourceclaims/batch-", status=0, delay=0.5, times=8)
            api.inject(held)
            reply = kubelet.prepare(claims, timeout=60)
            assert all(not reply.claims[c.uid].error for c in claims), reply
            assert held.times == 0 and at_least <= held.peak <= at_most, f"{held.peak} GETs at once"
        finally:
            kubelet.close()
            driver.kill()
    dirs.cleanup()
