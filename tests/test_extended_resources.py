"""Extended resources served by the driver (KEP-5004): the claim the scheduler makes for a
pod that asks for `nvidia.com/gpu: 2` is prepared like any other, and a node that still
advertises the name through a device plugin is reported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from driver.publish import extendedresources
from driver.cli import parser
from driver.service.config import ConfigError, build
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import Claim
from tests.driverproc import DRIVER, DriverDirs, DriverProcess
from tests.test_device_metadata import ROOT, metadata_mounts
from tests.test_plugin_integration import GPU, GPU2, opaque, result

ANNOTATION = "resource.kubernetes.io/extended-resource-claim"


def scheduler_claim(api, pod: str, results: list[dict], config: list[dict]) -> Claim:
    """The claim kube-scheduler creates for a pod's extended resources (1.37: generateName
    `<pod>-extended-resources-`, owned by the pod, the annotation, one request per container
    and resource named `container-<i>-request-<j>`, no config of its own: the allocation
    carries the class's config)."""
    uid = str(uuid.uuid4())
    name = f"{pod}-extended-resources-{uuid.uuid4().hex[:5]}"
    requests = sorted({r["request"] for r in results})
    api.put_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": uid,
                     "annotations": {ANNOTATION: "true"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod,
                                          "uid": str(uuid.uuid4()), "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": {"devices": {"requests": [{"name": r, "exactly": {
            "deviceClassName": f"gpu.{DRIVER}", "allocationMode": "ExactCount",
            "count": sum(1 for x in results if x["request"] == r)}} for r in requests]}},
        "status": {"allocation": {"devices": {"results": results, "config": config}},
                   "reservedFor": [{"resource": "pods", "name": pod, "uid": "u"}]},
    })
    return Claim("default", name, uid)


@pytest.fixture
def env():
    dirs = DriverDirs.make()
    with ApiServer() as api:
        node = api.add_node("node-a")
        node["status"] = {"allocatable": {"cpu": "8", "nvidia.com/gpu": "2",
                                          "example.com/fpga": "0"}}
        driver = DriverProcess(api, dirs, extra=[
            "--extended-resource-names", "nvidia.com/gpu,example.com/fpga,accel.dra.io/nic"]).start()
        kubelet = driver.kubelet()
        yield api, driver, kubelet, dirs
        kubelet.close()
        driver.kill()
    dirs.cleanup()


def test_the_schedulers_claim_is_prepared_per_request_with_the_class_config(env):
    api, _, kubelet, dirs = env
    class_config = opaque([], {"apiVersion": "accel.dra.io/v1alpha1", "kind": "GpuConfig",
                               "env": {"FROM_CLASS": "yes"}}, source="FromClass")
    claim = scheduler_claim(api, "trainer-7d9f", [result("container-0-request-0", GPU),
                                                  result("container-0-request-0", GPU2)],
                            [class_config])
    reply = kubelet.prepare([claim]).claims[claim.uid]
    assert reply.error == ""
    assert sorted(d.device_name for d in reply.devices) == [GPU, GPU2]
    assert {d.request_names[0] for d in reply.devices} == {"container-0-request-0"}
    assert all(len(d.cdi_device_ids) == 1 for d in reply.devices)
    spec = json.loads((dirs.cdi / f"{DRIVER}-claim_{claim.uid}.json").read_text())
    for device in spec["devices"]:
        assert "FROM_CLASS=yes" in device["containerEdits"]["env"]
    # No template and no pod-claim-name: the metadata file is named after the claim itself.
    assert set(metadata_mounts(dirs, claim)) == {
        f"{ROOT}/resourceclaims/{claim.name}/container-0-request-0/{DRIVER}-metadata.json"}
    status = subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "mixed",
                             "--node-name", "node-a", "--state-dir", str(dirs.state), "-o", "json"],
                            capture_output=True, text=True, timeout=120)
    rows = {r["device"]: r for r in json.loads(status.stdout)}
    assert rows[GPU]["claim"] == f"default/{claim.name}" and rows[GPU]["pods"] == ["trainer-7d9f"]
    assert kubelet.unprepare([claim]).claims[claim.uid].error == ""


def test_a_name_the_node_also_advertises_is_reported_at_start_and_by_status(env):
    _, driver, _, dirs = env
    deadline = time.monotonic() + 30
    while "extended_resource_served_twice" not in driver.log():
        assert time.monotonic() < deadline, driver.log()[-2000:]
        time.sleep(0.05)
    (line,) = [json.loads(x) for x in driver.log().splitlines() if "extended_resource_served_twice" in x]
    assert (line["resource"], line["allocatable"]) == ("nvidia.com/gpu", "2")
    status = subprocess.run([sys.executable, "-m", "driver", "status", "--mock", "mixed",
                             "--node-name", "node-a", "--state-dir", str(dirs.state)],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0
    assert "node node-a also advertises nvidia.com/gpu (allocatable 2)" in status.stderr
    assert "example.com/fpga" not in status.stderr, "zero is not advertising"


def test_served_twice_reads_allocatable():
    node = {"status": {"allocatable": {"nvidia.com/gpu": "8", "amd.com/gpu": "0"}}}
    found = extendedresources.served_twice(node, ["amd.com/gpu", "nvidia.com/gpu", "x.io/y"])
    assert found == [extendedresources.ServedTwice("nvidia.com/gpu", "8")]
    assert extendedresources.served_twice({}, ["nvidia.com/gpu"]) == []


@pytest.mark.parametrize("value", ["gpu", "kubernetes.io/gpu", "nvidia.com/", "a b/c"])
def test_a_bad_extended_resource_name_is_a_configuration_error(value):
    with pytest.raises(ConfigError, match="extended resource name"):
        build(parser().parse_args(["run", "--node-name", "n", "--extended-resource-names", value]), {})


# -- the chart -------------------------------------------------------------------------------

def test_the_chart_sets_the_name_on_the_class_and_tells_the_driver():
    import kubernetes_validate

    from tests.test_chart import by_kind, container, render

    objects = render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1", "extendedResourceNames": {
        "gpu": "nvidia.com/gpu", "fpga": "example.com/fpga"}}})
    classes = {c["metadata"]["name"]: c for c in by_kind(objects, "DeviceClass")}
    assert classes[f"gpu.{DRIVER}"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes[f"mig.{DRIVER}"]["spec"]
    for version in ("1.35.0", "1.37.0"):
        kubernetes_validate.validate(classes[f"gpu.{DRIVER}"], version, strict=True)
    assert container(objects)[2]["EXTENDED_RESOURCE_NAMES"] == "example.com/fpga,nvidia.com/gpu"
    # Off by default: no field, no option.
    plain = render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}})
    assert all("extendedResourceName" not in c["spec"] for c in by_kind(plain, "DeviceClass"))
    assert "EXTENDED_RESOURCE_NAMES" not in container(plain)[2]


@pytest.mark.parametrize("values, fragment", [
    ({"apiVersion": "resource.k8s.io/v1", "extendedResourceNames": {"gpu": "nvidia.com/gpu",
                                                                   "mig": "nvidia.com/gpu"}},
     "nvidia.com/gpu is named by both the gpu and the mig class"),
    ({"apiVersion": "resource.k8s.io/v1beta1", "extendedResourceNames": {"gpu": "nvidia.com/gpu"}},
     "needs resource.k8s.io/v1 DeviceClasses"),
    ({"apiVersion": "resource.k8s.io/v1", "extendedResourceNames": {"gpu": "kubernetes.io/gpu"}},
     "extendedResourceNames/gpu"),
    ({"apiVersion": "resource.k8s.io/v1", "extendedResourceNames": {"tpu": "x.io/tpu"}},
     "tpu"),
])
def test_the_chart_refuses_what_would_not_work(values, fragment):
    import helm_python as helm

    from tests.test_chart import render

    with pytest.raises(helm.HelmError, match=fragment.replace(".", r"\.")):
        render({"deviceClasses": values})
