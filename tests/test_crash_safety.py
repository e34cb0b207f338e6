"""SIGKILL in the middle of prepare and unprepare, reboots, and leftovers."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from pathlib import Path

import grpc

from driver.state.checkpoint import State
from driver.sim.apiserver import ApiServer, Fault
from tests.cdi_check import check_spec
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_plugin_integration import GPU, GPU2, NIC, VF, new_claim, record_files, result, spec_files


def records(dirs) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in record_files(dirs)}


def assert_consistent(dirs, prepared: set[str], unprepared: set[str]) -> None:
    """Every prepared claim: a Completed record and a valid spec naming its devices.
    Every unprepared claim: neither. No temp files anywhere."""
    recs = records(dirs)
    specs = {p.name.removeprefix(f"{DRIVER}-claim_").removesuffix(".json"): json.loads(p.read_text())
             for p in spec_files(dirs)}
    for uid in prepared:
        assert recs[uid]["state"] == State.PREPARE_COMPLETED.value, uid
        check_spec(specs[uid])
        assert sorted(d["name"] for d in specs[uid]["devices"]) == \
            sorted(f"{uid}-{d['device']}" for d in recs[uid]["devices"])
        # A spec never mounts a device metadata file that is not there (KEP-5304).
        for device in specs[uid]["devices"]:
            for mount in device["containerEdits"].get("mounts", []):
                if mount["containerPath"].startswith("/var/run/kubernetes.io/dra-device-attributes/"):
                    assert Path(mount["hostPath"]).is_file(), mount
    for uid in unprepared:
        assert uid not in recs and uid not in specs, uid
        assert not [p for p in (dirs.state / "metadata").glob(f"{uid}*")], uid
    assert set(recs) == set(specs) == prepared
    leftovers = [p for d in (dirs.cdi, dirs.state / "claims", dirs.state / "metadata")
                 for p in d.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_sigkill_during_prepare_then_retry(tmp_path):
    dirs = DriverDirs.make()
    with ApiServer() as api:
        claim = new_claim(api, "slow", [result("gpu", GPU), result("nic", NIC)])
        api.inject(Fault("GET", "/resourceclaims/slow", status=0, delay=3.0))
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        errors = []

        def call():
            try:
                kubelet.prepare([claim], timeout=10)
            except grpc.RpcError as err:
                errors.append(err.code())

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)  # inside prepare: waiting for the claim
        driver.kill()
        thread.join()
        assert errors == [grpc.StatusCode.UNAVAILABLE]
        kubelet.close()

        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        entry = kubelet.prepare([claim]).claims[claim.uid]
        assert entry.error == "" and len(entry.devices) == 2
        assert_consistent(dirs, {claim.uid}, set())
        assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert_consistent(dirs, set(), {claim.uid})
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_every_crash_point_recovers():
    """The states a kill can leave, built exactly: Started record without spec, Started
    record with spec, Completed record without spec, temp files of both writers."""
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        claims = [new_claim(api, f"c{i}", [result("dev", d)]) for i, d in enumerate([GPU, GPU2, NIC, VF])]
        for claim in claims:
            assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        kubelet.close()
        driver.kill()

        boot_id = records(dirs)[claims[0].uid]["boot_id"]
        # c0: a PrepareStarted record without spec (what an older version left on a kill).
        spec0 = spec_files(dirs)[0].parent / f"{DRIVER}-claim_{claims[0].uid}.json"
        spec0.unlink()
        rec0 = dirs.state / "claims" / f"{claims[0].uid}.json"
        data = json.loads(rec0.read_text())
        data["state"] = State.PREPARE_STARTED.value
        rec0.write_text(json.dumps(data))
        # c1: killed after the spec was written, before the record.
        (dirs.state / "claims" / f"{claims[1].uid}.json").unlink()
        # c2: spec gone (someone cleaned /var/run/cdi) but the record says Completed.
        (dirs.cdi / f"{DRIVER}-claim_{claims[2].uid}.json").unlink()
        # Half-written temp files from a kill inside atomic.write.
        (dirs.cdi / f".{DRIVER}-claim_{claims[3].uid}.json.tmp-999").write_text("{\"half")
        (dirs.state / "claims" / f".{claims[3].uid}.json.tmp-999").write_text("{")
        (dirs.state / "metadata" / f".{claims[3].uid}_dev.json.tmp-999").write_text("{")
        for leftover in (dirs.cdi / f".{DRIVER}-claim_{claims[3].uid}.json.tmp-999",
                         dirs.state / "claims" / f".{claims[3].uid}.json.tmp-999",
                         dirs.state / "metadata" / f".{claims[3].uid}_dev.json.tmp-999"):
            os.utime(leftover, (time.time() - 120, time.time() - 120))  # from a kill minutes ago

        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        # Unprepare of a half-prepared claim cleans up; repeated prepares finish the rest.
        assert kubelet.unprepare([claims[0]]).claims[claims[0].uid].error == ""
        assert (dirs.cdi / f"{DRIVER}-claim_{claims[1].uid}.json").exists()
        for claim in claims[1:]:
            assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        assert_consistent(dirs, {c.uid for c in claims[1:]}, {claims[0].uid})
        assert records(dirs)[claims[2].uid]["boot_id"] == boot_id
        for claim in claims[1:]:
            assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert_consistent(dirs, set(), {c.uid for c in claims})
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_random_sigkills_during_prepare_and_unprepare():
    rng = random.Random(42)
    dirs = DriverDirs.make()
    with ApiServer() as api:
        # Two VFs per claim, none shared: a device is prepared for one claim at a time.
        vfs = [f"nic-0000-11-0{d}-{f}" for d in range(5) for f in range(8)][2:26]
        claims = [new_claim(api, f"k{i}", [result("a", vfs[2 * i]), result("b", vfs[2 * i + 1])])
                  for i in range(12)]
        for round_ in range(4):
            driver = DriverProcess(api, dirs, profile="sriov").start()
            kubelet = driver.kubelet()
            stop = threading.Event()

            def churn():
                while not stop.is_set():
                    claim = rng.choice(claims)
                    try:
                        if rng.random() < 0.6:
                            kubelet.prepare([claim], timeout=5)
                        else:
                            kubelet.unprepare([claim], timeout=5)
                    except grpc.RpcError:
                        return  # the process was killed under us

            workers = [threading.Thread(target=churn) for _ in range(4)]
            for w in workers:
                w.start()
            time.sleep(rng.uniform(0.2, 0.8))
            driver.kill()
            stop.set()
            for w in workers:
                w.join()
            kubelet.close()

        # After the last kill: a fresh process, and the kubelet's retries decide each claim.
        driver = DriverProcess(api, dirs, profile="sriov").start()
        kubelet = driver.kubelet()
        keep = {c.uid for c in claims[::2]}
        for claim in claims:
            if claim.uid in keep:
                assert kubelet.prepare([claim]).claims[claim.uid].error == ""
            else:
                assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        assert_consistent(dirs, keep, {c.uid for c in claims} - keep)
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def _set_boot_id(dirs, value: str) -> None:
    (dirs.state / "mock" / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(value + "\n")


def test_reboot_rewrites_specs():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        wiped = new_claim(api, "wiped", [result("gpu", GPU)])
        stale = new_claim(api, "stale", [result("gpu", GPU2)])
        torn = new_claim(api, "torn", [result("nic", NIC)])
        first = {c.uid: kubelet.prepare([c]).claims[c.uid] for c in (wiped, stale, torn)}
        kubelet.close()
        driver.terminate()
        old_boot = records(dirs)[wiped.uid]["boot_id"]

        # Reboot: /var/run/cdi is tmpfs (wiped); a spec that survived elsewhere is stale.
        (dirs.cdi / f"{DRIVER}-claim_{wiped.uid}.json").unlink()
        stale_path = dirs.cdi / f"{DRIVER}-claim_{stale.uid}.json"
        stale_spec = json.loads(stale_path.read_text())
        stale_spec["devices"][0]["containerEdits"]["env"] = ["STALE=1"]
        stale_path.write_text(json.dumps(stale_spec))
        # A spec is not fsynced: on a persistent CDI root a power loss can leave its
        # rename without its data (an empty file), or half of it.
        torn_path = dirs.cdi / f"{DRIVER}-claim_{torn.uid}.json"
        torn_path.write_bytes(b"")
        # The claims stay in the API server: prepare confirms each record against its claim
        # (test_plugin_integration.py covers a claim deleted or reallocated meanwhile).
        new_boot = str(uuid.uuid4())
        _set_boot_id(dirs, new_boot)

        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        for claim in (wiped, stale, torn):
            again = kubelet.prepare([claim]).claims[claim.uid]
            assert again == first[claim.uid]
        assert_consistent(dirs, {wiped.uid, stale.uid, torn.uid}, set())
        assert "STALE=1" not in stale_path.read_text()
        assert json.loads(torn_path.read_text())["devices"]
        assert {r["boot_id"] for r in records(dirs).values()} == {new_boot} != {old_boot}
        assert "claim_restored" in driver.log()
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_corrupt_record_is_quarantined_and_claim_redone():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        driver = DriverProcess(api, dirs).start()
        kubelet = driver.kubelet()
        claim = new_claim(api, "corrupt", [result("gpu", GPU)])
        kubelet.prepare([claim])
        (dirs.state / "claims" / f"{claim.uid}.json").write_text("{not json")
        entry = kubelet.prepare([claim]).claims[claim.uid]
        assert entry.error == ""
        assert (dirs.state / "claims" / f"{claim.uid}.json.corrupt").exists()
        assert_consistent(dirs, {claim.uid}, set())
        assert "checkpoint_record_corrupt" in driver.log()
        kubelet.close()
        driver.kill()
    dirs.cleanup()
