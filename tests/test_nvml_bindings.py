"""Mock mode runs the real nvidia-ml-py over a fake libnvidia-ml.so.1: discovery, MIG,
XID events and shutdown go through nvidia-ml-py's own wrappers, ctypes structs and
error mapping."""

from __future__ import annotations

import ast
import inspect
import json
import re
import time
from pathlib import Path

import pytest

from driver.devices import mock
from driver.devices.discovery import discover
from driver.devices.model import DeviceKind
from driver.monitoring.health import HealthState, XidWatcher
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "data" / "nvml"
GPU_PROFILES = sorted(p.stem for p in GOLDEN.glob("*.json"))


def snapshot(result) -> list[dict]:
    return [{"name": d.name, "kind": d.kind.value,
             "attributes": {k: (v.value if hasattr(v, "value") else v) for k, v in sorted(d.attributes.items())},
             "capacity": dict(sorted(d.capacity.items())), "deviceNodes": list(d.device_nodes)}
            for d in result.inventory.devices if d.kind in (DeviceKind.GPU, DeviceKind.MIG)]


def test_every_gpu_profile_has_a_golden_file():
    gpu_profiles = [p for p in mock.builtin_profiles() if mock.load(p).driver_version is not None]
    assert GPU_PROFILES == sorted(gpu_profiles)


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_discovery_through_the_real_bindings_matches_the_old_stand_in(profile, tmp_path):
    golden = json.loads((GOLDEN / f"{profile}.json").read_text())
    node = mock.build(mock.load(profile), tmp_path / "m")
    result = discover(node.sources())
    assert snapshot(result) == golden["gpus"]
    assert sorted(p.message for p in result.problems) == golden["problems"]
    assert node.library.errors == [], "no call hit a bug in the fake library"
    assert node.library._refs == 0, "every nvmlInit was matched by nvmlShutdown"


def test_calls_go_through_nvidia_ml_pys_function_table(tmp_path):
    import pynvml

    node = mock.build(mock.load("a100-mig"), tmp_path / "m")
    nv = node.nvml
    # The real module's code, bound to the fake library, not a stand-in of our own.
    assert Path(nv.__file__).resolve() == Path(pynvml.__file__).resolve()
    assert inspect.getsource(nv.nvmlDeviceGetCount) == inspect.getsource(pynvml.nvmlDeviceGetCount)
    assert nv.nvmlLib is node.library and nv is not pynvml
    discover(node.sources())
    # nvidia-ml-py looked each C function up once (its pointer cache) under its versioned name.
    assert {"nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
            "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetAttributes_v2", "nvmlShutdown"} <= set(node.library.lookups)
    assert len(node.library.lookups) == len(set(node.library.lookups))
    assert node.library.calls["nvmlDeviceGetMigDeviceHandleByIndex"] >= 10
    assert nv._nvmlGetFunctionPointer_cache.keys() == set(node.library.lookups)


def test_two_mock_nodes_in_one_process_do_not_share_nvml_state(tmp_path):
    a = mock.build(mock.load("l4"), tmp_path / "a")
    b = mock.build(mock.load("h100x8"), tmp_path / "b")
    assert len(discover(a.sources()).inventory.by_kind(DeviceKind.GPU)) == 4
    assert len(discover(b.sources()).inventory.by_kind(DeviceKind.GPU)) == 8
    assert a.nvml is not b.nvml and a.nvml.nvmlLib is a.library


def test_an_old_driver_branch_without_newer_functions(tmp_path):
    """R418 has no nvmlDeviceGetArchitecture and no MIG: discovery succeeds without them,
    and says so once, not once per GPU."""
    profile = mock.parse('nvidia: {driverVersion: "418.226.00", cudaDriverVersion: 10010}\n'
                         "roots: [{devices: [{type: gpu, model: a100-sxm4-40gb, mig: [3g.20gb]}, "
                         "{type: gpu, model: a100-sxm4-40gb}]}]\n", "old-driver")
    node = mock.build(profile, tmp_path / "m")
    assert "nvmlDeviceGetArchitecture" not in node.library.exported
    result = discover(node.sources())
    gpus = result.inventory.by_kind(DeviceKind.GPU)
    assert len(gpus) == 2 and not result.inventory.by_kind(DeviceKind.MIG)
    assert all("architecture" not in g.attributes and g.attributes["brand"] == "Nvidia" for g in gpus)
    notes = [p for p in result.problems if "lacks" in p.message]
    assert len(notes) == 1 and not notes[0].skipped
    assert "nvmlDeviceGetArchitecture" in notes[0].message and "nvmlDeviceGetMigMode" in notes[0].message


def nvml_functions_the_driver_calls() -> set[str]:
    """Every `<something>.nvmlXxx(` the driver's code contains."""
    called = set()
    for path in (REPO / "driver").rglob("*.py"):
        if "mock" in path.parts or "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and re.fullmatch(r"nvml[A-Z]\w*", node.attr):
                called.add(node.attr)
    return called


def c_functions(wrapper: str, seen: set[str] | None = None) -> set[str]:
    """The C functions an nvidia-ml-py wrapper reaches (through the wrappers it calls)."""
    import pynvml

    seen = seen if seen is not None else set()
    if wrapper in seen or not callable(getattr(pynvml, wrapper, None)):
        return set()
    seen.add(wrapper)
    source = inspect.getsource(getattr(pynvml, wrapper))
    names = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    for inner in re.findall(r"\b(nvml[A-Z]\w*)\(", source):
        if inner != wrapper:
            names |= c_functions(inner, seen)
    return names


def test_the_fake_library_implements_every_nvml_function_the_driver_can_reach(tmp_path):
    called = nvml_functions_the_driver_calls()
    assert {"nvmlInit", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlEventSetWait_v2"} <= called
    node = mock.build(mock.load("a100-mig"), tmp_path / "m")
    needed = set().union(*(c_functions(w) for w in called if not w.startswith("nvmlEventType")))
    missing = needed - node.library.exported
    assert missing == set(), f"a new NVML call needs the fake library to implement {missing}"


def _watch(node, result):
    state = HealthState("accel.dra.io", lambda: result.inventory)
    watcher = XidWatcher(node.nvml, state, frozenset({13}))
    watcher.start()
    assert watcher.ready.wait(10)
    return state, watcher


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_xid_on_a_mig_device_and_on_a_gpu_that_then_falls_off_the_bus(tmp_path):
    node = mock.build(mock.load("a100-mig"), tmp_path / "m")
    result = discover(node.sources())
    state, watcher = _watch(node, result)
    try:
        # A MIG-attributed XID marks that MIG device only.
        node.library.inject_xid(1, 94, gpu_instance=2, compute_instance=0)
        assert _wait(lambda: state.conditions("mig-0000-12-00-0-gi2-ci0"))
        assert not state.conditions("mig-0000-12-00-0-gi1-ci0")
        # An XID, and the GPU is gone before the watcher reads the event: attributed by
        # the handle's address, no longer answerable through NVML.
        gone = node.library.gpus[3]
        with node.library._event_ready:
            node.library.inject_xid(3, 79)
            gone.lost = True
        target = f"gpu-{gone.bus_id.replace(':', '-').replace('.', '-')}"
        assert _wait(lambda: "gpu-xid" in state.conditions(target)), state.conditions(target)
        # Ignored XIDs change nothing.
        node.library.inject_xid(2, 13)
        time.sleep(0.3)
        assert not state.conditions("gpu-0000-21-00-0")
    finally:
        watcher.stop()
    assert node.library.errors == []
    assert node.library._refs == 0 and node.library._sets == {}, "event set freed, NVML shut down"
    assert node.library.calls["nvmlEventSetWait_v2"] >= 3
