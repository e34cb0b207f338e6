"""`dra-driver capacity` (issue 41, item 1) on mock nodes with hand-made fragmented layouts:
one test per fragmentation kind, the CLI's inputs and outputs, and the fast path for many
nodes (one world per node, identical nodes answered once) against the whole world."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from driver import cli
from driver.explain import capacity, capacity_inputs, engine
from driver.explain import world as w

DRIVER = "accel.dra.io"


def held(name: str, node: str, devices: list[str], consumed: dict | None = None) -> dict:
    """An allocated ResourceClaim holding these devices of the node's pool (a share each with `consumed`)."""
    results = []
    for index, device in enumerate(devices):
        result = {"request": "r", "driver": DRIVER, "pool": node, "device": device}
        if consumed is not None:
            result["consumedCapacity"] = consumed
            result["shareID"] = f"00000000-0000-0000-0000-{abs(hash((name, index))) % 10**12:012d}"
        results.append(result)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}}}


def mock(spec: str, sharing: str = "exclusive", mig: str = "static") -> list[dict]:
    return capacity_inputs.mock_nodes([spec], DRIVER, sharing, mig)


def answer(objects: list[dict], only_class: str | None = None) -> capacity.Capacity:
    return capacity.capacity(w.build(objects), DRIVER, only_class=only_class)


def finding(result: capacity.Capacity, node: str, kind: str, label: str | None = None) -> capacity.Finding:
    found = [f for n in result.nodes if n.node == node for f in n.findings
             if f.kind == kind and (label is None or f.label == label)]
    assert len(found) == 1, (node, kind, label, [(f.kind, f.label) for n in result.nodes for f in n.findings])
    return found[0]


def line(result: capacity.Capacity, kind: str, label: str | None = None) -> capacity.ClusterLine:
    return next(x for x in result.cluster if x.kind == kind and (label is None or x.label == label))


def engine_fits(objects: list[dict], node: str, specs: list[dict]) -> bool:
    """The claims allocated together by explain's engine, as `explain -f pod.yaml` would."""
    claims = [engine.PodClaim(f"default/c{i}", spec, "default") for i, spec in enumerate(specs)]
    return all(r.fits for r in engine.explain_pod_node(claims, node, w.build(objects)))


H100 = [f"gpu-0000-{i}1-00-0" for i in range(1, 9)]


def test_scattered_gpus_the_largest_request_fits_on_one_node_and_the_rest_is_fragmentation():
    objects = mock("h100x8x3") + [held("a", "mock-node-1", H100[:5]), held("b", "mock-node-2", H100[:6]),
                                  held("c", "mock-node-3", H100[:4])]
    result = answer(objects)
    assert [finding(result, n, "gpu").largest for n in ("mock-node-1", "mock-node-2", "mock-node-3")] == [3, 2, 4]
    assert finding(result, "mock-node-3", "gpu").next_size == 5
    cluster = line(result, "gpu")
    assert (cluster.largest, cluster.nodes, cluster.free, cluster.unusable) == (4, ["mock-node-3"], "9 free",
                                                                                 "5 not in it")
    # each GPU of h100x8 has a PCIe root of its own: aligned, one at most
    assert finding(result, "mock-node-3", "gpu-aligned").largest == 1
    # the answers are the engine's: the largest is allocated, one more is not
    f = finding(result, "mock-node-3", "gpu")
    assert engine_fits(objects, "mock-node-3", f.request) and not engine_fits(objects, "mock-node-3", f.next_request)


def test_a_full_node_holds_nothing_and_says_the_smallest_request_does_not_fit():
    result = answer(mock("h100x8") + [held("all", "mock-node", H100)])
    f = finding(result, "mock-node", "gpu")
    assert (f.largest, f.next_size, f.request) == (None, 1, [])
    assert line(result, "gpu").nodes == []


def test_gpu_free_but_its_nic_on_another_root_no_aligned_pair():
    # mixed: gpu-11 and nic-12 on pci0000:10, gpu-21 and nic-22 on pci0000:20
    objects = mock("mixed") + [held("x", "mock-node", ["gpu-0000-21-00-0", "nic-0000-12-00-0"])]
    result = answer(objects)
    assert finding(result, "mock-node", "gpu").largest == 1
    pair = finding(result, "mock-node", "gpu-nic")
    assert (pair.largest, pair.next_size) == (None, 1)
    cluster = line(result, "gpu-nic")
    assert (cluster.largest, cluster.free, cluster.unusable) == (None, "1 free GPUs", "1 not in it")
    free = answer(mock("mixed"))
    assert finding(free, "mock-node", "gpu-nic").largest == 2


def test_mig_layout_that_cannot_form_a_7g():
    objects = mock("mixed", mig="dynamic")
    assert finding(answer(objects), "mock-node", "mig-largest").largest == "7g.80gb"
    objects += [held("small", "mock-node", ["gpu-0000-11-00-0-mig-1g-10gb-0", "gpu-0000-21-00-0-mig-1g-10gb-0"])]
    result = answer(objects)
    f = finding(result, "mock-node", "mig-largest")
    # a 1g at placement 0 on each GPU: no 4g (placement 0) and no 7g; a 3g at placement 4 fits
    assert (f.largest, f.next_size) == ("3g.40gb", "4g.40gb")
    assert engine_fits(objects, "mock-node", f.request) and not engine_fits(objects, "mock-node", f.next_request)
    # whole GPUs consume every counter of theirs: none is left
    assert finding(result, "mock-node", "gpu").largest is None


def test_static_mig_free_devices_by_profile():
    taken = ["mig-0000-11-00-0-gi1-ci0", "mig-0000-11-00-0-gi2-ci0"]
    result = answer(mock("a100-mig") + [held("m", "mock-node", taken)])
    assert finding(result, "mock-node", "mig", "1g.5gb").largest == 6
    assert finding(result, "mock-node", "mig", "3g.20gb").largest == 1


def test_shares_leaving_every_gpu_a_little_used():
    objects = mock("mixed", sharing="consumable")
    gpus = ["gpu-0000-11-00-0", "gpu-0000-21-00-0"]
    objects += [held(f"s{i}", "mock-node", [gpu], {"memory": "10Gi", "compute": "0"}) for i, gpu in enumerate(gpus)]
    result = answer(objects)
    model = "NVIDIA H100 80GB HBM3"
    memory = finding(result, "mock-node", "share-memory", model)
    # 81559Mi less 10Gi leaves 71319Mi: the largest share on the 1Gi grid is 69Gi
    assert (memory.largest, memory.next_size) == ("69Gi", "70Gi")
    assert memory.parts == {gpus[0]: "69Gi", gpus[1]: "69Gi"}
    # a whole GPU asks for the default share (79Gi): none is left
    assert finding(result, "mock-node", "gpu").largest is None
    cluster = line(result, "share-memory", model)
    assert (cluster.largest, cluster.free, cluster.unusable) == ("69Gi", "138Gi on 2 GPU(s)", "69Gi not in it")
    compute = finding(result, "mock-node", "share-compute", model)
    assert compute.largest == "100" and compute.unit == "%"
    assert engine_fits(objects, "mock-node", memory.request)
    assert not engine_fits(objects, "mock-node", memory.next_request)


def test_fpgas_by_shell():
    objects = mock("alveo") + [held("f", "mock-node", ["fpga-0000-11-00-1"])]
    result = answer(objects)
    assert finding(result, "mock-node", "fpga", "shell xilinx_u250_gen3x16_xdma_shell_4_1").largest == 1
    assert finding(result, "mock-node", "fpga", "shell xilinx_u55c_gen3x16_xdma_base_3").largest == 1
    dfl = answer(mock("dfl"))
    assert finding(dfl, "mock-node", "fpga", "interfaceID f3c9941350f55b4a896ba05c1c5d6c42").largest == 2


def test_device_class_keeps_the_requests_of_that_class_only():
    result = answer(mock("mixed"), only_class=f"fpga.{DRIVER}")
    assert {f.kind for n in result.nodes for f in n.findings} == {"fpga"}


def test_many_nodes_cut_per_node_give_the_whole_worlds_answer():
    objects = mock("mixedx4") + [held("a", "mock-node-2", ["gpu-0000-11-00-0"]),
                                 held("b", "mock-node-3", ["nic-0000-22-00-0", "fpga-0000-31-00-1"])]
    split = capacity_inputs.per_node(objects)
    assert split is not None and len({item.key for item in split}) == 3  # nodes 1 and 4 are the same
    fast = capacity.capacity_per_node(split, DRIVER)
    whole = answer(objects)
    def as_tuples(result):
        return [(n.node, [(f.kind, f.label, f.largest, f.next_size, f.devices) for f in n.findings])
                for n in result.nodes]
    assert as_tuples(fast) == as_tuples(whole)
    assert [(c.kind, c.label, c.largest, c.free, c.unusable) for c in fast.cluster] == \
        [(c.kind, c.label, c.largest, c.free, c.unusable) for c in whole.cluster]


def test_a_slice_for_all_nodes_keeps_the_whole_world():
    objects = mock("l4")
    for obj in objects:
        if obj["kind"] == "ResourceSlice":
            del obj["spec"]["nodeName"]
            obj["spec"]["allNodes"] = True
    assert capacity_inputs.per_node(objects) is None


def test_mock_profile_counts():
    nodes = {o["spec"]["nodeName"] for o in mock("l4x3") if o["kind"] == "ResourceSlice"}
    assert nodes == {"mock-node-1", "mock-node-2", "mock-node-3"}
    # h100x8 is a profile's own name, not h100 eight times
    assert {o["spec"]["nodeName"] for o in mock("h100x8") if o["kind"] == "ResourceSlice"} == {"mock-node"}


# -- the command ------------------------------------------------------------------------------------------
def run(argv: list[str]) -> tuple[int, str, str]:
    from driver.explain import capacity_command

    args = cli.parser().parse_args(["capacity", *argv])
    out, err = io.StringIO(), io.StringIO()
    return capacity_command.run(args, out, err), out.getvalue(), err.getvalue()


def test_cli_table_json_and_yaml(tmp_path):
    claims = tmp_path / "held.yaml"
    claims.write_text(yaml.safe_dump_all([held("a", "mock-node-1", H100[:7])]))
    code, out, err = run(["--mock", "h100x8x2", "-f", str(claims)])
    assert code == 0, err
    assert out.splitlines()[0].split()[:3] == ["NODE", "KIND", "REQUEST"]
    assert "CLUSTER" in out
    gpu_line = next(x for x in out.splitlines() if x.startswith("gpu ") and "whole GPUs" in x)
    assert gpu_line.split()[3:5] == ["8", "mock-node-2"], gpu_line
    code, out, _ = run(["--mock", "h100x8x2", "-f", str(claims), "-o", "json"])
    data = json.loads(out)
    node1 = next(n for n in data["nodes"] if n["node"] == "mock-node-1")
    gpu = next(f for f in node1["findings"] if f["kind"] == "gpu")
    assert (gpu["largest"], gpu["next"], gpu["claims"][0]["devices"]["requests"][0]["exactly"]["count"]) == (1, 2, 1)
    code, out, _ = run(["--mock", "h100x8x2", "-f", str(claims), "-o", "yaml", "--node", "mock-node-2"])
    data = yaml.safe_load(out)
    assert [n["node"] for n in data["nodes"]] == ["mock-node-2"]
    assert "&id" not in out  # a pod's claims are written out, not as YAML aliases


@pytest.mark.parametrize("argv, message", [
    (["--mock", "l4", "--node", "elsewhere"], "--node elsewhere: no ResourceSlice names this node"),
    (["--mock", "l4", "--device-class", "tpu"], "--device-class tpu: no such DeviceClass"),
    (["--mock", "nothing"], "--mock nothing: mock profile 'nothing'"),
    (["-f", "/nonexistent/slices.yaml"], "-f /nonexistent/slices.yaml: cannot read it"),
])
def test_cli_bad_input_is_one_line(argv, message):
    code, out, err = run(argv)
    assert code == 2 and out == ""
    assert err.startswith(f"dra-driver capacity: {message}") and err.count("\n") == 1, err


def test_the_docs_examples_are_the_commands_output():
    """docs/capacity.md shows the command's real output on the layouts of tests/data/capacity."""
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "capacity.md").read_text()
    blocks = re.findall(r"```console\n\$ dra-driver capacity (.*?)\n(.*?)```", doc, re.S)
    assert len(blocks) == 5
    for argv, shown in blocks:
        code, out, err = run(shlex.split(argv))
        assert code == 0, err
        assert out == shown, f"docs/capacity.md: the output of `dra-driver capacity {argv}` changed:\n{out}"
