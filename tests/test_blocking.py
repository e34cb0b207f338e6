"""`dra-driver explain --blocking` (issue 41, item 2) on hand-made fragmented layouts: GPUs
scattered over claims, MIG-like partitions on shared counters, shares of GPUs, a free NIC
on another PCIe root than the free GPU; the set named is the smallest, names the pods, and
the nodes come by the size of their set; a request larger than any node says so; `--request`
and its errors; the search bound. The generated check against the real allocator is in
test_blocking_generated.py."""

from __future__ import annotations

import copy
import io
import json

import pytest
import yaml

from driver import cli
from driver.explain import blocking, engine, sources
from driver.explain import world as w

DRIVER = "accel.dra.io"


def run(*args: str) -> tuple[int, str, str]:
    from driver.explain import command

    out, err = io.StringIO(), io.StringIO()
    code = command.run(cli.parser().parse_args(["explain", *args]), out, err)
    return code, out.getvalue(), err.getvalue()


def held(name: str, node: str, devices: list[str], pods: list[str] = (), namespace: str = "team",
         shares: dict[str, str] | None = None) -> dict:
    """An allocated claim, as the API server shows one a pod uses."""
    results = []
    for index, device in enumerate(devices):
        result = {"request": "r", "driver": DRIVER, "pool": node, "device": device}
        if shares and device in shares:
            result["shareID"] = f"00000000-0000-0000-0000-{abs(hash((name, index))) % 10**12:012d}"
            result["consumedCapacity"] = {"memory": shares[device]}
        results.append(result)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}},
                       "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods]}}


def fleet(profile: str, nodes: list[str], sharing: str = "exclusive", mig: str = "static") -> list[dict]:
    """A mock profile's slices on each of these nodes (its pool named after the node), and its classes."""
    objects = sources.mock_objects(profile, DRIVER, sharing, mig)
    out = [o for o in objects if o["kind"] == "DeviceClass"]
    for node in nodes:
        for original in (o for o in objects if o["kind"] == "ResourceSlice"):
            copied = copy.deepcopy(original)
            copied["metadata"]["name"] = original["metadata"]["name"].replace(sources.MOCK_NODE, node)
            copied["spec"]["nodeName"] = node
            copied["spec"]["pool"]["name"] = node
            out.append(copied)
    return out


def devices_of(objects: list[dict], node: str, kind: str) -> list[str]:
    return [d["name"] for o in objects if o["kind"] == "ResourceSlice" and o["spec"].get("nodeName") == node
            for d in o["spec"].get("devices") or [] if d["attributes"]["type"]["string"] == kind]


def write(tmp_path, objects: list[dict], name: str = "cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objects))
    return path


@pytest.fixture(scope="module")
def scattered():
    """Three h100x8 nodes: on node-a one claim holds 3 GPUs and three hold one each (2
    free); on node-b eight claims hold one GPU each; node-c is free but for 6 GPUs of one
    claim. A claim on a NIC of node-a uses no GPU."""
    objects = fleet("h100x8", ["node-a", "node-b", "node-c"])
    a, b, c = (devices_of(objects, n, "gpu") for n in ("node-a", "node-b", "node-c"))
    objects += [held("train", "node-a", a[0:3], ["trainer-0"]), held("infer-1", "node-a", a[3:4], ["infer-1-abc"]),
                held("infer-2", "node-a", a[5:6], ["infer-2-abc"]), held("notebook", "node-a", a[7:8]),
                held("net", "node-a", devices_of(objects, "node-a", "nic")[:1], ["net-0"])]
    objects += [held(f"small-{i}", "node-b", [g], [f"small-{i}-0"]) for i, g in enumerate(b)]
    objects += [held("big", "node-c", c[:6], ["big-0", "big-1"])]
    return objects


def test_the_smallest_set_per_node_with_its_pods_nodes_by_set_size(tmp_path, scattered):
    code, out, err = run("--slices", str(write(tmp_path, scattered)), "--request", "gpu=4", "--blocking", "-o", "json")
    assert code == 1, err  # fits nowhere as it is
    (answer,) = json.loads(out)["blocking"]
    nodes = {n["node"]: n for n in answer["nodes"]}
    assert [n["node"] for n in answer["nodes"]] == ["node-a", "node-c", "node-b"]  # 1, 1, 2 claims
    # node-a: the claim of 3 GPUs frees enough with the 2 free; no single small claim does
    assert [h["claim"] for h in nodes["node-a"]["claims"]] == ["team/train"]
    assert nodes["node-a"]["claims"][0]["pods"] == ["team/trainer-0"]
    assert len(nodes["node-a"]["claims"][0]["devices"]) == 3
    assert nodes["node-a"]["smallest"] and nodes["node-a"]["size"] == 1
    assert nodes["node-a"]["candidates"] == 4  # the NIC's claim cannot matter to a GPU request
    assert len([a for a in nodes["node-a"]["allocation"] if a["request"] == "gpu"]) == 4
    assert [h["claim"] for h in nodes["node-c"]["claims"]] == ["team/big"]
    assert nodes["node-c"]["claims"][0]["pods"] == ["team/big-0", "team/big-1"]
    assert len(nodes["node-b"]["claims"]) == 4 and nodes["node-b"]["size"] == 4  # 4 of the 8 single-GPU claims
    assert "allocated to claim" in nodes["node-a"]["why"]


def test_table_names_what_to_remove_and_what_it_then_gets(tmp_path, scattered):
    code, out, _ = run("--slices", str(write(tmp_path, scattered)), "--request", "gpu=6", "--blocking",
                       "--node", "node-a")
    assert code == 1
    assert "Request --request gpu=6: fits on none of 1 node(s); removing claims lets it fit on 1 of them" in out
    assert "Node node-a: remove 2 claim(s) (the smallest set" in out
    assert "remove team/train " in out and "pods team/trainer-0" in out
    # the second claim: any single-GPU one would do; the one no pod uses is the least to drain
    assert "remove team/notebook  holds gpu-0000-81-00-0; no pod reserves it" in out
    (gets,) = [line for line in out.splitlines() if line.startswith("  then it gets: gpu: ")]
    assert gets.count("gpu-0000-") == 6


def test_every_gpu_wanted_needs_every_claim_and_one_more_than_a_node_has_needs_no_claim(tmp_path, scattered):
    path = str(write(tmp_path, scattered))
    code, out, _ = run("--slices", path, "--request", "gpu=8", "--blocking", "-o", "yaml")
    nodes = {n["node"]: n for n in yaml.safe_load(out)["blocking"][0]["nodes"]}
    assert nodes["node-a"]["size"] == 4 and nodes["node-b"]["size"] == 8 and nodes["node-c"]["size"] == 1
    code, out, _ = run("--slices", path, "--request", "gpu=9", "--blocking")
    assert code == 1
    assert "fits on none of 3 node(s), and no removal can help" in out
    assert out.count("no removal can help: request gpu: 8 of 8 fit, needs 9, even with nothing allocated") == 3
    assert "remove team/" not in out


def test_a_share_larger_than_any_gpu_names_the_largest_device(tmp_path):
    objects = fleet("h100x8", ["node-a"], sharing="consumable")
    gpus = devices_of(objects, "node-a", "gpu")
    objects += [held("share", "node-a", gpus[:1], ["p"], shares={gpus[0]: "40Gi"})]
    code, out, _ = run("--slices", str(write(tmp_path, objects)), "--request", "gpu=1,memory=90Gi", "--blocking")
    assert code == 1
    assert "no removal can help: request gpu: no device of the node can hold it even when free: memory 90Gi " \
           "wanted, the largest has" in out


def test_shares_of_gpus_the_claim_whose_share_frees_enough(tmp_path):
    """Two shareable GPUs of 80 GiB (l4 has one 23 GiB GPU: hand-made instead): on gpu-0 two
    shares of 40 and 30 GiB, on gpu-1 one of 50 GiB. 50 GiB fits after removing the 40 GiB
    share or the 50 GiB one, not after the 30 GiB one."""
    objects = [_slice("node-a", [_gpu("gpu-0", "pci0", shared=True), _gpu("gpu-1", "pci1", shared=True)])] + CLASSES
    objects += [held("a40", "node-a", ["gpu-0"], ["a"], shares={"gpu-0": "40Gi"}),
                held("b30", "node-a", ["gpu-0"], ["b"], shares={"gpu-0": "30Gi"}),
                held("c50", "node-a", ["gpu-1"], ["c"], shares={"gpu-1": "50Gi"})]
    answer = _blocking(objects, {"name": "g", "exactly": {"deviceClassName": "gpu", "count": 1,
                                                          "capacity": {"requests": {"memory": "50Gi"}}}})
    (node,) = answer.nodes
    assert node.size == 1 and node.claims[0].claim in ("team/a40", "team/c50") and node.smallest
    assert node.claims[0].devices[0].startswith("gpu-") and "(memory " in node.claims[0].devices[0]
    # 70 GiB: only the 50 GiB share's GPU (30 free) ... needs c50 out; or both shares of gpu-0
    answer = _blocking(objects, {"name": "g", "exactly": {"deviceClassName": "gpu", "count": 1,
                                                          "capacity": {"requests": {"memory": "70Gi"}}}})
    assert [h.claim for h in answer.nodes[0].claims] == ["team/c50"]


def test_mig_partitions_on_shared_counters_the_partitions_in_the_way(tmp_path):
    """A GPU of 8 memory and 7 compute slices, partitioned dynamically: 1g partitions on
    slots held by three claims, a 2g by a fourth. A 4g needs 4 of each: the claims whose
    partitions leave fewest slices must go."""
    counters = {"name": "gpu-0", "counters": {"memory": {"value": "8"}, "compute": {"value": "7"}}}
    parts = [_mig(f"gpu-0-1g-{i}", 1, 1) for i in range(7)] + [_mig("gpu-0-2g-0", 2, 2), _mig("gpu-0-4g-0", 4, 4)]
    objects = [_slice("node-a", parts, count=2), _slice("node-a", [], counters=[counters], count=2, index=1)] + CLASSES
    objects += [held("one-a", "node-a", ["gpu-0-1g-0"], ["a"]), held("one-b", "node-a", ["gpu-0-1g-1"], ["b"]),
                held("one-c", "node-a", ["gpu-0-1g-2"], ["c"]), held("two", "node-a", ["gpu-0-2g-0"], ["d"])]
    # used: memory 5 of 8, compute 5 of 7; a 4g needs 4 and 4: free 3 and 2 -> free at least
    # 1 memory and 2 compute: the 2g claim alone (2, 2), or two 1g claims (2, 2)
    answer = _blocking(objects, {"name": "m", "exactly": {"deviceClassName": "mig", "count": 1, "selectors": [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "4g"'}}]}})
    (node,) = answer.nodes
    assert [h.claim for h in node.claims] == ["team/two"] and node.smallest
    assert node.allocation[0]["device"] == "gpu-0-4g-0"
    assert "shared counter" in node.why


def test_a_free_nic_on_another_root_than_the_free_gpu(tmp_path):
    """gpu-0 (root pci0) is free but its NIC is held; nic-1 (pci1) is free but its GPU is
    held: either claim's removal aligns a pair; the one holding fewer devices is named."""
    objects = [_slice("node-a", [_gpu("gpu-0", "pci0"), _gpu("gpu-1", "pci1"), _nic("nic-0", "pci0"),
                                 _nic("nic-1", "pci1"), _gpu("gpu-2", "pci2")])] + CLASSES
    objects += [held("trainer", "node-a", ["gpu-1", "gpu-2"], ["trainer-0"]), held("router", "node-a", ["nic-0"], ["r"])]
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu", "count": 1}},
                                     {"name": "nic", "exactly": {"deviceClassName": "nic", "count": 1}}],
                        "constraints": [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]}}
    path = write(tmp_path, objects + [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                       "metadata": {"name": "pair", "namespace": "team"}, "spec": spec}], "pair.yaml")
    code, out, err = run("--slices", str(path), "pair", "-n", "team", "--blocking", "-o", "json")
    assert code == 1, err
    (node,) = json.loads(out)["blocking"][0]["nodes"]
    assert node["size"] == 1 and node["smallest"]
    assert node["claims"][0]["claim"] == "team/router"
    assert {a["device"] for a in node["allocation"]} == {"gpu-0", "nic-0"}
    assert "constraint not met: matchAttribute resource.kubernetes.io/pcieRoot" in node["why"]


def test_a_pods_claims_are_blocked_together(tmp_path, scattered):
    """A pod of two claims of 3 GPUs each: 6 GPUs on one node, so node-a's 2 free GPUs need
    two claims gone, as for one claim of 6."""
    pod = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: three, namespace: team}
spec: {spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.accel.dra.io, count: 3}}]}}}
---
apiVersion: v1
kind: Pod
metadata: {name: both, namespace: team}
spec:
  resourceClaims: [{name: a, resourceClaimTemplateName: three}, {name: b, resourceClaimTemplateName: three}]
  containers: [{name: c, image: x}]
"""
    (tmp_path / "pod.yaml").write_text(pod)
    code, out, err = run("--slices", str(write(tmp_path, scattered)), "-f", str(tmp_path / "pod.yaml"), "--blocking",
                         "--node", "node-a", "-o", "json")
    assert code == 1, err
    (answer,) = json.loads(out)["blocking"]
    assert answer["request"] == "Pod team/both"
    (node,) = answer["nodes"]
    assert node["size"] == 2 and "team/train" in [h["claim"] for h in node["claims"]]
    assert {a["claim"] for a in node["allocation"]} == {"team/both-a", "team/both-b"}


def test_the_claims_own_allocation_is_not_in_the_way(tmp_path, scattered):
    """An allocated claim explained with --blocking: its own devices are free for it."""
    objects = scattered + [held("mine", "node-c", devices_of(scattered, "node-c", "gpu")[6:8], ["me"])]
    objects[-1]["spec"] = {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.accel.dra.io", "count": 4}}]}}
    code, out, err = run("--slices", str(write(tmp_path, objects)), "mine", "-n", "team", "--blocking",
                         "--node", "node-c", "-o", "json")
    (node,) = json.loads(out)["blocking"][0]["nodes"]
    assert [h["claim"] for h in node["claims"]] == ["team/big"]


def test_a_request_that_fits_somewhere_says_so(tmp_path, scattered):
    code, out, _ = run("--slices", str(write(tmp_path, scattered)), "--request", "gpu=2", "--blocking")
    assert code == 0
    assert "fits already on 2 of 3 node(s): nothing blocks it" in out
    assert "Node node-a: fits as it is" in out


def test_the_search_bound_says_when_it_gave_up():
    """Three GPUs wanted on one PCIe root. pci0's four GPUs are held by two claims of two;
    on pci1 one claim holds one GPU of three. The greedy pass puts the light claim back
    first and keeps the two heavy ones; the search by size finds the light one alone.
    With no search allowed, the greedy set is given, marked as not proven smallest."""
    gpus = [_gpu(f"gpu-{i}", "pci0") for i in range(4)] + [_gpu(f"gpu-{i}", "pci1") for i in range(4, 7)]
    objects = [_slice("node-a", gpus)] + CLASSES
    objects += [held("a", "node-a", ["gpu-0", "gpu-1"]), held("b", "node-a", ["gpu-2", "gpu-3"]),
                held("light", "node-a", ["gpu-4"])]
    spec = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu", "count": 3}}],
                        "constraints": [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]}}
    world = w.build(objects)
    claim = engine.PodClaim("team/x", spec, "team")
    full = blocking.node_blocking([claim], "node-a", world)
    assert full.smallest and [h.claim for h in full.claims] == ["team/light"]
    bounded = blocking.node_blocking([claim], "node-a", world, limit=0)
    assert [h.claim for h in bounded.claims] == ["team/a", "team/b"] and not bounded.smallest
    assert bounded.searched == ("gave up after 0 sets: this set of 2 is minimal (no claim of it can stay), "
                                "a smaller one may exist")
    bounded = blocking.node_blocking([claim], "node-a", world, limit=1)  # the empty set only
    assert not bounded.smallest and "every set of up to 0 claim(s) tried" in bounded.searched


@pytest.mark.parametrize("spec, message", [
    ("gpux=1", "--request gpux=1: no DeviceClass 'gpux' (classes: fpga.accel.dra.io, gpu.accel.dra.io, "
               "mig.accel.dra.io, nic.accel.dra.io)"),
    ("gpu=two", "--request gpu=two: the count 'two' is not a whole number"),
    ("gpu=0", "--request gpu=0: the count must be 1 or more, not 0"),
    ("gpu=1,memroy=4Gi", "--request gpu=1,memroy=4Gi: no device of class gpu.accel.dra.io has a capacity or "
                         "attribute 'memroy' (they have: "),
    ("gpu=1,memory=lots", "--request gpu=1,memory=lots: capacity memory: "),
    ("gpu=1,memory", "--request gpu=1,memory: 'memory' is not NAME=VALUE"),
])
def test_a_bad_request_is_one_line(spec, message):
    for blocking_too in ((), ("--blocking",)):
        code, out, err = run("--mock", "h100x8", "--request", spec, *blocking_too)
        assert code == 2 and out == ""
        assert err.startswith(f"dra-driver explain: {message}") and err.count("\n") == 1


def test_request_with_a_claim_is_a_usage_error():
    code, _, err = run("--mock", "h100x8", "--request", "gpu=1", "-f", "x.yaml")
    assert code == 2 and "--request gives the request: name no claim (CLAIM) and no -f FILE with it" in err


def test_request_syntax_capacity_and_attribute():
    from driver.explain import blocking_request

    world = w.build(sources.mock_objects("a100-mig", DRIVER, "consumable", "static"))
    spec = blocking_request.claim_spec(["gpu=2,memory=10Gi", "mig=1,profile=3g.20gb", "gpu"], world)
    gpu, mig, again = spec["devices"]["requests"]
    assert gpu == {"name": "gpu", "exactly": {"deviceClassName": "gpu.accel.dra.io", "allocationMode": "ExactCount",
                                              "count": 2, "capacity": {"requests": {"memory": "10Gi"}}}}
    assert mig["exactly"]["selectors"] == [{"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "3g.20gb"'}}]
    assert again["name"] == "gpu-2" and again["exactly"]["count"] == 1
    # plain explain takes --request too
    code, out, _ = run("--mock", "a100-mig", "--request", "mig=1,profile=3g.20gb")
    assert code == 0 and "Claim default/request (ResourceClaim from --request): fits on 1 of 1 node(s)" in out


# -- hand-made slices -------------------------------------------------------------------------------------
CLASSES = [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].type == "{name}"'}}]}}
           for name in ("gpu", "mig", "nic")]


def _attrs(kind: str, root: str, **more) -> dict:
    return {"type": {"string": kind}, "resource.kubernetes.io/pcieRoot": {"string": root},
            **{k: {"string": v} for k, v in more.items()}}


def _gpu(name: str, root: str, shared: bool = False) -> dict:
    device: dict = {"name": name, "attributes": _attrs("gpu", root)}
    if shared:
        device["allowMultipleAllocations"] = True
        device["capacity"] = {"memory": {"value": "80Gi", "requestPolicy": {
            "default": "10Gi", "validRange": {"min": "10Gi", "step": "10Gi"}}}}
    return device


def _nic(name: str, root: str) -> dict:
    return {"name": name, "attributes": _attrs("nic", root)}


def _mig(name: str, memory: int, compute: int) -> dict:
    return {"name": name, "attributes": _attrs("mig", "pci0", profile=name.split("-")[2]),
            "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": str(memory)},
                                                                       "compute": {"value": str(compute)}}}]}


def _slice(node: str, devices: list[dict], counters: list[dict] | None = None, count: int = 1, index: int = 0) -> dict:
    spec: dict = {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": count}}
    if devices:
        spec["devices"] = devices
    if counters:
        spec["sharedCounters"] = counters
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{index}"},
            "spec": spec}


def _blocking(objects: list[dict], request: dict) -> blocking.Blocking:
    world = w.build(objects)
    return blocking.blocking([engine.PodClaim("team/x", {"devices": {"requests": [request]}}, "team")], world)


def test_the_docs_example_is_what_it_prints():
    """docs/explain.md shows real output of `explain --blocking`: each console block of its
    section, run again, prints the same lines."""
    import re
    import shlex

    from tests.conftest import REPO

    text = (REPO / "docs" / "explain.md").read_text()
    section = text.split("## What blocks a request: `--blocking`", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```console\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    for block in blocks:
        command, *printed = block.rstrip("\n").split("\n")
        args = shlex.split(command.removeprefix("$ dra-driver explain "))
        args = [str(REPO / a) if a.startswith("tests/") else a for a in args]
        code, out, err = run(*args)
        assert code == 1, err
        assert out.rstrip("\n").split("\n") == printed, command
