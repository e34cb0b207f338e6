"""`explain -f pod.yaml` for pods that ask for extended resources (KEP-5004): the claim the
scheduler makes, checked against the cases of upstream's own unit tests
(Test_createRequestsAndMappings_* in kube-scheduler's dynamicresources plugin, v1.37.2),
and what explain says on nodes with and without a device plugin. The cluster tier compares
the same prediction with the claim the real scheduler makes
(tests/cluster/test_extended_resources.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

from driver.explain import extended
from driver.explain import world as w

EXT = "example.com/gpu"  # upstream's tests use one explicit name and two siblings of it
CLASSES = {EXT: "class", EXT + "1": "class1", EXT + "init": "classInit"}


def container(name: str, requests: dict[str, int], kind: str = "app") -> dict:
    c = {"name": name, "image": "x", "resources": {"requests": {k: str(v) for k, v in requests.items()}}}
    if kind == "sidecar":
        c["restartPolicy"] = "Always"
    return c


def pod(*containers: tuple[str, dict[str, int], str]) -> extended.PodResources:
    spec: dict = {"containers": [], "initContainers": []}
    for name, requests, kind in containers:
        spec["initContainers" if kind in ("init", "sidecar") else "containers"].append(
            container(name, requests, kind))
    (found,) = extended.pods_in([{"kind": "Pod", "metadata": {"name": "p"}, "spec": spec}], "test", "default")
    return found


def claim(p: extended.PodResources, classes: dict[str, str]) -> extended.ScheduledClaim:
    return extended.scheduled_claim(p, {r: c for r, c in classes.items() if r in p.names()})


def requests(c: extended.ScheduledClaim) -> list[tuple[str, str, int]]:
    return [(r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in c.requests]


POD1 = [("con0", {EXT: 1, EXT + "1": 2}, "app")]
POD2 = [("con0", {EXT: 1}, "app"), ("con1", {EXT + "1": 2}, "app")]
POD_INIT = [("con0", {EXT: 1}, "app"), ("init-con0", {EXT + "init": 2}, "init")]
POD_INIT2 = [("con0", {EXT: 1}, "app"), ("init-con0", {EXT + "init": 1}, "init"),
             ("init-con1", {EXT + "init": 2}, "init")]
POD_INIT3 = [("con0", {EXT: 1}, "app"), ("init-con0", {EXT + "init": 1}, "init"),
             ("sidecar-con1", {EXT + "init": 1}, "sidecar"), ("init-con2", {EXT + "init": 2}, "init")]


@pytest.mark.parametrize("containers,classes,want", [
    # upstream's cases, same names and counts
    (POD1, {EXT: "class"}, [("container-0-request-0", "class", 1)]),
    (POD1, {EXT: "class", EXT + "1": "class1"},
     [("container-0-request-0", "class", 1), ("container-0-request-1", "class1", 2)]),
    (POD2, {EXT: "class", EXT + "1": "class1"},
     [("container-0-request-0", "class", 1), ("container-1-request-0", "class1", 2)]),
    (POD_INIT, {EXT: "class", EXT + "init": "classInit"},
     [("container-0-request-0", "classInit", 2), ("container-1-request-0", "class", 1)]),
    # two init containers: only the larger request stays
    (POD_INIT2, {EXT: "class", EXT + "init": "classInit"},
     [("container-1-request-0", "classInit", 2), ("container-2-request-0", "class", 1)]),
    # the sidecar's device serves the first init container; the second needs its own two
    (POD_INIT3, {EXT: "class", EXT + "init": "classInit"},
     [("container-1-request-0", "classInit", 1), ("container-2-request-0", "classInit", 2),
      ("container-3-request-0", "class", 1)]),
], ids=["one-match", "two-match", "two-containers", "init", "two-inits", "init-sidecar-init"])
def test_the_requests_are_upstreams(containers, classes, want):
    assert requests(claim(pod(*containers), classes)) == want


def test_mappings_name_every_container_that_uses_a_request():
    c = claim(pod(*POD_INIT3), CLASSES)
    got = sorted((m["requestName"], m["containerName"], m["resourceName"]) for m in c.mappings)
    assert got == [("container-1-request-0", "init-con0", EXT + "init"),
                   ("container-1-request-0", "sidecar-con1", EXT + "init"),
                   ("container-2-request-0", "init-con2", EXT + "init"),
                   ("container-3-request-0", "con0", EXT)]
    c = claim(pod(*POD_INIT2), CLASSES)  # the smaller init request is mapped to the larger
    assert sorted((m["requestName"], m["containerName"]) for m in c.mappings) == [
        ("container-1-request-0", "init-con0"), ("container-1-request-0", "init-con1"),
        ("container-2-request-0", "con0")]


def test_an_init_container_larger_than_what_follows_asks_for_the_rest():
    p = pod(("app", {EXT: 1}, "app"), ("warm", {EXT: 3}, "init"))
    c = claim(p, {EXT: "class"})
    assert requests(c) == [("container-0-request-0", "class", 2), ("container-1-request-0", "class", 1)]
    assert sorted((m["containerName"], m["requestName"]) for m in c.mappings) == [
        ("app", "container-1-request-0"), ("warm", "container-0-request-0"), ("warm", "container-1-request-0")]


def test_the_request_index_counts_every_requested_resource_in_name_order():
    # cpu and memory sort around the GPU: its index among all the container's requests is 1
    p = pod(("app", {"cpu": 1, EXT: 2, "memory": 1}, "app"))
    assert requests(claim(p, {EXT: "class"})) == [("container-0-request-1", "class", 2)]


def test_limits_default_the_requests_and_must_equal_them():
    obj = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [
        {"name": "app", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}}}
    (p,) = extended.pods_in([obj], "f.yaml", "ns")
    assert (p.kind, p.ref, p.containers[0].requests) == ("Deployment", "ns/d", {"nvidia.com/gpu": 2})
    obj["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpu": 1}
    with pytest.raises(extended.ExtendedResourceError, match=r"Deployment d: container app: nvidia.com/gpu: "
                                                             r"request 1 and limit 2 differ"):
        extended.pods_in([obj], "f.yaml", "ns")
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "500m"}}
    with pytest.raises(extended.ExtendedResourceError, match="500m is not a whole number"):
        extended.pods_in([obj], "f.yaml", "ns")


def test_workload_kinds_and_pods_without_extended_resources():
    template = {"spec": {"containers": [{"name": "c", "resources": {"limits": {EXT: 1}}}]}}
    objs = [{"kind": "CronJob", "metadata": {"name": "cj"}, "spec": {"jobTemplate": {"spec": {"template": template}}}},
            {"kind": "StatefulSet", "metadata": {"name": "ss"}, "spec": {"template": template}},
            {"kind": "Pod", "metadata": {"name": "plain"},
             "spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": 1, "memory": "1Gi",
                                                                            "hugepages-2Mi": "2Mi"}}}]}},
            {"kind": "ConfigMap", "metadata": {"name": "cm"}}]
    assert [(p.kind, p.name) for p in extended.pods_in(objs, "f", "default")] == [("CronJob", "cj"), ("StatefulSet", "ss")]


@pytest.mark.parametrize("name,is_ext", [
    ("nvidia.com/gpu", True), ("deviceclass.resource.kubernetes.io/gpu.accel.dra.io", True),
    ("cpu", False), ("memory", False), ("hugepages-2Mi", False), ("kubernetes.io/foo", False),
    ("example.kubernetes.io/foo", False), ("requests.example.com/x", False), ("Example.com/x", False),
    ("example.com/-x", False),
])
def test_which_names_are_extended_resources(name, is_ext):
    assert extended.is_extended(name) is is_ext


def test_two_classes_naming_one_resource_the_newer_wins_then_the_lower_name():
    def cls(name, created):
        return w.DeviceClass(name, (), "nvidia.com/gpu", created)

    old, new = cls("a", "2026-01-01T00:00:00Z"), cls("b", "2026-02-01T00:00:00Z")
    mapping = extended.class_mapping({"a": old, "b": new})
    assert mapping["nvidia.com/gpu"] == "b"
    # each class keeps its implicit name, whatever the explicit one resolves to
    assert mapping["deviceclass.resource.kubernetes.io/a"] == "a"
    tie = extended.class_mapping({"z": cls("z", "2026-01-01T00:00:00Z"), "m": cls("m", "2026-01-01T00:00:00Z")})
    assert tie["nvidia.com/gpu"] == "m"


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: cuda}
spec:
  template:
    spec:
      containers:
        - name: app
          image: x
          resources: {limits: {nvidia.com/gpu: %d}}
"""
GPU_CLASS = """
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.accel.dra.io}
spec:
  selectors: [{cel: {expression: 'device.driver == "accel.dra.io" && device.attributes["accel.dra.io"].type == "gpu"'}}]
  extendedResourceName: nvidia.com/gpu
"""


def explain(tmp_path, text: str, *args: str) -> tuple[int, str, str]:
    import argparse
    import io

    from driver.explain import command

    path = tmp_path / "pod.yaml"
    path.write_text(textwrap.dedent(text))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = command.run(parser.parse_args(["-f", str(path), *args]), out, err)
    return code, out.getvalue(), err.getvalue()


def test_cli_a_device_plugin_manifest_on_a_mock_node(tmp_path):
    code, out, err = explain(tmp_path, DEPLOYMENT % 2 + GPU_CLASS, "--mock", "mixed", "-o", "json")
    assert code == 0, err
    (e,) = json.loads(out)["claims"]
    assert e["claim"] == "default/cuda-extended-resources" and e["fits"]
    assert e["scheduled"]["requests"] == [{"name": "container-0-request-0", "exactly": {
        "deviceClassName": "gpu.accel.dra.io", "allocationMode": "ExactCount", "count": 2}}]
    assert e["scheduled"]["mappings"] == [{"containerName": "app", "resourceName": "nvidia.com/gpu",
                                           "requestName": "container-0-request-0"}]
    (node,) = e["nodes"]
    assert len(node["allocation"]) == 2  # the mock node's two GPUs
    # three GPUs: the mixed node has two
    code, out, _ = explain(tmp_path, DEPLOYMENT % 3 + GPU_CLASS, "--mock", "mixed")
    assert code == 1 and "container-0-request-0: 3 x gpu.accel.dra.io for container app (nvidia.com/gpu)" in out


def test_cli_without_a_class_naming_it_the_node_lacks_it(tmp_path):
    # the chart's classes (from --mock) name no extended resource
    code, out, _ = explain(tmp_path, DEPLOYMENT % 1, "--mock", "mixed")
    assert code == 1
    assert "Insufficient nvidia.com/gpu" in out and "no DeviceClass serves it" in out
    assert "the scheduler makes no claim" in out


def test_cli_a_node_with_the_device_plugin_keeps_it_out_of_the_claim(tmp_path):
    node = """
    ---
    apiVersion: v1
    kind: Node
    metadata: {name: mock-node}
    status: {allocatable: {nvidia.com/gpu: "8", cpu: "16"}}
    """
    code, out, err = explain(tmp_path, DEPLOYMENT % 1 + GPU_CLASS + textwrap.dedent(node), "--mock", "mixed",
                             "-o", "json")
    assert code == 0, err
    (e,) = json.loads(out)["claims"]
    assert e["nodes"] == [{"node": "mock-node", "fits": True, "why": "", "allocation": [], "alternatives": [],
                           "constraints": [], "fits_when_free": True}]
    assert any("node mock-node: status.allocatable lists nvidia.com/gpu: 8: a device plugin" in n
               for n in e["notes"])


def test_cli_bad_input_is_one_line(tmp_path):
    bad = DEPLOYMENT.replace("{limits: {nvidia.com/gpu: %d}}", "{limits: {nvidia.com/gpu: 1.5}}")
    code, out, err = explain(tmp_path, bad, "--mock", "mixed")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Deployment cuda: container app: nvidia.com/gpu: 1.5 is not a whole number" in err
    code, _, err = explain(tmp_path, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "--mock", "mixed")
    assert code == 2 and "no ResourceClaim, ResourceClaimTemplate or pod asking for extended resources" in err


# KEP-5004's feature gate DRAExtendedResource, as upstream's feature list has it
# (k8s.io/kubernetes v1.37.2 test/compatibility_lifecycle/reference/versioned_feature_list.yaml):
# alpha (off by default) in 1.34, beta (on by default) in 1.36, GA (locked on) in 1.37.
KEP_5004_STAGES = "alpha 1.34, beta 1.36, GA 1.37"


def test_every_text_on_kep_5004_gives_its_stages_as_upstream_has_them():
    """Issue 38, 10(c): the stages were given as "beta in 1.34/1.35" (1.35 is still alpha)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = [repo / "README.md", *sorted((repo / "docs").glob("*.md")),
             *sorted(p for p in (repo / "driver").rglob("*.py")),
             *sorted(p for p in (repo / "charts").rglob("*") if p.is_file())]
    mention = re.compile(r"KEP-5004|DRAExtendedResource\b")
    stage = re.compile(r"\b(alpha|beta|GA|on by default)(?: in| from| since)? (1\.\d+)")
    expected = {"alpha": "1.34", "beta": "1.36", "GA": "1.37", "on by default": "1.36"}
    wrong, stated = [], []
    for path in files:
        text = path.read_text(errors="replace")
        for m in mention.finditer(text):
            near = text[max(0, m.start() - 200):m.end() + 200]
            claims = stage.findall(near)
            if claims or re.search(r"\b1\.3\d\+", near):
                stated.append(path)
                if KEP_5004_STAGES not in re.sub(r"\s+", " ", near):
                    wrong.append(f"{path.relative_to(repo)}: no {KEP_5004_STAGES!r} near: {near!r}")
            wrong += [f"{path.relative_to(repo)}: {s} {v}" for s, v in claims if expected.get(s) != v]
    assert stated and not wrong, "\n".join(wrong)
    assert KEP_5004_STAGES in extended.__doc__.replace("\n", " ")
