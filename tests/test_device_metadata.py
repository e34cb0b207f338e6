"""KEP-5304 device metadata: the file the CDI spec mounts, its content and path, its
generation across a reboot, and its removal (the podman test reads it in a container)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_crash_safety import _set_boot_id
from tests.test_plugin_integration import GPU, NIC, new_claim, result

ROOT = "/var/run/kubernetes.io/dra-device-attributes"


@pytest.fixture
def env():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        api.add_node("node-a")
        driver = DriverProcess(api, dirs, extra=["--sharing-reconcile-interval", "1"]).start()
        kubelet = driver.kubelet()
        yield api, driver, kubelet, dirs
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def metadata_mounts(dirs, claim) -> dict[str, str]:
    spec = json.loads((dirs.cdi / f"{DRIVER}-claim_{claim.uid}.json").read_text())
    return {m["containerPath"]: m["hostPath"] for d in spec["devices"]
            for m in d["containerEdits"].get("mounts", []) if m["containerPath"].startswith(ROOT)}


def read_stream(path: str) -> list[dict]:
    text, objects, decoder, index = open(path).read(), [], json.JSONDecoder(), 0
    while index < len(text.rstrip()):
        obj, end = decoder.raw_decode(text, index)
        objects.append(obj)
        index = end
        while index < len(text) and text[index].isspace():
            index += 1
    return objects


def published(api, device: str) -> dict:
    return next(d for s in api.slices() for d in s["spec"].get("devices", []) if d["name"] == device)


def test_each_request_gets_its_file_with_the_published_attributes(env):
    api, _, kubelet, dirs = env
    claim = new_claim(api, "train", [result("gpu", GPU), result("nic/cx7", NIC)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    mounts = metadata_mounts(dirs, claim)
    assert set(mounts) == {f"{ROOT}/resourceclaims/train/gpu/{DRIVER}-metadata.json",
                           f"{ROOT}/resourceclaims/train/nic/{DRIVER}-metadata.json"}
    (gpu_file,) = read_stream(mounts[f"{ROOT}/resourceclaims/train/gpu/{DRIVER}-metadata.json"])
    assert gpu_file["kind"] == "DeviceMetadata" and gpu_file["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    assert gpu_file["metadata"] == {"name": "train", "namespace": "default", "uid": claim.uid, "generation": 1}
    assert "podClaimName" not in gpu_file
    (request,) = gpu_file["requests"]
    (device,) = request["devices"]
    assert request["name"] == "gpu"
    assert (device["driver"], device["pool"], device["name"]) == (DRIVER, "node-a", GPU)
    assert device["attributes"] == published(api, GPU)["attributes"]
    (nic_file,) = read_stream(mounts[f"{ROOT}/resourceclaims/train/nic/{DRIVER}-metadata.json"])
    (nic_request,) = nic_file["requests"]
    assert nic_request["name"] == "nic/cx7", "the subrequest inside, the request in the path"
    (nic,) = nic_request["devices"]
    assert nic["networkData"]["interfaceName"] == "enp18s0f0"
    assert nic["networkData"]["ips"] == ["10.100.0.2/24", "fd00::2/64"]
    assert set(mounts.values()) == {str(dirs.state / "metadata" / f"{claim.uid}_{r}.json")
                                    for r in ("gpu", "nic")}, "side by side, no directory per claim"
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert metadata_files(dirs, claim.uid) == []


def test_a_template_claim_uses_the_pod_claim_name(env):
    api, _, kubelet, dirs = env
    uid = str(uuid.uuid4())
    body = claim_allocated("default", "pod0-gpu-2kqrd", uid, [result("gpu", GPU)])
    body["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "my-gpu"}
    api.put_claim(body)
    claim = Claim("default", "pod0-gpu-2kqrd", uid)
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    ((path, host),) = metadata_mounts(dirs, claim).items()
    assert path == f"{ROOT}/resourceclaimtemplates/my-gpu/gpu/{DRIVER}-metadata.json"
    assert read_stream(host)[0]["podClaimName"] == "my-gpu"


def test_a_reboot_rewrites_the_file_with_a_higher_generation(env):
    api, driver, kubelet, dirs = env
    claim = new_claim(api, "kept", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    kubelet.close()
    driver.terminate()
    (dirs.cdi / f"{DRIVER}-claim_{claim.uid}.json").unlink()  # tmpfs: gone with the reboot
    _set_boot_id(dirs, str(uuid.uuid4()))
    again = DriverProcess(api, dirs).start()
    try:
        kubelet = again.kubelet()
        assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        ((_, host),) = metadata_mounts(dirs, claim).items()
        assert read_stream(host)[0]["metadata"]["generation"] == 2
        kubelet.close()
    finally:
        again.kill()


def metadata_files(dirs, uid: str) -> list[str]:
    return sorted(p.name for p in (dirs.state / "metadata").iterdir() if p.name.startswith(uid))


def test_files_no_claim_needs_are_swept(env):
    api, driver, kubelet, dirs = env
    kept = new_claim(api, "kept", [result("gpu", GPU)])
    assert kubelet.prepare([kept]).claims[kept.uid].error == ""
    root = dirs.state / "metadata"
    stray = root / f"{uuid.uuid4()}_gpu.json"
    stray.write_text("{}")
    # and one as versions before 2026-12-04 laid them out, a directory per claim
    legacy = root / str(uuid.uuid4()) / "gpu"
    legacy.mkdir(parents=True)
    (legacy / f"{DRIVER}-metadata.json").write_text("{}")
    (root / "notes.txt").write_text("not ours")
    deadline = time.monotonic() + 15
    while stray.exists() or legacy.parent.exists():
        assert time.monotonic() < deadline, driver.log()[-2000:]
        time.sleep(0.1)
    assert driver.log().count("claim_metadata_swept") == 2
    assert metadata_files(dirs, kept.uid) == [f"{kept.uid}_gpu.json"], "a prepared claim's stays"
    assert (root / "notes.txt").exists()


def test_unprepare_removes_a_directory_an_older_version_wrote(env):
    """A claim prepared before an upgrade has its file where that version put it."""
    api, _, kubelet, dirs = env
    claim = new_claim(api, "old", [result("gpu", GPU)])
    assert kubelet.prepare([claim]).claims[claim.uid].error == ""
    legacy = dirs.state / "metadata" / claim.uid / "gpu"
    legacy.mkdir(parents=True)
    (legacy / f"{DRIVER}-metadata.json").write_text("{}")
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
    assert metadata_files(dirs, claim.uid) == []
