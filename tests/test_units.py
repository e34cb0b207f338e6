"""Pure functions: CDI versions and names, opaque config decoding, edits, checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from driver.prepare import cdi, edits, opaque

from driver.kube import names

from driver.publish import slices
from driver.prepare.cdi import CdiDevice, ContainerEdits, DeviceNode, NetDevice
from driver.state.checkpoint import Checkpoint, CheckpointError, ClaimRecord, PreparedDevice, State
from driver.devices.model import Device, DeviceKind, Inventory, Version
from driver.state.instance import Instance
from driver.state.locks import KeyedLocks
from tests.cdi_check import SCHEMA_DIR, check_spec, schema_errors


def node(path="/dev/x"):
    return ContainerEdits(device_nodes=(DeviceNode(path, "/host" + path),))


@pytest.mark.parametrize("devices, kind, expected", [
    ([CdiDevice("a", ContainerEdits(env=("A=1",)))], "v.io/claim", "0.3.0"),
    ([CdiDevice("a", node())], "v.io/claim", "0.5.0"),
    ([CdiDevice("0a", ContainerEdits(env=("A=1",)))], "v.io/claim", "0.5.0"),
    ([CdiDevice("a", ContainerEdits(env=("A=1",)))], "v.io/cl.aim", "0.6.0"),
    ([CdiDevice("a", ContainerEdits(net_devices=(NetDevice("eth1", "net1"),)))], "v.io/claim", "1.1.0"),
])
def test_cdi_minimum_version(devices, kind, expected):
    assert cdi.minimum_version(kind, devices) == expected


def test_cdi_spec_checks():
    spec = cdi.build_spec("accel.dra.io", [CdiDevice("1234-gpu-0", node())], "claim x/y")
    check_spec(spec)
    with pytest.raises(cdi.CdiError, match="no container edits"):
        cdi.build_spec("v.io", [CdiDevice("a")], "claim x/y")
    with pytest.raises(cdi.CdiError, match="invalid"):
        cdi.build_spec("v.io", [CdiDevice("-bad", node())], "claim x/y")
    with pytest.raises(cdi.CdiError, match="used twice"):
        cdi.build_spec("v.io", [CdiDevice("a", node()), CdiDevice("a", node())], "claim x/y")
    with pytest.raises(cdi.CdiError, match="at least one"):
        cdi.build_spec("v.io", [], "claim x/y")


def test_host_path_refuses_escapes(tmp_path):
    assert edits.host_path(tmp_path, "/dev/nvidia0") == str(tmp_path / "nvidia0")
    for bad in ("/etc/shadow", "/dev/../etc/shadow", "dev/x", "/devices/x"):
        with pytest.raises(edits.EditsError):
            edits.host_path(tmp_path, bad)


def test_opaque_round_trip():
    config = opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "NicConfig",
                            "moveInterface": True, "interfaceName": "net1", "env": {"X": "1"}})
    assert opaque.from_dict(opaque.to_dict(config)) == config
    with pytest.raises(opaque.ConfigDecodeError, match="true or false"):
        opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "NicConfig", "rdma": "yes"})
    with pytest.raises(opaque.ConfigDecodeError, match="DRA_"):
        opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "GpuConfig", "env": {"DRA_X": "1"}})
    with pytest.raises(opaque.ConfigDecodeError, match="not an interface name"):
        opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "NicConfig", "interfaceName": "a" * 20})


GOOD_SPEC = {"cdiVersion": "0.5.0", "kind": "accel.dra.io/claim", "devices": [
    {"name": "u-gpu", "containerEdits": {"env": ["A=1"], "deviceNodes": [
        {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "permissions": "rw"}],
        "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro", "bind"]}]}}]}


def _mutated(change) -> dict:
    import copy

    spec = copy.deepcopy(GOOD_SPEC)
    change(spec)
    return spec


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.update(extra=1), "unknown field"),
    (lambda s: s["devices"][0]["containerEdits"].update(devices=[]), "unknown field"),
    (lambda s: s.update(kind="1vendor/claim"), "1vendor"),
    (lambda s: s["devices"][0].update(name="-x"), "name"),
    (lambda s: s.update(cdiVersion="0.3.0"), "minimum"),
    (lambda s: s.update(cdiVersion="0.6.0"), "minimum"),
    (lambda s: s.update(cdiVersion="9.9"), "9.9"),
    (lambda s: s["devices"][0].update(containerEdits={}), "must not be empty"),
    (lambda s: s["devices"][0]["containerEdits"].update(env="A=1"), "env: must be a list of strings"),
    (lambda s: s["devices"][0]["containerEdits"]["env"].append("NOEQUALS"), "KEY=VALUE"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(major="1"), "major: must be a integer"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(permissions="rwx"), "permissions"),
    (lambda s: s["devices"][0]["containerEdits"]["mounts"][0].pop("containerPath"), "containerPath is required"),
    (lambda s: s["devices"][0]["containerEdits"].update(netDevices=[{"hostInterfaceName": "a", "name": "b"}]), "minimum"),
    (lambda s: s["devices"][0]["containerEdits"].update(netDevices=[{"name": "b"}]), "hostInterfaceName is required"),
    (lambda s: s["devices"].append(dict(s["devices"][0])), "unique"),
    (lambda s: s.update(devices=[]), "at least one device"),
])
def test_our_cdi_checks_catch_invalid_specs_and_versions_not_the_minimum(change, fragment):
    """What the reference parser rejects, plus our own rule: declare exactly the minimum
    cdiVersion the fields need (older runtimes reject newer versions)."""
    check_spec(GOOD_SPEC)
    with pytest.raises(AssertionError, match=fragment):
        check_spec(_mutated(change))


@pytest.mark.skipif(not SCHEMA_DIR.is_dir(), reason=f"upstream CDI schema not found at {SCHEMA_DIR} (optional extra check)")
def test_specs_for_every_device_of_every_profile_match_the_upstream_schema(built):
    from driver.prepare.opaque import NicConfig

    assert schema_errors(GOOD_SPEC) == []
    for profile in ("mixed", "a100-mig", "alveo", "dfl", "sriov"):
        node, result = built(profile)
        for device in result.inventory.devices:
            config = NicConfig(moveInterface=True) if device.net_interface else opaque.default_for(device.kind)
            built_edits = edits.build(device, config, claim="ns/c", request="r", dev_root=node.dev)
            spec = cdi.build_spec("accel.dra.io", [CdiDevice(f"u-{device.name}", built_edits)], "claim ns/c")
            check_spec(spec)
            assert schema_errors(spec) == [], (profile, device.name)


def test_semver_normalization():
    assert names.normalize_semver("535.104.05") == "535.104.5"
    assert names.normalize_semver("12.4") == "12.4.0"
    assert names.normalize_semver("v1.2.3") is None
    assert names.normalize_semver("1.2.3.4") is None
    with pytest.raises(ValueError):
        Version("01.2.3")


def test_checkpoint_round_trip_and_errors(tmp_path):
    checkpoint = Checkpoint(tmp_path, Instance.register(tmp_path, None))
    record = ClaimRecord("0b1c", "ns", "name", State.PREPARE_COMPLETED, "boot",
                         (PreparedDevice("r/s", "pool", "gpu-0", ("v/claim=0b1c-gpu-0",), {"kind": "GpuConfig", "env": {}}),))
    checkpoint.put(record)
    assert checkpoint.get("0b1c") == record
    assert checkpoint.uids() == ["0b1c"]
    (tmp_path / "claims" / "0b1c.json").write_text('{"version": 99}')
    with pytest.raises(CheckpointError, match="unknown checkpoint format 99"):
        checkpoint.get("0b1c")
    with pytest.raises(CheckpointError, match="not a valid UID"):
        checkpoint.get("../x")
    assert checkpoint.remove("0b1c") and not checkpoint.remove("0b1c")


def test_keyed_locks_do_not_grow():
    locks = KeyedLocks()

    async def main():
        async def hold(key):
            async with locks.hold(key):
                await asyncio.sleep(0)

        await asyncio.gather(*(hold(f"k{i % 5}") for i in range(50)))

    asyncio.run(main())
    assert locks._locks == {}


def test_slices_group_by_kind_and_respect_taint_limit():
    devices = [Device(f"nic-{i:03d}", DeviceKind.NIC, {"type": "nic"}) for i in range(130)]
    devices.append(Device("gpu-0", DeviceKind.GPU, {"type": "gpu"}, {"memory": "1Gi"}))
    inventory = Inventory(tuple(devices))
    pool = slices.PoolIdentity("accel.dra.io", "node-a", "uid-1")
    built = slices.build(inventory, pool, 3)
    assert [len(s["spec"]["devices"]) for s in built] == [1, 128, 2]
    assert {s["spec"]["pool"]["generation"] for s in built} == {3}
    assert built[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    tainted = slices.build(inventory, pool, 3, taints={"nic-000": [{"key": "accel.dra.io/unhealthy", "effect": "NoSchedule"}]})
    assert [len(s["spec"]["devices"]) for s in tainted] == [1, 64, 64, 2]
    beta = slices.build(inventory, pool, 1, api_version="v1beta1")
    assert beta[0]["spec"]["devices"][0] == {"name": "gpu-0", "basic": {
        "attributes": {"type": {"string": "gpu"}}, "capacity": {"memory": {"value": "1Gi"}}}}
    assert slices.build(Inventory(), pool, 1) == [], "a node with nothing to publish has no slice"


def test_slices_keep_a_pf_and_its_vfs_together():
    """A PF and its VFs share a slice unless they alone overflow one, so that a VF added or
    removed changes that slice only; devices without a family keep plain name order."""
    from driver.devices.model import PciLocation

    def pf(bus: str, vfs: int) -> list[Device]:
        out = [Device(f"nic-{bus}-pf", DeviceKind.NIC, {"type": "nic"}, pci=PciLocation(bus, None, None))]
        out += [Device(f"nic-{bus}-vf{i:03d}", DeviceKind.NIC, {"type": "nic", "pfPciBusID": bus},
                       pci=PciLocation(f"{bus}.{i}", None, None)) for i in range(vfs)]
        return out

    pool = slices.PoolIdentity("accel.dra.io", "node-a")

    def sizes(devices) -> list[list[str]]:
        built = slices.build(Inventory(tuple(devices)), pool, 1)
        return [sorted({d["name"].split("-vf")[0].removesuffix("-pf") for d in s["spec"]["devices"]})
                + [len(s["spec"]["devices"])] for s in built]

    # Name order alone would cut a (71), b (71), c (3) into 128 + 17 and split b.
    assert sizes(pf("a", 70) + pf("b", 70) + pf("c", 2)) == [["nic-a", 71], ["nic-b", "nic-c", 74]]
    # One VF more for a: only a's slice changes.
    assert sizes(pf("a", 71) + pf("b", 70) + pf("c", 2)) == [["nic-a", 72], ["nic-b", "nic-c", 74]]
    # A family larger than a slice fills whole slices, and the rest goes on with the next.
    assert sizes(pf("a", 200) + pf("b", 2)) == [["nic-a", 128], ["nic-a", "nic-b", 76]]
    # Families of one (GPUs, PFs without VFs) are cut in name order, as before.
    gpus = [Device(f"gpu-{i:03d}", DeviceKind.GPU, {"type": "gpu"}) for i in range(130)]
    assert [len(s["spec"]["devices"]) for s in slices.build(Inventory(tuple(gpus)), pool, 1)] == [128, 2]


def test_an_internal_error_fails_one_claim_not_the_request(tmp_path):
    """A bug reached by one claim (here: a reader that raises KeyError) becomes that claim's
    error; the other claim of the request is prepared."""
    from driver.prepare.claims import ClaimRef
    from driver.state.locks import ProcessLock
    from driver.prepare.preparer import Preparer
    from tests.conftest import discover_profile

    node, result = discover_profile("mixed", tmp_path / "m")
    instance = Instance.register(tmp_path / "state", None)

    class Reader:
        async def read(self, ref):
            if ref.name == "boom":
                raise KeyError("status")
            return {"metadata": {"uid": ref.uid}, "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": "accel.dra.io", "pool": "n", "device": "gpu-0000-11-00-0"}]}}}}

    preparer = Preparer(driver="accel.dra.io", pool="n", inventory=lambda: result.inventory,
                        claims=Reader(), cdi_writer=cdi.CdiWriter(tmp_path / "cdi", "accel.dra.io", instance),
                        checkpoint=Checkpoint(tmp_path / "state", instance), boot_id="b", dev_root=node.dev,
                        process_lock=ProcessLock(tmp_path / "lock"))
    good, bad = ClaimRef("ns", "ok", "0a-1"), ClaimRef("ns", "boom", "0b-2")
    outcomes = asyncio.run(preparer.prepare([good, bad]))
    assert outcomes[good.uid].error == "" and len(outcomes[good.uid].devices) == 1
    assert outcomes[bad.uid].error == "claim ns/boom: internal error: KeyError('status')"


def test_driver_files_are_found_for_the_running_version_only(tmp_path):
    import os

    from driver.devices import nvlibs

    root = tmp_path / "driver"
    (root / "usr/lib64").mkdir(parents=True)  # a RHEL-style layout
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib64/libcuda.so.535.104.05").write_text("x")
    (root / "usr/lib64/libcuda.so.550.54.15").write_text("x")  # left over from another driver
    (root / "usr/lib64/libnvidia-ml.so.535.104.05").write_text("x")
    (root / "usr/bin/nvidia-smi").write_text("#!/bin/sh\n")
    os.chmod(root / "usr/bin/nvidia-smi", 0o755)
    (root / "usr/bin/nvidia-debugdump").write_text("not executable")
    mounts = nvlibs.find(root, Path("/run/nvidia/driver"), "535.104.05")
    assert [(m.host_path, m.container_path) for m in mounts] == [
        ("/run/nvidia/driver/usr/lib64/libcuda.so.535.104.05", "/usr/local/nvidia/lib64/libcuda.so.1"),
        ("/run/nvidia/driver/usr/lib64/libnvidia-ml.so.535.104.05", "/usr/local/nvidia/lib64/libnvidia-ml.so.1"),
        ("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi"),
    ]
    assert nvlibs.find(root, root, None) == ()
    # Another version: no library matches (binaries carry no version in their name).
    other = nvlibs.find(root, root, "999.1")
    assert [m.container_path for m in other] == ["/usr/local/nvidia/bin/nvidia-smi"]


def test_instances_in_one_process_are_told_apart_and_sweeps_spare_the_living(tmp_path):
    """Two instances with the same PID (as two pods' PID 1): each one's temp files carry its
    token; a sweep removes a dead instance's leftovers and never a live one's."""
    import os

    from driver.state import atomic
    state, cdi_root = tmp_path / "state", tmp_path / "cdi"
    old = Instance.register(state, "old-pod-uid")
    new = Instance.register(state, "new-pod-uid")
    assert old.token != new.token  # same PID, different instances
    assert [p.token for p in old.peers()] == [new.token] and old.newer_peer().token == new.token
    assert new.newer_peer() is None and [p.token for p in new.peers()] == [old.token]

    cdi_root.mkdir()
    in_flight = cdi_root / f".accel.dra.io-claim_u1.json{atomic.TEMP_MARK}{new.token}"
    dead = cdi_root / f".accel.dra.io-claim_u2.json{atomic.TEMP_MARK}0123456789ab"
    legacy = cdi_root / f".accel.dra.io-claim_u3.json{atomic.TEMP_MARK}999"  # PID-named, older version
    young = cdi_root / f".accel.dra.io-claim_u4.json{atomic.TEMP_MARK}fedcba987654"  # unknown writer
    for path in (in_flight, dead, legacy, young):
        path.write_text("{")
        if path is not young:
            os.utime(path, (0, 0))
    cdi.CdiWriter(cdi_root, "accel.dra.io", old)  # start-up sweep of the older instance
    assert in_flight.exists() and not dead.exists() and not legacy.exists()
    assert young.exists(), "a fresh temp file of a writer we do not know is left alone"

    # A crashed instance (lock released, lock file left) is dead: its temp files go at
    # once, whatever their age; then its entry is forgotten.
    token = new.token
    os.close(new._fd)
    new._fd = None
    os.utime(in_flight, None)  # written just now
    assert old.owner_state(token) == "dead" and old.peers() == []
    cdi.CdiWriter(cdi_root, "accel.dra.io", old)
    assert not in_flight.exists()
    assert old.forget_dead() == 1 and old.owner_state(token) == "unknown"
    with pytest.raises(RuntimeError, match="already uses instance token"):
        Instance.register(state, "old-pod-uid")
    old.release()


def test_checkpoint_sees_records_the_other_instance_wrote(tmp_path):
    a = Checkpoint(tmp_path, Instance.register(tmp_path, "pod-a"))
    b = Checkpoint(tmp_path, Instance.register(tmp_path, "pod-b"))
    device = PreparedDevice("r", "pool", "gpu-0", ("v/claim=x",))
    assert list(a.records()) == []
    b.put(ClaimRecord("u1", "ns", "one", State.PREPARE_COMPLETED, "boot", (device,)))
    assert [r.uid for r in a.records()] == ["u1"]
    a.put(ClaimRecord("u2", "ns", "two", State.PREPARE_COMPLETED, "boot", (device,)))
    assert sorted(r.uid for r in b.records()) == ["u1", "u2"]
    b.remove("u1")
    assert [r.uid for r in a.records()] == ["u2"]


def test_checkpoint_marker_differs_after_a_container_restart_in_the_same_pod(tmp_path):
    """A restarted container keeps its pod's token and counts changes from 0 again: its
    first change must still look new to the other instance."""
    instance = Instance.register(tmp_path, "pod-a")
    a = Checkpoint(tmp_path, instance)
    b = Checkpoint(tmp_path, Instance.register(tmp_path, "pod-b"))
    device = PreparedDevice("r", "pool", "gpu-0", ("v/claim=x",))
    a.put(ClaimRecord("u1", "ns", "one", State.PREPARE_COMPLETED, "boot", (device,)))
    assert [r.uid for r in b.records()] == ["u1"]
    restarted = Checkpoint(tmp_path, instance)  # same token, counter back at 0
    restarted.remove("u1")
    assert list(b.records()) == []


def test_checkpoint_marker_written_in_place_and_by_an_older_version(tmp_path):
    """The marker is rewritten in place (padded, never truncated); an older version
    beside it truncates and rewrites the same file. Each sees the other's changes."""
    a = Checkpoint(tmp_path, Instance.register(tmp_path, "pod-a"))
    device = PreparedDevice("r", "pool", "gpu-0", ("v/claim=x",))
    marker = tmp_path / "claims" / ".changes"
    a.put(ClaimRecord("u1", "ns", "one", State.PREPARE_COMPLETED, "boot", (device,)))
    inode = marker.stat().st_ino
    assert [r.uid for r in a.records()] == ["u1"]
    # An older version writes a record and its (short, unpadded) marker.
    older = ClaimRecord("u2", "ns", "two", State.PREPARE_COMPLETED, "boot", (device,))
    (tmp_path / "claims" / "u2.json").write_bytes(older.to_json())
    theirs = "0ld0ld0ld0ld " + "f" * 48 + " 1"  # longer than ours, unpadded
    marker.write_text(theirs)
    assert sorted(r.uid for r in a.records()) == ["u1", "u2"]
    # Our next change covers all of theirs, in the same file.
    a.remove("u1")
    assert marker.read_text().split() == [a.instance.token, a._nonce, str(a._counter)]
    assert marker.stat().st_ino == inode
    assert [r.uid for r in a.records()] == ["u2"]
    a.close()
    a.put(ClaimRecord("u3", "ns", "three", State.PREPARE_COMPLETED, "boot", (device,)))
    assert sorted(r.uid for r in a.records()) == ["u2", "u3"], "reopened after close"
    a.close()


def test_checkpoint_fresh_read_trusts_the_disk_over_the_cache(tmp_path):
    checkpoint = Checkpoint(tmp_path, Instance.register(tmp_path, None))
    device = PreparedDevice("r", "pool", "gpu-0", ("v/claim=x",))
    checkpoint.put(ClaimRecord("u1", "ns", "one", State.PREPARE_COMPLETED, "boot", (device,)))
    assert [r.uid for r in checkpoint.records()] == ["u1"]
    (tmp_path / "claims" / "u1.json").unlink()  # behind the cache's back
    assert [r.uid for r in checkpoint.records()] == ["u1"]
    assert list(checkpoint.records(fresh=True)) == []
    assert list(checkpoint.records()) == []


def test_health_stream_resends_inside_the_kubelets_window():
    """1.34+ kubelets mark a device Unknown 30 s after its last update."""
    from driver.kubelet import health as stream

    assert 10 <= stream.RESEND_SECONDS <= 15
    assert stream.TIMEOUT_SECONDS >= 2 * stream.RESEND_SECONDS

    class State:
        def inventory(self):
            return Inventory((Device("gpu-0", DeviceKind.GPU, {}),))

        def conditions(self, name):
            return {}

        def subscribe(self, callback):
            return lambda: None

    service = stream.HealthService(State(), "node-a", resend_seconds=0.05)

    async def first_three():
        messages = []
        async for message in service.NodeWatchResources(None, None):
            messages.append(message)
            if len(messages) == 3:
                break
        return messages

    messages = asyncio.run(first_three())
    assert [m.devices[0].device.device_name for m in messages] == ["gpu-0"] * 3
    assert messages[0].devices[0].health_check_timeout_seconds == stream.TIMEOUT_SECONDS


def test_logs_are_console_lines_on_a_terminal_and_json_otherwise():
    import io
    import json

    import structlog

    from driver import logs
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, is_json in ((Terminal(), False), (io.StringIO(), True)):
        logs.configure("auto", "info", stream=stream)
        structlog.get_logger(component="t").info("hello", device="gpu-0")
        line = stream.getvalue().strip()
        if is_json:
            assert json.loads(line)["event"] == "hello"
        else:
            assert "hello" in line and "device" in line and not line.startswith("{")
    logs.configure("json", "info")
