"""The chart's ValidatingAdmissionPolicy for opaque configs and the driver's decoder give
the same verdict on the same configs: one table, fed to both. The policy's CEL runs on
cel-python with the Kubernetes quantity functions (driver/scheduling/cel/kubernetes.py), as the API server
would run it; the API server's own 10 KiB limit on parameters stands beside it."""

from __future__ import annotations

import json

import celpy
import kubernetes_validate
import pytest

from driver.prepare import opaque
from driver.scheduling import cel as k8s_cel
from tests.test_chart import by_kind, render

DRIVER = "accel.dra.io"
V = opaque.API_VERSION

GOOD = {
    "gpu env": {"apiVersion": V, "kind": "GpuConfig", "env": {"NCCL_DEBUG": "INFO", "_X1": ""}},
    "gpu empty": {"apiVersion": V, "kind": "GpuConfig"},
    "gpu time-slicing": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}},
    "gpu time-slicing default interval": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": {}}},
    "gpu mps": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "20Gi"}}},
    "gpu mps bytes as int": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": 1048576}}},
    "gpu mps 1Mi": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": "1Mi", "defaultActiveThreadPercentage": 100}}},
    "gpu mps multi-user": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "multiUser": True, "defaultActiveThreadPercentage": 50}}},
    "gpu mps multi-user off": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "multiUser": False}}},
    "gpu mps multi-user null": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
        "multiUser": None}}},
    "gpu sharing null": {"apiVersion": V, "kind": "GpuConfig", "sharing": None},
    "gpu mps with null time-slicing": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "timeSlicingConfig": None}},
    "fpga management": {"apiVersion": V, "kind": "FpgaConfig", "managementAccess": True},
    "fpga function": {"apiVersion": V, "kind": "FpgaConfig", "function": "bcb4e605-a501-55d4-a198-ec86ce02d0cd"},
    "fpga function and digest": {"apiVersion": V, "kind": "FpgaConfig", "function": "BCB4E605A50155D4A198EC86CE02D0CD",
                                 "digest": "sha256:" + "ab" * 32},
    "nic moved": {"apiVersion": V, "kind": "NicConfig", "moveInterface": True, "interfaceName": "net1",
                  "rdma": False},
    "nic null name": {"apiVersion": V, "kind": "NicConfig", "interfaceName": None},
    "env of 64": {"apiVersion": V, "kind": "GpuConfig", "env": {f"V{i}": "x" for i in range(64)}},
}
BAD = {
    "not an object": ["GpuConfig"],
    "fpga function not a uuid": {"apiVersion": V, "kind": "FpgaConfig", "function": "vadd"},
    "fpga digest without function": {"apiVersion": V, "kind": "FpgaConfig", "digest": "sha256:" + "ab" * 32},
    "fpga digest not sha256": {"apiVersion": V, "kind": "FpgaConfig", "function": "bcb4e605-a501-55d4-a198-ec86ce02d0cd",
                               "digest": "md5:abc"},
    "wrong apiVersion": {"apiVersion": "accel.dra.io/v1", "kind": "GpuConfig"},
    "no apiVersion": {"kind": "GpuConfig"},
    "unknown kind": {"apiVersion": V, "kind": "TpuConfig"},
    "no kind": {"apiVersion": V},
    "unknown field": {"apiVersion": V, "kind": "GpuConfig", "envs": {}},
    "field of another kind": {"apiVersion": V, "kind": "GpuConfig", "moveInterface": True},
    "env not a map": {"apiVersion": V, "kind": "GpuConfig", "env": ["A=1"]},
    "env null": {"apiVersion": V, "kind": "GpuConfig", "env": None},
    "env bad name": {"apiVersion": V, "kind": "GpuConfig", "env": {"1ABC": "x"}},
    "env dash": {"apiVersion": V, "kind": "GpuConfig", "env": {"A-B": "x"}},
    "env DRA_": {"apiVersion": V, "kind": "GpuConfig", "env": {"DRA_GPU_UUID": "x"}},
    # Issue 38: a claim's env comes after the driver's and would undo NVIDIA_VISIBLE_DEVICES=void
    # (every GPU of the node under NVIDIA's runtime) or an MPS share's limits.
    "env NVIDIA_VISIBLE_DEVICES": {"apiVersion": V, "kind": "GpuConfig", "env": {"NVIDIA_VISIBLE_DEVICES": "all"}},
    "env NVIDIA_VISIBLE_DEVICES on a NIC": {"apiVersion": V, "kind": "NicConfig",
                                            "env": {"NVIDIA_VISIBLE_DEVICES": "all"}},
    "env CUDA_MPS_": {"apiVersion": V, "kind": "GpuConfig", "env": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=80G"}},
    "env value not a string": {"apiVersion": V, "kind": "GpuConfig", "env": {"N": 1}},
    "env of 65": {"apiVersion": V, "kind": "GpuConfig", "env": {f"V{i}": "x" for i in range(65)}},
    "bool as string": {"apiVersion": V, "kind": "NicConfig", "moveInterface": "true"},
    "bool as int": {"apiVersion": V, "kind": "FpgaConfig", "managementAccess": 1},
    "rdma null": {"apiVersion": V, "kind": "NicConfig", "rdma": None},
    "interface too long": {"apiVersion": V, "kind": "NicConfig", "interfaceName": "a" * 16},
    "interface slash": {"apiVersion": V, "kind": "NicConfig", "interfaceName": "net/1"},
    "interface empty": {"apiVersion": V, "kind": "NicConfig", "interfaceName": ""},
    "interface number": {"apiVersion": V, "kind": "NicConfig", "interfaceName": 1},
    "sharing not an object": {"apiVersion": V, "kind": "GpuConfig", "sharing": "MPS"},
    "no strategy": {"apiVersion": V, "kind": "GpuConfig", "sharing": {}},
    "null strategy": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": None}},
    "unknown strategy": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "vGPU"}},
    "unknown sharing field": {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mig": {}}},
    "time-slicing with MPS": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "timeSlicingConfig": {"interval": "Short"}}},
    "bad interval": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "5ms"}}},
    "time-slicing unknown field": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": {"slice": "Short"}}},
    "time-slicing not an object": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": "Short"}},
    "mps with time-slicing strategy": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "mpsConfig": {}}},
    "mps unknown field": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"threads": 50}}},
    "multi-user as string": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"multiUser": "true"}}},
    "multi-user as int": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"multiUser": 1}}},
    "percentage 0": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}},
    "percentage 101": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}},
    "percentage as string": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}},
    "percentage as float": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50.5}}},
    "percentage as bool": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}},
    "limit not a quantity": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "20 GB"}}},
    "limit below 1Mi": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}},
    "limit int below 1Mi": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 1024}}},
    "limit as bool": {"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": True}}},
    "over 10 KiB": {"apiVersion": V, "kind": "GpuConfig", "env": {"BIG": "x" * 11000}},
}


def decoder_accepts(parameters) -> bool:
    try:
        opaque.decode(parameters)
    except opaque.ConfigDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def policy() -> dict:
    policies = [p for p in by_kind(render(), "ValidatingAdmissionPolicy")
                if p["metadata"]["name"].endswith("-opaque-config")]
    (found,) = policies
    return found


def admitted(policy: dict, obj: dict, old: dict | None = None) -> tuple[bool, str]:
    """The policy's verdict on one object (an UPDATE from `old` when given), as the API
    server evaluates it: the match conditions (all true, or the policy does not apply),
    the variables in order, then every validation; a false one or a runtime error
    (failurePolicy Fail) denies. The server's own validation of parameters (≤ 10 KiB)
    comes first."""
    for config in _configs(obj):
        if len(json.dumps(config.get("opaque", {}).get("parameters"), separators=(",", ":"))) > 10 * 1024:
            return False, "parameters over 10 KiB (API server validation)"
    env = celpy.Environment()
    variables: dict = {}
    activation = {"object": celpy.json_to_cel(obj),
                  "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel({"operation": "UPDATE" if old else "CREATE"})}

    def run(expression: str):
        program = env.program(env.compile(expression), functions=k8s_cel.FUNCTIONS)
        result = program.evaluate({**activation, "variables": celpy.celtypes.MapType(variables)})
        if isinstance(result, celpy.CELEvalError):
            raise result
        return result

    spec = policy["spec"]
    try:
        for condition in spec.get("matchConditions") or []:
            result = run(condition["expression"])
            if not isinstance(result, celpy.celtypes.BoolType):
                return False, f"match condition {condition['name']}: not a bool"
            if not bool(result):
                return True, "not matched"
        for variable in spec["variables"]:
            variables[celpy.celtypes.StringType(variable["name"])] = run(variable["expression"])
        for validation in spec["validations"]:
            result = run(validation["expression"])
            if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                return False, validation["message"]
    except celpy.CELEvalError as err:
        return False, f"runtime error: {err}"
    return True, ""


def _configs(obj: dict) -> list[dict]:
    spec = obj["spec"]
    if obj["kind"] == "DeviceClass":
        return spec.get("config") or []
    if obj["kind"] == "ResourceClaimTemplate":
        spec = spec["spec"]
    return spec.get("devices", {}).get("config") or []


def wrap(kind: str, parameters, driver: str = DRIVER) -> dict:
    config = [{"opaque": {"driver": driver, "parameters": parameters}}]
    request = {"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}
    if kind == "DeviceClass":
        return {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "c"},
                "spec": {"selectors": [], "config": config}}
    devices = {"requests": [request], "config": [{"requests": ["gpu"], **config[0]}]}
    if kind == "ResourceClaimTemplate":
        return {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "t", "namespace": "d"},
                "spec": {"spec": {"devices": devices}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "r", "namespace": "d"},
            "spec": {"devices": devices}}


KINDS = ("ResourceClaim", "ResourceClaimTemplate", "DeviceClass")
CASES = [(name, p, True) for name, p in GOOD.items()] + [(name, p, False) for name, p in BAD.items()]


@pytest.mark.parametrize("name, parameters, good", CASES, ids=[c[0] for c in CASES])
def test_the_policy_and_the_decoder_agree(policy, name, parameters, good):
    assert decoder_accepts(parameters) is good, "the table's own verdict"
    for kind in KINDS:
        verdict, why = admitted(policy, wrap(kind, parameters))
        assert verdict is good, (kind, why)
        if not good:
            assert why.startswith("opaque config for accel.dra.io") or "10 KiB" in why, why


def test_other_drivers_configs_and_claims_without_config_are_admitted(policy):
    for kind in KINDS:
        assert admitted(policy, wrap(kind, {"anything": ["goes"]}, driver="gpu.example.com"))[0]
        bare = wrap(kind, {})
        if kind == "DeviceClass":
            del bare["spec"]["config"]
        elif kind == "ResourceClaimTemplate":
            del bare["spec"]["spec"]["devices"]["config"]
        else:
            del bare["spec"]["devices"]["config"]
        assert admitted(policy, bare)[0], kind


def test_the_examples_pass_the_policy(policy):
    import yaml

    from tests.conftest import REPO

    for path in sorted((REPO / "examples").glob("*/claim.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in KINDS:
                assert admitted(policy, doc) == (True, ""), path


def test_the_policy_renders_and_validates_strictly(policy):
    (binding,) = [b for b in by_kind(render(), "ValidatingAdmissionPolicyBinding")
                  if b["spec"]["policyName"] == policy["metadata"]["name"]]
    for version in ("1.32.0", "1.34.0", "1.37.0"):
        kubernetes_validate.validate(policy, version, strict=True)
        kubernetes_validate.validate(binding, version, strict=True)
    names = [p["metadata"]["name"] for p in
             by_kind(render({"configPolicy": {"enabled": False}}), "ValidatingAdmissionPolicy")]
    assert names and not any(n.endswith("-opaque-config") for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_that_leaves_the_configs_alone_is_admitted(policy, kind):
    """A claim with a config the policy would refuse today (made before the policy, or
    before a tighter version of it) must still take the finalizer and status updates of
    the scheduler and the garbage collector, or it can never be deleted."""
    old = wrap(kind, BAD["unknown field"])
    new = json.loads(json.dumps(old))
    new["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    if kind == "ResourceClaim":
        new["status"] = {"allocation": {"devices": {"results": []}}}
    assert admitted(policy, new, old) == (True, "not matched")
    assert admitted(policy, new)[0] is False, "the same object is still refused at CREATE"


def test_an_update_that_changes_a_device_class_config_is_judged(policy):
    old = wrap("DeviceClass", GOOD["gpu mps"])
    verdict, why = admitted(policy, wrap("DeviceClass", BAD["percentage 101"]), old)
    assert verdict is False and why.startswith("opaque config for accel.dra.io"), why
    assert admitted(policy, wrap("DeviceClass", GOOD["gpu env"]), old) == (True, "")
