"""A workload written for the NVIDIA device plugin (`resources.limits: nvidia.com/gpu`) on the
real cluster, unchanged: kube-scheduler makes its claim from the DeviceClass that names the
resource (KEP-5004, GA in 1.37), the real kubelet prepares it through the driver, the
container sees the GPUs, and the claim goes with the pod. Without the name on the class the
same manifest stays pending with the scheduler's reason."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from tests.cluster.driverhost import DRIVER, HostDriver, explain, install

GPU_CLASS = f"gpu.{DRIVER}"
IMPLICIT = f"deviceclass.resource.kubernetes.io/{GPU_CLASS}"
CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"

# A Deployment as a device-plugin user writes it: no resourceClaims, only a limit (the API
# server defaults requests from it). The container keeps running: the resourceclaim
# controller deletes a generated claim as soon as its pod is done, so a pod that exits would
# take the claim with it before the test could look at it.
DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: cuda
spec:
  replicas: 1
  selector: {{matchLabels: {{app: cuda}}}}
  template:
    metadata:
      labels: {{app: cuda}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: app
          image: nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04
          command: ["sh", "-c", "env | grep ^DRA_GPU_ | sort; ls /dev | grep nvidia; echo done; exec sleep 3600"]
          resources:
            limits:
              {resource}: {count}
"""


def _values(name: str | None) -> dict:
    classes: dict = {"apiVersion": "resource.k8s.io/v1"}
    if name:
        classes["extendedResourceNames"] = {"gpu": name}
    return {"deviceClasses": classes, "mock": {"enabled": True}}


def _get(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _pods(cluster, ns: str) -> list[dict]:
    return _get(cluster, "pods", "-n", ns, "-l", "app=cuda")["items"]


def _claims(cluster, ns: str) -> list[dict]:
    return _get(cluster, "resourceclaims", "-n", ns)["items"]


def _wait(cluster, ns: str, done, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = done()
        if last:
            return last
        time.sleep(1)
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "json", check=False).stdout
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "wide", check=False).stdout
    raise AssertionError(f"{what} after {timeout}s in {ns}:\n{pods[-4000:]}\nevents:\n{events}")


def _logged(drv: HostDriver, event: str, claim: str, ns: str) -> bool:
    for line in drv.log().splitlines():
        if f'"{event}"' in line:
            e = json.loads(line)
            if e.get("claim_name") == claim and e.get("claim_namespace") == ns:
                return True
    return False


def _driver(cluster, objects, tmp_path) -> HostDriver:
    import local_cluster

    drv = HostDriver(cluster, objects, tmp_path, local_cluster.NODE, fresh_node=True,
                     extra_env={"MOCK_PROFILE": "mixed"}).start()  # two H100s
    drv.wait_ready()
    return drv


@pytest.mark.parametrize("resource,count,class_name", [
    ("nvidia.com/gpu", 1, "nvidia.com/gpu"),
    ("nvidia.com/gpu", 2, "nvidia.com/gpu"),
    # every class answers to its implicit name, with nothing set on it (from 1.35: 1.34's
    # scheduler and kubelet take the name for a native resource and the pod runs without a
    # device, which explain says there: tests/test_cluster_support.py)
    pytest.param(IMPLICIT, 1, None, marks=pytest.mark.release(
        35, "implicit deviceclass.resource.kubernetes.io/<class> names")),
])
@pytest.mark.release(34, "extended resources served by DRA (a device plugin's resource name on a DeviceClass)")
def test_a_device_plugin_workload_runs_unchanged(cluster, tmp_path, resource, count, class_name):
    objects = install(cluster, _values(class_name))
    spec = _get(cluster, "deviceclass", GPU_CLASS)["spec"]
    assert spec.get("extendedResourceName") == class_name, spec
    ns = f"ext-{count}-{uuid.uuid4().hex[:6]}"
    drv = _driver(cluster, objects, tmp_path)
    try:
        cluster.kubectl("create", "namespace", ns)
        manifest = tmp_path / "deployment.yaml"
        manifest.write_text(DEPLOYMENT.format(resource=resource, count=count))
        # explain's prediction first, from the live cluster: the claim the scheduler will make
        code, out = explain(cluster, "-f", str(manifest), "-n", ns)
        (predicted,) = out["claims"]
        assert code == 0 and predicted["fits"], predicted
        cluster.kubectl("apply", "-n", ns, "-f", str(manifest))

        def running() -> dict | None:
            pods = _pods(cluster, ns)
            if pods and pods[0].get("status", {}).get("phase") == "Running":
                logs = cluster.kubectl("logs", "-n", ns, pods[0]["metadata"]["name"], check=False).stdout
                if "done" in logs.split():
                    return pods[0] | {"logs": logs}
            return None

        pod = _wait(cluster, ns, running, 180, "the Deployment's pod is not running")
        logs = pod.pop("logs")
        # the devices in the container: one DRA_GPU_*_UUID per GPU and the device nodes
        # (the CDI spec the driver wrote, applied by containerd)
        uuids = {line.split("=", 1)[1] for line in logs.splitlines()
                 if re.match(r"^DRA_GPU_\w+_UUID=GPU-[0-9a-f-]+$", line)}
        assert len(uuids) == count, logs
        nodes = logs.split()
        assert "nvidiactl" in nodes and sum(bool(re.fullmatch(r"nvidia\d+", n)) for n in nodes) == count, logs

        # the scheduler's claim: named in the pod's status, annotated, owned (controller) by
        # the pod, one request per container and resource, allocated from our GPUs
        status = pod["status"].get("extendedResourceClaimStatus")
        assert status, pod["status"]
        assert status["requestMappings"] == [{"containerName": "app", "resourceName": resource,
                                              "requestName": "container-0-request-0"}], status
        claims = {c["metadata"]["name"]: c for c in _claims(cluster, ns)}
        claim = claims[status["resourceClaimName"]]
        assert claim["metadata"]["name"].startswith(pod["metadata"]["name"] + "-extended-resources-")
        assert claim["metadata"]["annotations"][CLAIM_ANNOTATION] == "true"
        (owner,) = claim["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner.get("controller")) == ("Pod", pod["metadata"]["uid"], True)
        (request,) = claim["spec"]["devices"]["requests"]
        assert request["name"] == "container-0-request-0"
        assert request["exactly"]["deviceClassName"] == GPU_CLASS and request["exactly"]["count"] == count
        assert "config" not in claim["spec"]["devices"]  # no claim-level config
        # explain said so: the same requests and container mappings as the scheduler's
        assert predicted["scheduled"]["requests"] == claim["spec"]["devices"]["requests"], predicted["scheduled"]
        assert predicted["scheduled"]["mappings"] == status["requestMappings"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == count and {r["driver"] for r in results} == {DRIVER}
        assert {r["request"] for r in results} == {"container-0-request-0"}
        claim_name = claim["metadata"]["name"]
        assert _logged(drv, "claim_prepared", claim_name, ns), drv.log()[-3000:]

        # scaled to zero: the pod goes and its claim goes with it (made and deleted by
        # Kubernetes, nothing of ours involved but NodeUnprepareResources)
        cluster.kubectl("scale", "deployment", "-n", ns, "cuda", "--replicas=0")
        _wait(cluster, ns, lambda: not _claims(cluster, ns) and not _pods(cluster, ns), 90,
              "the scheduler's claim outlived its pod")
        _wait(cluster, ns, lambda: _logged(drv, "claim_unprepared", claim_name, ns), 30,
              "the driver was not asked to unprepare the claim")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]


@pytest.mark.release(34, "extended resources served by DRA (a device plugin's resource name on a DeviceClass)")
def test_without_the_name_on_the_class_the_same_workload_stays_pending(cluster, tmp_path):
    # kubectl apply removes the field a previous apply of the chart set
    objects = install(cluster, _values(None))
    assert "extendedResourceName" not in _get(cluster, "deviceclass", GPU_CLASS)["spec"]
    ns = f"ext-none-{uuid.uuid4().hex[:6]}"
    drv = _driver(cluster, objects, tmp_path)
    try:
        cluster.kubectl("create", "namespace", ns)
        manifest = tmp_path / "deployment.yaml"
        manifest.write_text(DEPLOYMENT.format(resource="nvidia.com/gpu", count=1))
        code, out = explain(cluster, "-f", str(manifest), "-n", ns)
        (predicted,) = out["claims"]
        assert code == 1 and predicted["scheduled"]["requests"] == [], predicted
        assert all(n["why"].startswith("Insufficient nvidia.com/gpu") for n in predicted["nodes"]), predicted
        cluster.kubectl("apply", "-n", ns, "-f", str(manifest))

        def unschedulable() -> dict | None:
            for pod in _pods(cluster, ns):
                for c in pod.get("status", {}).get("conditions") or []:
                    if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
                        return c
            return None

        condition = _wait(cluster, ns, unschedulable, 90, "the pod is not reported unschedulable")
        # the node resources plugin's reason: nothing on the node offers the name
        assert "Insufficient nvidia.com/gpu" in condition["message"], condition
        (pod,) = _pods(cluster, ns)
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
        assert not _claims(cluster, ns) and "extendedResourceClaimStatus" not in pod["status"]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False)
        assert drv.stop() == 0, drv.log()[-3000:]
