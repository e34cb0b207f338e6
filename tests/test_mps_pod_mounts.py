"""The MPS control daemon pod's mounts inside its read-only driver root, as runc treats
them: found on the real cluster (tests/cluster/test_examples.py, gpu-mps-shared-claim), where
every daemon pod of a mock node failed with `make mountpoint "/driver-root/tmp": mkdirat
…: read-only file system` and every MPS prepare timed out. The emulated kubelet now applies
the same rule, and the driver mounts inside the driver root only where the daemon chroots."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from driver.devices import mock
from driver.prepare.mps import DAEMON_DRIVER_ROOT, MpsDaemons
from driver.prepare.setup import Setup
from driver.sim.apiserver import ApiServer
from driver.sim.pods import PodRunner


def mounts_inside_read_only(manifest: dict) -> list[tuple[str, Path]]:
    """Each mount that lies inside a read-only mount, with the host path its mountpoint
    must already have (runc cannot make a folder in a read-only bind mount)."""
    (c,) = manifest["spec"]["containers"]
    hosts = {v["name"]: Path(v["hostPath"]["path"]) for v in manifest["spec"]["volumes"]}
    out = []
    for ro in (m for m in c["volumeMounts"] if m.get("readOnly")):
        for m in c["volumeMounts"]:
            if m["mountPath"].startswith(ro["mountPath"].rstrip("/") + "/"):
                out.append((m["mountPath"], hosts[ro["name"]] / m["mountPath"][len(ro["mountPath"]):].lstrip("/")))
    return out


def test_a_bare_driver_installation_gets_no_mounts_inside_it(tmp_path):
    node = mock.build(mock.load("mixed"), tmp_path / "mock")  # lib/ and bin/, no shell, no tmp/
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         node.driver_root)
    assert not daemons.chroots()
    manifest = daemons.manifest("gpu-0", "GPU-1", Setup("MPS"))
    assert mounts_inside_read_only(manifest) == []
    (c,) = manifest["spec"]["containers"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {
        str(daemons.paths("gpu-0").root), "/dev/shm", DAEMON_DRIVER_ROOT}


def test_a_full_root_filesystem_gets_them_and_has_their_mountpoints(tmp_path):
    root = tmp_path / "run-nvidia-driver"
    for d in ("bin", "tmp", "dev/shm"):
        (root / d).mkdir(parents=True)
    (root / "bin" / "sh").write_text("")
    # the driver sees the root where it mounts it (local), the runtime at the host path
    daemons = MpsDaemons(None, "accel.dra.io", "node-a", "dra-system", "img", tmp_path / "state",
                         Path("/run/nvidia/driver"), driver_root_local=root)
    assert daemons.chroots()
    inside = mounts_inside_read_only(daemons.manifest("gpu-0", "GPU-1", Setup("MPS")))
    assert [m for m, _ in inside] == [f"{DAEMON_DRIVER_ROOT}/tmp", f"{DAEMON_DRIVER_ROOT}/dev/shm"]
    assert all((root / p.relative_to("/run/nvidia/driver")).is_dir() for _, p in inside)


def _pod(ro: Path, other: Path, out: Path) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "p"},
            "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                     "volumes": [{"name": "ro", "hostPath": {"path": str(ro), "type": "Directory"}},
                                 {"name": "other", "hostPath": {"path": str(other), "type": "Directory"}}],
                     "containers": [{"name": "c", "command": ["/bin/sh", "-c", f"touch {out}"],
                                     "securityContext": {"runAsUser": 0},
                                     "volumeMounts": [{"name": "ro", "mountPath": "/ro", "readOnly": True},
                                                      {"name": "other", "mountPath": "/ro/sub"}]}]}}


def _wait_status(api: ApiServer, predicate, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        with api.state.lock:
            status = dict(api.state.pods[("ns", "p")].get("status") or {})
        if predicate(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def test_the_emulated_kubelet_refuses_a_mountpoint_it_cannot_make_in_a_read_only_mount(tmp_path):
    ro, other, out = tmp_path / "ro", tmp_path / "other", tmp_path / "ran"
    ro.mkdir(), other.mkdir()
    with ApiServer() as api, PodRunner(api, "node-a", tmp_path / "logs"):
        with api.state.lock:
            api.state.pods[("ns", "p")] = _pod(ro, other, out)
        status = _wait_status(api, lambda s: bool(s.get("containerStatuses")))
        waiting = status["containerStatuses"][0]["state"]["waiting"]
        assert status["phase"] == "Pending"
        assert f'make mountpoint "/ro/sub": mkdirat {ro}/sub: read-only file system' in waiting["message"]
        assert not out.exists()
        (ro / "sub").mkdir()  # the mountpoint exists now: runc mounts over it
        _wait_status(api, lambda s: s.get("phase") in ("Running", "Succeeded"))
        deadline = time.monotonic() + 10
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_container_of_the_emulated_kubelet_has_what_the_image_has_not_the_demo_extra(tmp_path):
    """The image installs requirements.lock; cel-python (the demo extra) is not in it, and
    the emulated container must not find it either (tests/test_cli_without_extras.py)."""
    out = tmp_path / "out"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "uid": "p"},
           "spec": {"nodeName": "node-a", "restartPolicy": "Never", "containers": [{
               "name": "c", "securityContext": {"runAsUser": 0},
               "command": [sys.executable, "-c",
                           "import importlib.util, sys; import yaml\n"
                           "try:\n import celpy\nexcept ImportError:\n open(sys.argv[1], 'w').write('no celpy')\n",
                           str(out)]}]}}
    with ApiServer() as api, PodRunner(api, "node-a", tmp_path / "logs"):
        with api.state.lock:
            api.state.pods[("ns", "p")] = pod
        deadline = time.monotonic() + 20
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert out.read_text() == "no celpy"
