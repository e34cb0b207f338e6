"""The rules of GPU sharing, piece by piece: config decoding, setups, shares, consumable
slices and the emulator's checks of them, the fallback where the server drops the fields,
the allocator's rounding, and the mock's GPU settings and MPS control daemon."""

from __future__ import annotations

import os
import subprocess
import time
from decimal import Decimal

import pytest

from driver.prepare import opaque

from driver.publish import slices
from driver.prepare.claims import ClaimError
from driver.devices import mock
from driver.devices.model import DeviceKind
from driver.kube.client import Kube, api_client
from driver.prepare.mps_daemon import control_answers
from driver.prepare import setup as setups
from driver.prepare import shares
from driver.prepare.gpucontrol import GpuControl, GpuControlError
from driver.publish.publisher import Publisher
from driver.scheduling.allocator import Shares, _round
from driver.sim.apiserver import ApiServer
from driver.scheduling.k8s_limits import request_policy_errors, slice_errors
from tests.conftest import discover_profile

GIB = 1 << 30


def gpu_config(sharing) -> dict:
    return {"apiVersion": opaque.API_VERSION, "kind": "GpuConfig", "sharing": sharing}


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    node, result = discover_profile("h100x8", tmp_path_factory.mktemp("h100"))
    gpus = [d for d in result.inventory.devices if d.kind is DeviceKind.GPU]
    return node, gpus


@pytest.fixture(scope="module")
def mig(tmp_path_factory):
    _, result = discover_profile("a100-mig", tmp_path_factory.mktemp("mig"))
    return next(d for d in result.inventory.devices if d.kind is DeviceKind.MIG)


# -- config ---------------------------------------------------------------------------------
def test_sharing_config_round_trips_through_the_checkpoint_form():
    config = opaque.decode(gpu_config({"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "20480Mi"}}))
    assert config.sharing.mpsConfig == opaque.MpsConfig(25, "20Gi"), "stored canonically"
    assert opaque.from_dict(opaque.to_dict(config)) == config
    timesliced = opaque.decode(gpu_config({"strategy": "TimeSlicing"}))
    assert timesliced.sharing.timeSlicingConfig is None
    assert opaque.decode(gpu_config(None)).sharing is None


@pytest.mark.parametrize("sharing, fragment", [
    ("MPS", "GpuConfig.sharing must be an object"),
    ({}, "strategy must be one of TimeSlicing, MPS, got None"),
    ({"strategy": "mps"}, "got 'mps'"),
    ({"strategy": "MPS", "replicas": 4}, "GpuConfig.sharing: unknown field(s) replicas"),
    ({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Huge"}},
     "interval must be one of Default, Short, Medium, Long, got 'Huge'"),
    ({"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}}, "unknown field(s) intervall"),
    ({"strategy": "TimeSlicing", "mpsConfig": {}}, "mpsConfig is set but strategy is TimeSlicing"),
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}, "from 1 to 100, got 101"),
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}, "from 1 to 100, got True"),
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}, "got '50'"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Ki"}}, "below 1Mi"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "20 GB"}}, "is not a quantity"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {}}},
     "unknown field(s) defaultPerDevicePinnedMemoryLimit"),
])
def test_bad_sharing_config_is_named(sharing, fragment):
    with pytest.raises(opaque.ConfigDecodeError) as err:
        opaque.decode(gpu_config(sharing))
    assert fragment in str(err.value)


# -- setups ---------------------------------------------------------------------------------
def limits(memory_gib: int, compute: int) -> shares.ShareLimits:
    return shares.ShareLimits(memory_gib * GIB, compute)


def test_setup_rules(h100, mig):
    _, gpus = h100
    gpu = gpus[0]
    plain = opaque.GpuConfig()
    mps = opaque.decode(gpu_config({"strategy": "MPS"}))
    ts = opaque.decode(gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}))
    assert setups.for_device("ns/c", gpu, plain, None) is None, "exclusive: nothing to set up"
    assert setups.for_device("ns/c", gpu, plain, limits(20, 30)) == setups.Setup("MPS"), \
        "a share runs under MPS though the claim did not ask"
    whole = shares.limits("ns/c", gpu, {"memory": gpu.capacity["memory"], "compute": "100"})
    assert whole.whole(gpu) and setups.for_device("ns/c", gpu, plain, whole) is None
    assert setups.for_device("ns/c", gpu, ts, whole) == setups.Setup("TimeSlicing", interval="Short")
    with pytest.raises(ClaimError, match="TimeSlicing cannot limit a share"):
        setups.for_device("ns/c", gpu, ts, limits(20, 30))
    with pytest.raises(ClaimError, match="time-slicing applies to whole GPUs only"):
        setups.for_device("ns/c", mig, ts, None)
    assert setups.for_device("ns/c", mig, mps, None) == setups.Setup("MPS")
    with pytest.raises(ClaimError, match="admin access"):
        setups.for_device("ns/c", gpu, mps, None, admin_access=True)
    assert setups.for_device("ns/c", gpu, plain, None, admin_access=True) is None


def test_conflicting_setups_name_both_claims(h100):
    _, gpus = h100
    with pytest.raises(ClaimError) as err:
        setups.check_compatible("ns/new", gpus[0], setups.Setup("MPS", active_threads=50),
                                [("ns/old", setups.Setup("MPS"))])
    message = str(err.value)
    assert "ns/new" in message and "ns/old" in message
    assert "defaultActiveThreadPercentage=50" in message and "server defaults" in message
    setups.check_compatible("ns/new", gpus[0], setups.Setup("MPS"), [("ns/old", setups.Setup("MPS"))])


# -- shares ---------------------------------------------------------------------------------
def test_share_limits_from_consumed_capacity(h100, mig):
    _, gpus = h100
    gpu = gpus[0]
    share = shares.limits("ns/c", gpu, {"memory": "20Gi", "compute": "30"})
    assert share == limits(20, 30) and share.memory_mib == 20480
    env = shares.env("DRA_X", share)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in env
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in env
    assert shares.limits("ns/c", gpu, {}) == shares.ShareLimits(81559 << 20, 100), "absent = all"
    for consumed, fragment in (({"memory": "200Gi"}, "the GPU has 81559Mi"),
                               ({"compute": "30.5"}, "whole percentage"),
                               ({"compute": "101"}, "whole percentage"),
                               ({"bandwidth": "1"}, "unknown capacity bandwidth"),
                               ({"memory": "lots"}, "quantities must match")):
        with pytest.raises(ClaimError, match=fragment):
            shares.limits("ns/c", gpu, consumed)
    with pytest.raises(ClaimError, match="only whole GPUs are shared"):
        shares.limits("ns/c", mig, {"memory": "1Gi"})


def test_shares_must_fit_the_gpu(h100):
    _, gpus = h100
    shares.check_fits("ns/c", gpus[0], limits(20, 30), [("ns/a", limits(20, 30)), ("ns/b", limits(20, 30))])
    with pytest.raises(ClaimError) as err:
        shares.check_fits("ns/c", gpus[0], limits(20, 30),
                          [("ns/a", limits(20, 40)), ("ns/b", limits(20, 40))])
    assert "ns/a (20Gi, 40%), ns/b (20Gi, 40%)" in str(err.value)
    with pytest.raises(ClaimError, match="overcommits"):
        shares.check_fits("ns/c", gpus[0], limits(60, 10), [("ns/a", limits(20, 10))])


# -- slices ---------------------------------------------------------------------------------
def test_consumable_slices_pass_the_servers_rules(h100):
    _, gpus = h100
    body = slices.device_body(gpus[0], "v1", sharing=slices.CONSUMABLE)
    assert body["allowMultipleAllocations"] is True
    for name, capacity in body["capacity"].items():
        assert request_policy_errors(name, capacity["requestPolicy"], capacity["value"]) == []
    assert slices.device_body(gpus[0], "v1beta1", sharing=slices.CONSUMABLE)["basic"].get(
        "allowMultipleAllocations") is None, "1.32/1.33 servers have no such field"
    assert "allowMultipleAllocations" not in slices.device_body(gpus[0], "v1")


@pytest.mark.parametrize("policy, value, fragment", [
    ({"default": "5", "validRange": {"min": "2", "step": "2"}}, "100", "not min + n*step"),
    ({"default": "200", "validRange": {"min": "1"}}, "100", "larger than the capacity value"),
    ({"validRange": {"min": "1"}}, "100", "default: required"),
    ({"default": "1", "validValues": ["2", "1"]}, "100", "ascending"),
    ({"default": "3", "validValues": ["1", "2"]}, "100", "must contain the default"),
    ({"default": "1", "validValues": ["1"], "validRange": {"min": "1"}}, "100", "mutually exclusive"),
    ({"default": "1", "validRange": {"max": "5"}}, "100", "validRange.min: required"),
])
def test_emulator_rejects_bad_request_policies(policy, value, fragment):
    assert any(fragment in e for e in request_policy_errors("p", policy, value))


def test_request_policy_needs_multiple_allocations(h100):
    _, gpus = h100
    body = slices.device_body(gpus[0], "v1", sharing=slices.CONSUMABLE)
    del body["allowMultipleAllocations"]
    obj = slices.build(mock_inventory(gpus[:1]), slices.PoolIdentity("accel.dra.io", "n"), 1)[0]
    obj["spec"]["devices"] = [body]
    assert any("allowMultipleAllocations is true" in e for e in slice_errors(obj))


def mock_inventory(devices):
    from driver.devices.model import Inventory

    return Inventory(tuple(devices))


def test_publisher_falls_back_to_exclusive_where_the_gate_is_off(tmp_path, h100):
    _, gpus = h100
    with ApiServer(gates={"DRAConsumableCapacity": False}) as api:
        api.add_node("n")
        kube = Kube(api_client(api.kubeconfig(tmp_path)))
        publisher = Publisher(kube, "accel.dra.io", "n", inventory=lambda: mock_inventory(gpus),
                              sharing=slices.CONSUMABLE)
        first = publisher.reconcile()
        assert publisher.sharing_supported is False
        second = publisher.reconcile()  # the exclusive body replaces what the server kept
        assert [publisher.reconcile() for _ in range(3)] == [0, 0, 0], "no write loop"
        assert first >= 1 and second <= 1
        stored = api.slices()[0]["spec"]["devices"][0]
        assert "allowMultipleAllocations" not in stored and "compute" not in stored["capacity"]
    with ApiServer() as api:
        api.add_node("n")
        kube = Kube(api_client(api.kubeconfig(tmp_path)))
        publisher = Publisher(kube, "accel.dra.io", "n", inventory=lambda: mock_inventory(gpus),
                              sharing=slices.CONSUMABLE)
        publisher.reconcile()
        assert publisher.sharing_supported and [publisher.reconcile() for _ in range(2)] == [0, 0], \
            "canonical quantities in request policies compare equal: no rewrite"


# -- the allocator's arithmetic ------------------------------------------------------------------
def test_request_policy_rounding():
    policy = {"validRange": {"min": "1Gi", "step": "1Gi"}}
    assert _round(Decimal(1), policy) == GIB, "raised to min"
    assert _round(Decimal(GIB + 1), policy) == 2 * GIB, "rounded up to the step"
    assert _round(Decimal(10), {"validRange": {"min": "1", "max": "5"}}) is None
    assert _round(Decimal(3), {"validValues": ["2", "4", "8"]}) == 4
    assert _round(Decimal(9), {"validValues": ["2", "4", "8"]}) is None
    capacity = {"memory": {"value": "10Gi", "requestPolicy": {"default": "10Gi", **policy}}}
    pool = Shares({"g": capacity})
    assert pool.amount("g", {}) == {"memory": 10 * GIB}
    pool.take("g", pool.amount("g", {"memory": "4Gi"}))
    assert pool.amount("g", {"memory": "7Gi"}) is None and pool.amount("g", {"memory": "6Gi"})


# -- the mock node's GPU settings and tools ---------------------------------------------------------
def test_compute_mode_persists_across_processes_and_resets_at_reboot(h100, tmp_path):
    node, gpus = h100
    uuid = str(gpus[0].attributes["uuid"])
    control = GpuControl(node.nvml, node.driver_root)
    assert control.compute_mode(uuid) == 0
    control.set_compute_mode(uuid, node.nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    again = mock.attach(mock.load("h100x8"), node.root)  # what a restarted driver loads
    assert GpuControl(again.nvml, again.driver_root).compute_mode(uuid) == 3
    with pytest.raises(GpuControlError, match="Not Supported"):
        control.set_compute_mode(uuid, node.nvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
    control.set_timeslice(uuid, 2)
    from driver.devices.mock.gpustate import GpuStateStore

    store = GpuStateStore(node.root)
    assert store.get(uuid).timeslice == 2
    boot = node.proc / "sys" / "kernel" / "random" / "boot_id"
    old = boot.read_text()
    boot.write_text("another-boot\n")
    try:
        assert store.get(uuid).timeslice == 0 and control.compute_mode(uuid) == 0
    finally:
        boot.write_text(old)
    control.set_compute_mode(uuid, 0)
    control.set_timeslice(uuid, 0)
    with pytest.raises(GpuControlError, match="No devices were found matching GPU-nope"):
        control.set_timeslice("GPU-nope", 1)


def test_mig_devices_have_no_compute_mode_of_their_own(tmp_path):
    node, result = discover_profile("a100-mig", tmp_path / "m")
    device = next(d for d in result.inventory.devices if d.kind is DeviceKind.MIG)
    control = GpuControl(node.nvml, node.driver_root)
    with pytest.raises(GpuControlError, match="Not Supported"):
        control.compute_mode(str(device.attributes["uuid"]))


def test_mock_mps_control_daemon_behaves_like_the_real_one(h100, tmp_path):
    node, _ = h100
    binary = node.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control"
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"),
               CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log"))
    client = subprocess.run([str(binary)], input="get_server_list\n", env=env, capture_output=True,
                            text=True, timeout=30)
    assert client.returncode == 1 and "Cannot find MPS control daemon" in client.stderr
    daemon = subprocess.Popen([str(binary), "-f"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not control_answers(tmp_path / "pipe"):
            assert time.monotonic() < deadline and daemon.poll() is None
            time.sleep(0.05)
        second = subprocess.run([str(binary), "-f"], env=env, capture_output=True, text=True, timeout=30)
        assert second.returncode == 1 and "already running" in second.stderr
        out = subprocess.run([str(binary)], env=env, capture_output=True, text=True, timeout=30,
                             input="set_default_active_thread_percentage 40\n"
                                   "get_default_active_thread_percentage\n").stdout
        assert out.split() == ["40", "40.0"]
        assert (tmp_path / "pipe" / "nvidia-cuda-mps-control.pid").read_text().strip() == str(daemon.pid)
        subprocess.run([str(binary)], env=env, input="quit\n", text=True, timeout=30, check=True)
        assert daemon.wait(20) == 0
        assert not (tmp_path / "pipe" / "control").exists()
    finally:
        if daemon.poll() is None:
            daemon.kill()


def test_two_shares_of_one_claim_on_one_gpu_are_added_up(h100, tmp_path):
    from driver.state.checkpoint import PreparedDevice
    from driver.prepare.sharing import DeviceSharing, use_of

    _, gpus = h100
    gpu = gpus[0]
    sharing = DeviceSharing(states=None, control=None, mps=None, boot_id="b",
                            inventory=lambda: mock_inventory(gpus))
    mine = [use_of("ns/c", PreparedDevice(r, "n", gpu.name, (), share_id=f"s-{r}",
                                          consumed={"memory": "50Gi", "compute": "50"}), gpu)
            for r in ("a", "b")]
    with pytest.raises(ClaimError, match="overcommits"):
        sharing.plan("ns/c", "uid", mine, [])
    mine[1] = use_of("ns/c", PreparedDevice("b", "n", gpu.name, (), share_id="s-b",
                                            consumed={"memory": "20Gi", "compute": "50"}), gpu)
    assert sharing.plan("ns/c", "uid", mine, []) == {gpu.name: setups.Setup("MPS")}


def test_memory_only_shares_pack_beside_a_compute_share(h100):
    """A share that asks only for memory reserved the whole compute (default 100) and
    nothing fitted beside it. Now it reserves none: three 20Gi shares and a 30% share all
    land on one GPU, and the memory-only ones get no compute cap."""
    from driver.devices.model import Inventory
    from driver.scheduling.allocator import Shares, allocate

    _, gpus = h100
    gpu = gpus[0]
    shared = Shares({gpu.name: slices.consumable_capacity(gpu)})
    gpu_class = {"gpu": ["true"]}

    def claim(requests: dict) -> dict:
        return {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu", "capacity": {"requests": requests}}}]}}

    inventory = Inventory((gpu,))
    for requests in ({"memory": "20Gi"}, {"memory": "20Gi"}, {"memory": "20Gi"},
                     {"memory": "10Gi", "compute": "30"}):
        (choice,) = allocate(claim(requests), inventory, gpu_class, "accel.dra.io", shares=shared)
        assert [d.name for d in choice.devices] == [gpu.name]
    assert shared.used[gpu.name] == {"memory": 70 * GIB, "compute": 30}
    memory_only = shares.limits("ns/c", gpu, {"memory": "20Gi", "compute": "0"})
    assert not memory_only.whole(gpu)
    env = dict(e.split("=", 1) for e in shares.env("DRA_GPU", memory_only))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env, "no SMs reserved, none capped"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    # A claim that asks for nothing still takes the GPU whole (all its memory).
    everything = shares.limits("ns/c", gpu, {"memory": "79Gi", "compute": "0"})
    assert everything.whole(gpu)


# -- MPS for several users (issue 38, item 6) ----------------------------------------------
def test_multi_user_is_an_mps_option_that_the_setup_carries(h100, mig):
    _, gpus = h100
    config = opaque.decode(gpu_config({"strategy": "MPS", "mpsConfig": {"multiUser": True}}))
    assert config.sharing.mpsConfig == opaque.MpsConfig(multiUser=True)
    assert opaque.from_dict(opaque.to_dict(config)) == config, "the checkpoint keeps it"
    multi = setups.for_device("ns/c", gpus[0], config, None)
    assert multi == setups.Setup("MPS", multi_user=True) and "multiUser=true" in multi.describe()
    assert setups.for_device("ns/c", mig, config, None).multi_user, "a MIG device of a Volta+ GPU"
    assert setups.Setup.from_dict({"strategy": "MPS"}) == setups.Setup("MPS"), \
        "a device record of an older version reads as single-user"
    with pytest.raises(opaque.ConfigDecodeError, match="mpsConfig.multiUser must be true or false, got 'yes'"):
        opaque.decode(gpu_config({"strategy": "MPS", "mpsConfig": {"multiUser": "yes"}}))
    # One daemon per GPU runs with -M or without: claims on it must agree.
    with pytest.raises(ClaimError, match="ns/new.*multiUser=true.*ns/old"):
        setups.check_compatible("ns/new", gpus[0], multi, [("ns/old", setups.Setup("MPS"))])


def test_multi_user_needs_a_volta_or_newer_gpu(h100):
    """NVIDIA documents Volta as the minimum; an older GPU's daemon takes -M but its non-root
    clients then fail in cuInit, so prepare refuses the claim, naming it and the GPU."""
    import dataclasses

    from driver.devices.model import Version

    _, gpus = h100
    config = opaque.decode(gpu_config({"strategy": "MPS", "mpsConfig": {"multiUser": True}}))
    pascal = dataclasses.replace(gpus[0], attributes={**gpus[0].attributes,
                                                       "cudaComputeCapability": Version("6.0.0")})
    with pytest.raises(ClaimError) as err:
        setups.for_device("ns/c", pascal, config, None)
    assert str(err.value) == (f"claim ns/c: mpsConfig.multiUser needs a Volta or newer GPU "
                              f"(compute capability 7.0); {pascal.name} has 6.0")
    volta = dataclasses.replace(pascal, attributes={**pascal.attributes,
                                                    "cudaComputeCapability": Version("7.0.0")})
    assert setups.for_device("ns/c", volta, config, None).multi_user
    unknown = dataclasses.replace(pascal, attributes={k: v for k, v in pascal.attributes.items()
                                                      if k != "cudaComputeCapability"})
    with pytest.raises(ClaimError, match="compute capability of .* is not known"):
        setups.for_device("ns/c", unknown, config, None)
    # Without multiUser, MPS on such a GPU stays as it was.
    assert setups.for_device("ns/c", pascal, opaque.decode(gpu_config({"strategy": "MPS"})), None) \
        == setups.Setup("MPS")
