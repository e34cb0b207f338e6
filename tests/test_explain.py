"""`dra-driver explain`: every example against every mock profile agrees with the demo's
allocator; planted mismatches get the exact reason and device; the CEL environment
behaves as Kubernetes' does; the command's inputs, outputs and exit status."""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from driver import cli
from driver.demo import _inventory_from_slices
from driver.devices.mock import builtin_profiles
from driver.kube import releases
from driver.explain import engine, sources
from driver.explain import world as w
from driver.kube import quantity
from driver.scheduling import cel
from driver.scheduling.allocator import Unsatisfiable, allocate, allocation_results
from driver.sim.apiserver import ApiServer, claim_allocated
from tests.conftest import REPO
from tests.test_examples import DYNAMIC_MIG, INTENT, load

DRIVER = "accel.dra.io"
NODE = sources.MOCK_NODE


@pytest.fixture(scope="module")
def published(built, tmp_path_factory):
    """profile, mig mode -> the objects a node of that profile publishes (consumable GPU
    sharing, as the demo runs the driver) with the chart's DeviceClasses."""
    from tests.test_dynamic_mig import dynamic

    cache: dict[tuple[str, str], list[dict]] = {}

    def get(profile: str, mig_mode: str = "static") -> list[dict]:
        if (profile, mig_mode) not in cache:
            node, result = built(profile)
            if mig_mode == "dynamic":
                result = dynamic(node)
            cache[(profile, mig_mode)] = sources.inventory_objects(result.inventory, DRIVER, "consumable")
        return copy.deepcopy(cache[(profile, mig_mode)])

    return get


def allocator_fits(objects: list[dict], spec: dict, taken: set[str] = frozenset()) -> bool:
    """What the demo's allocator says on the same slices."""
    slices = [o for o in objects if o["kind"] == "ResourceSlice"]
    classes = {o["metadata"]["name"]: [s["cel"]["expression"] for s in o["spec"]["selectors"]]
               for o in objects if o["kind"] == "DeviceClass"}
    inventory, shares, counters, taints = _inventory_from_slices(slices, DRIVER)
    for claim in (o for o in objects if o["kind"] == "ResourceClaim"):  # other claims' allocations
        for r in claim["status"]["allocation"]["devices"]["results"]:
            if "shareID" not in r:
                taken = set(taken) | {r["device"]}
            else:  # a share: the scheduler counts what it consumed of the device
                shares.take(r["device"], {k: quantity.value(v) for k, v in (r.get("consumedCapacity") or {}).items()})
            counters.take(r["device"])
    try:
        allocate(spec, inventory, classes, DRIVER, set(taken), shares, counters, taints)
    except Unsatisfiable:
        return False
    return True


def explain(objects: list[dict], spec: dict, namespace: str = "default") -> engine.Explanation:
    return engine.explain("default/c", spec, w.build(objects), namespace)


def verdicts(e: engine.Explanation, request: str | None = None) -> dict[str, engine.DeviceVerdict]:
    return {v.device: v for n in e.nodes for a in n.alternatives
            if request in (None, a.request) for v in a.devices}


def edited(spec: dict, old: str, new: str) -> dict:
    text = json.dumps(spec)
    assert json.dumps(old)[1:-1] in text, old
    return json.loads(text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1]))


def holder(name: str, results: list[dict]) -> dict:
    claim = claim_allocated("default", name, str(uuid.uuid4()), results, [])
    return {**claim, "kind": "ResourceClaim"}


# -- every example against every profile -----------------------------------------------------------
@pytest.mark.parametrize("example", sorted(INTENT))
def test_every_example_against_every_profile_agrees_with_the_allocator(example, published):
    _, spec = load(example)
    mig_mode = "dynamic" if example in DYNAMIC_MIG else "static"
    fits_on = set()
    for profile in builtin_profiles():
        objects = published(profile, mig_mode)
        result = explain(objects, spec)
        assert [n.node for n in result.nodes] == [NODE]
        assert result.fits == allocator_fits(objects, spec), (example, profile, result.nodes[0].why)
        if result.fits:
            fits_on.add(profile)
            # What it would get passes every selector and is a device of the node.
            chosen = result.nodes[0].allocation
            assert chosen and all(verdicts(result, a["request"])[a["device"]].code == engine.FITS
                                  for a in chosen)
        else:
            assert result.nodes[0].why and result.nodes[0].why != engine.FITS
    assert INTENT[example][0] in fits_on, "fits where the demo allocates it"


# -- planted mismatches -------------------------------------------------------------------------------
def test_a_wrong_product_name_rules_out_every_gpu_by_its_selector(published):
    objects = published("h100x8")
    _, spec = load("gpu-by-model")
    spec = edited(spec, "NVIDIA H100", "NVIDIA H200")
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    gpu = verdicts(result)["gpu-0000-11-00-0"]
    assert (gpu.code, gpu.reason) == (engine.SELECTOR, "selector #0 is false")
    assert gpu.seen["productName"] == '"NVIDIA H100 80GB HBM3"'
    assert verdicts(result)["nic-0000-12-00-0"].code == engine.CLASS
    assert result.nodes[0].why == "request gpu: 0 of 8 fit, needs 1 (8 x selector #0 is false)"


def test_80gi_instead_of_80g_is_explained_and_the_fix_suggested(published):
    objects = published("h100x8")
    _, spec = load("gpu-by-model")
    spec = edited(spec, 'quantity("80G")', 'quantity("80Gi")')
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    gpu = verdicts(result)["gpu-0000-11-00-0"]
    assert gpu.code == engine.SELECTOR and gpu.seen["memory"] == "81559Mi"
    (hint,) = result.suggestions
    assert 'quantity("80Gi") is 85899345920' in hint and 'with quantity("80G")' in hint
    assert "selects 8 device(s)" in hint


def test_gpu_and_nic_on_different_pcie_roots_fail_the_constraint(published):
    objects = published("h100x8")
    for obj in objects:
        for device in obj["spec"].get("devices", []) if obj["kind"] == "ResourceSlice" else []:
            if device["name"].startswith("nic-"):
                device["attributes"]["resource.kubernetes.io/pcieRoot"] = {"string": "pci0000:ff"}
    _, spec = load("gpu-nic-aligned")
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    node = result.nodes[0]
    assert node.why.startswith("constraint not met: matchAttribute resource.kubernetes.io/pcieRoot")
    assert '"pci0000:ff"' in node.why and "no value common to all" in node.why
    # Every device fits its own request; only the pairing fails.
    assert all(v.code == engine.FITS for v in verdicts(result).values() if v.code != engine.CLASS)


def test_a_tainted_device_is_out_unless_tolerated(published):
    objects = published("l4")
    for obj in objects:
        for device in obj["spec"].get("devices", []) if obj["kind"] == "ResourceSlice" else []:
            if device["name"].startswith("gpu-"):
                device["taints"] = [{"key": "example.com/ecc", "value": "failing", "effect": "NoSchedule"}]
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    gpus = {d: v for d, v in verdicts(result).items() if d.startswith("gpu-")}
    assert gpus and all(v.reason == "taint example.com/ecc=failing:NoSchedule is not tolerated"
                        for v in gpus.values())
    spec["devices"]["requests"][0]["exactly"]["tolerations"] = [{"key": "example.com/ecc", "operator": "Exists"}]
    assert explain(objects, spec).fits and allocator_fits(objects, spec)


def test_a_device_taken_by_another_claim_names_that_claim(published):
    objects = published("alveo")
    _, spec = load("fpga-by-shell")
    first = explain(objects, spec)
    assert first.fits
    taken = [a["device"] for a in first.nodes[0].allocation]
    fpgas = [v.device for v in verdicts(first).values() if v.code == engine.FITS]
    objects.append(holder("training", [{"request": "f", "driver": DRIVER, "pool": NODE, "device": d}
                                       for d in fpgas]))
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    assert verdicts(result)[taken[0]].reason == "allocated to claim default/training"
    # Its own allocation does not count against it.
    own = holder("c", [{"request": "f", "driver": DRIVER, "pool": NODE, "device": d} for d in fpgas])
    again = engine.explain("default/c", spec, w.build(objects[:-1] + [own]), "default",
                           skip_uid=own["metadata"]["uid"])
    assert again.fits


def test_a_full_mig_card_reports_the_exhausted_counter_and_who_holds_it(published):
    objects = published("h100x8", "dynamic")
    _, spec = load("mig-dynamic")
    assert explain(objects, spec).fits
    # Another claim holds a 7g partition of every GPU: nothing is left to carve.
    devices = [d for o in objects if o["kind"] == "ResourceSlice" for d in o["spec"].get("devices", [])]
    whole = [d["name"] for d in devices if d["attributes"].get("profile", {}).get("string", "").startswith("7g.")]
    assert len(whole) == 8
    objects.append(holder("big-training", [{"request": "g", "driver": DRIVER, "pool": NODE, "device": d}
                                           for d in whole]))
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    out = [v for v in verdicts(result).values() if v.code == engine.COUNTERS]
    assert out and all("exhausted" in v.reason and "(used by default/big-training)" in v.reason for v in out)
    assert all(v.code in (engine.CLASS, engine.SELECTOR, engine.COUNTERS) for v in verdicts(result).values())


def test_consumable_capacity_left_is_reported(published):
    objects = published("l4")
    gpu = next(d for o in objects if o["kind"] == "ResourceSlice" for d in o["spec"].get("devices", [])
               if d["name"].startswith("gpu-"))
    total = gpu["capacity"]["memory"]["value"]
    objects.append(holder("other", [{"request": "g", "driver": DRIVER, "pool": NODE, "device": gpu["name"],
                                     "shareID": str(uuid.uuid4()),
                                     "consumedCapacity": {"memory": "20Gi", "compute": "50"}}]))
    spec = {"devices": {"requests": [{"name": "share", "exactly": {
        "deviceClassName": f"gpu.{DRIVER}", "capacity": {"requests": {"memory": "10Gi"}}}}]}}
    result = explain(objects, spec)
    assert result.fits == allocator_fits(objects, spec)
    v = verdicts(result)[gpu["name"]]
    if not result.fits:
        assert v.code == engine.CAPACITY and f"of {total} left" in v.reason


def _shared_gpus(objects: list[dict], holders_per_gpu: int) -> list[dict]:
    """The node's GPUs, each with this many other claims holding a 10Gi share of it."""
    gpus = [d for o in objects if o["kind"] == "ResourceSlice" for d in o["spec"].get("devices", [])
            if d["name"].startswith("gpu-")]
    for i, gpu in enumerate(gpus):
        for j in range(holders_per_gpu):
            objects.append(holder(f"job-{i}-{j}", [{
                "request": "g", "driver": DRIVER, "pool": NODE, "device": gpu["name"], "shareID": str(uuid.uuid4()),
                "consumedCapacity": {"memory": "10Gi", "compute": "10"}}]))
    return gpus


def _share(memory: str) -> dict:
    return {"devices": {"requests": [{"name": "share", "exactly": {
        "deviceClassName": f"gpu.{DRIVER}", "capacity": {"requests": {"memory": memory}}}}]}}


def test_a_request_larger_than_any_device_names_the_largest_and_no_holder(published):
    # Issue 41 item 5: 90Gi on 80 GiB GPUs, 16 claims holding shares. Freeing them would not
    # help: the answer says so, names the largest device, and lists none of the 16.
    objects = published("h100x8")
    gpus = _shared_gpus(objects, 2)
    total = gpus[0]["capacity"]["memory"]["value"]
    result = explain(objects, _share("90Gi"))
    assert not result.fits and not allocator_fits(objects, _share("90Gi"))
    (node,) = result.nodes
    assert node.why == (f"request share: no device of the node can hold it even when free: memory 90Gi "
                        f"wanted, the largest has {total} ({gpus[0]['name']})")
    assert node.fits_when_free is False
    for gpu in gpus:
        v = verdicts(result)[gpu["name"]]
        assert (v.code, v.reason) == (engine.CAPACITY, f"asks for more capacity than the device has: memory 90Gi "
                                                       f"wanted, {total} there")
    # One GPU larger than the others: it is the one named.
    gpus[5]["capacity"]["memory"]["value"] = "88Gi"
    node = explain(objects, _share("90Gi")).nodes[0]
    assert node.why.endswith(f"the largest has 88Gi ({gpus[5]['name']})") and "job-" not in node.why
    # A share that fits an empty GPU but not beside the others' shares still names them.
    result = explain(objects, _share("70Gi"))
    assert not result.fits and not allocator_fits(objects, _share("70Gi"))
    assert result.nodes[0].fits_when_free is True
    assert "not enough capacity left" in result.nodes[0].why and "(held by default/job-" in result.nodes[0].why


def test_more_devices_than_the_node_has_is_judged_as_if_nothing_were_allocated(published):
    objects = published("h100x8")
    _shared_gpus(objects, 1)
    objects.append(holder("whole", [{"request": "g", "driver": DRIVER, "pool": NODE, "device": "nic-0000-12-00-0"}]))
    nine = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 9}}]}}
    result = explain(objects, nine)
    assert not result.fits and not allocator_fits(objects, nine)
    node = result.nodes[0]
    assert node.why == "request gpu: 8 of 8 fit, needs 9, even with nothing allocated"
    assert node.fits_when_free is False
    two = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 2}}]}}
    assert explain(objects, two).nodes[0].fits_when_free is True


def test_cli_a_request_larger_than_any_device(tmp_path):
    claim = tmp_path / "big.yaml"
    claim.write_text(yaml.safe_dump({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                     "metadata": {"name": "big"}, "spec": _share("90Gi")}))
    code, out, _ = run("-f", str(claim), "--mock", "h100x8", "--gpu-sharing", "consumable")
    assert code == 1 and "no device of the node can hold it even when free: memory 90Gi wanted" in out
    code, out, _ = run("-f", str(claim), "--mock", "h100x8", "--gpu-sharing", "consumable", "-o", "json")
    assert json.loads(out)["claims"][0]["nodes"][0]["fits_when_free"] is False


def test_admin_access_needs_the_namespace_label(published):
    objects = published("l4")
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}",
                                                                  "adminAccess": True}}]}}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ops", "labels": {}}}
    result = explain(objects + [namespace], spec, namespace="ops")
    assert not result.fits
    assert {v.code for d, v in verdicts(result).items() if d.startswith("gpu-")} == {engine.ADMIN}
    namespace["metadata"]["labels"][releases.ADMIN_ACCESS_LABEL] = "true"
    gpus = [v.device for v in verdicts(result).values() if v.device.startswith("gpu-")]
    busy = holder("training", [{"request": "g", "driver": DRIVER, "pool": NODE, "device": d} for d in gpus])
    # Admin access ignores the other claims' allocations.
    assert explain(objects + [namespace, busy], spec, namespace="ops").fits


@pytest.mark.parametrize("release,label", [
    ((1, 32), None),  # no label asked for
    ((1, 33), "resource.k8s.io/admin-access"),  # met by the matrix: 422 on 1.33 for the new key
    ((1, 34), "resource.kubernetes.io/admin-access"),
    ((1, 37), "resource.kubernetes.io/admin-access"),
])
def test_the_admin_access_label_is_the_one_the_clusters_release_checks(published, release, label):
    objects = published("l4")
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}",
                                                                  "adminAccess": True}}]}}
    for key in ("resource.k8s.io/admin-access", "resource.kubernetes.io/admin-access"):
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ops", "labels": {key: "true"}}}
        world = w.build(objects + [namespace])
        world.release = release
        result = engine.explain("ops/c", spec, world, "ops")
        assert result.fits == (label in (None, key)), (release, key, verdicts(result))
        if not result.fits:
            assert {v.reason for d, v in verdicts(result).items() if d.startswith("gpu-")} == {
                f'adminAccess needs namespace ops labelled {label}="true"'}


def test_a_typo_in_an_attribute_name_is_a_cel_error_with_a_suggestion(published):
    objects = published("h100x8")
    _, spec = load("gpu-by-model")
    spec = edited(spec, "productName", "productname")
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    assert verdicts(result)["gpu-0000-11-00-0"].code == engine.CEL_ERROR
    assert "CEL runtime error: no such key: productname" in result.nodes[0].why
    assert any("did you mean 'productName'?" in s for s in result.suggestions)


def test_a_version_that_is_not_semver_is_suggested_a_fix(published):
    objects = published("h100x8")
    _, spec = load("gpu-by-model")
    spec = edited(spec, 'semver("8.9.0")', 'semver("8.9")')
    result = explain(objects, spec)
    assert not result.fits and not allocator_fits(objects, spec)
    assert any('semver("8.9") is not a semantic version' in s and 'semver("8.9.0")' in s
               for s in result.suggestions)


def test_distinct_attribute_and_all_mode(published):
    objects = published("h100x8")
    two = {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 2}}],
                       "constraints": [{"distinctAttribute": "resource.kubernetes.io/pcieRoot"}]}}
    assert explain(objects, two).fits
    same = {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 2}}],
                        "constraints": [{"distinctAttribute": f"{DRIVER}/productName"}]}}
    result = explain(objects, same)
    assert not result.fits and "distinctAttribute accel.dra.io/productName" in result.nodes[0].why
    every = {"devices": {"requests": [{"name": "all", "exactly": {"deviceClassName": f"gpu.{DRIVER}",
                                                                  "allocationMode": "All"}}]}}
    result = explain(objects, every)
    assert result.fits and len(result.nodes[0].allocation) == 8


# -- CEL with Kubernetes semantics --------------------------------------------------------------------
def _device(attributes=None, capacity=None) -> dict:
    return cel.activation(DRIVER, {DRIVER: attributes or {}}, {DRIVER: capacity or {}})


@pytest.mark.parametrize("expression, expected", [
    ('device.attributes["other.example.com"].size() == 0', True),  # unknown domain: empty map
    ('"model" in device.attributes["accel.dra.io"]', False),
    ('device.capacity["accel.dra.io"].memory == quantity("80Gi")', True),
    ('device.capacity["accel.dra.io"].memory == quantity("81920Mi")', True),  # by value
    ('device.capacity["accel.dra.io"].memory.compareTo(quantity("80G")) > 0', True),
    ('device.capacity["accel.dra.io"].memory.isLessThan(quantity("1Ti"))', True),
    ('device.capacity["accel.dra.io"].memory.asInteger() == 85899345920', True),
    ('quantity("1.5").isInteger()', False),
    ('quantity("500m").asApproximateFloat() == 0.5', True),
    ('quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")', True),
    ('quantity("1Gi").sub(1073741824).sign() == 0', True),
    ('isQuantity("80Gi") && !isQuantity("80 GB")', True),
    ('device.attributes["accel.dra.io"].cc.isGreaterThan(semver("8.9.0"))', True),
    ('device.attributes["accel.dra.io"].cc == semver("9.0.0")', True),
    ('device.attributes["accel.dra.io"].cc.major() == 9 && semver("1.2.3-rc.1").minor() == 2', True),
    ('semver("1.2.3-rc.1").isLessThan(semver("1.2.3"))', True),
    ('isSemver("1.2.3") && !isSemver("1.2")', True),
])
def test_kubernetes_cel_extensions(expression, expected):
    variables = _device({"cc": cel.SemVer("9.0.0")}, {"memory": "80Gi"})
    assert cel.evaluate(expression, variables) is expected


@pytest.mark.parametrize("expression, message", [
    ('device.attributes["accel.dra.io"].model == "x"', "no such key: model"),
    ('device.capacity["accel.dra.io"].memory > quantity("1Gi")', "no matching overload"),
    ('device.capacity["accel.dra.io"].memory == "80Gi"', "'(quantity, string)'"),
    ('semver("12.4").major() == 12', "not a semantic version"),
    ('quantity("80 GB") == quantity("1")', "quantity('80 GB')"),
    ('device.attributes["accel.dra.io"].cc.compareTo(quantity("1")) == 0', "'compareTo' applied to '(semver, quantity)'"),
    ('device.driver', "must return a bool"),
    ('device.driver ==', "compilation failed: ERROR: <input>:1:"),
])
def test_what_kubernetes_rejects_is_an_error(expression, message):
    variables = _device({"cc": cel.SemVer("9.0.0")}, {"memory": "80Gi"})
    with pytest.raises(cel.CelError) as raised:
        cel.evaluate(expression, variables)
    assert message in raised.value.message


# -- the command -----------------------------------------------------------------------------------------
def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    parsed = cli.parser().parse_args(["explain", *args])
    from driver.explain import command

    code = command.run(parsed, out, err)
    return code, out.getvalue(), err.getvalue()


def test_exit_status_and_json(tmp_path):
    claim = REPO / "examples" / "gpu-single" / "claim.yaml"
    code, out, _ = run("-f", str(claim), "--mock", "l4", "-o", "json")
    assert code == 0
    body = json.loads(out)["claims"][0]
    assert body["fits"] is True and body["nodes"][0]["node"] == NODE
    assert {"device", "driver", "pool", "code", "reason", "seen"} <= set(body["nodes"][0]["alternatives"][0]["devices"][0])
    code, out, _ = run("-f", str(REPO / "examples" / "mig" / "claim.yaml"), "--mock", "l4")
    assert code == 1 and "fits on none of 1 node(s)" in out and "\033[" not in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: ResourceClaim\nmetadata: {name: x}\nspec: {devices: {requests: [{name: g}]}}\n")
    for args, message in [
        (("-f", str(bad), "--mock", "l4"), "spec.devices.requests[0]: Required value: exactly one of `exactly` or `firstAvailable` is required"),
        (("-f", str(tmp_path / "missing.yaml"), "--mock", "l4"), "cannot read it"),
        (("nope", "-f", str(claim), "--mock", "l4"), "no ResourceClaim or ResourceClaimTemplate 'nope'"),
        (("-f", str(claim), "--mock", "l4", "--node", "elsewhere"), "--node elsewhere: no ResourceSlice"),
        (("--mock", "l4"), "name a claim (CLAIM) or give -f FILE"),
        (("-f", str(claim), "--mock", "no-such-profile"), "--mock no-such-profile"),
    ]:
        code, out, err = run(*args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)


def test_colour_only_when_asked_or_on_a_terminal():
    claim = str(REPO / "examples" / "gpu-single" / "claim.yaml")
    assert "\033[32m" in run("-f", claim, "--mock", "l4", "--color", "always")[1]
    assert "\033[" not in run("-f", claim, "--mock", "l4")[1]  # not a terminal


def test_offline_slices_file_with_claims_and_a_template_by_name(published, tmp_path):
    objects = published("l4")
    gpus = [d["name"] for o in objects if o["kind"] == "ResourceSlice" for d in o["spec"].get("devices", [])
            if d["name"].startswith("gpu-")]
    objects.append(holder("busy", [{"request": "g", "driver": DRIVER, "pool": NODE, "device": d} for d in gpus]))
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": "one-gpu", "namespace": "default"},
                    "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                        "deviceClassName": f"gpu.{DRIVER}", "allocationMode": "ExactCount", "count": 1}}]}}}})
    dump = tmp_path / "cluster.yaml"
    dump.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}))
    code, out, _ = run("one-gpu", "--slices", str(dump))
    # Published shareable (consumable, as the demo runs), but the other claim's results have
    # no share: the scheduler counts such a device as allocated whole.
    assert code == 1 and "allocated to claim default/busy" in out


def test_against_a_cluster_through_a_kubeconfig(published, tmp_path):
    objects = published("l4")
    with ApiServer() as api:
        for obj in objects:
            if obj["kind"] == "ResourceSlice":
                api.state.slices[obj["metadata"]["name"]] = obj
            else:
                api.put_object("deviceclasses", obj)
        api.put_object("namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": "team-a", "labels": {}}})
        gpus = [d["name"] for o in objects if o["kind"] == "ResourceSlice"
                for d in o["spec"].get("devices", []) if d["name"].startswith("gpu-")]
        results = [{"request": "g", "driver": DRIVER, "pool": NODE, "device": d} for d in gpus]
        api.put_claim(claim_allocated("team-b", "training", "u-1", results, []))
        request = {"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}
        api.put_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "mine", "namespace": "team-a", "uid": "u-2"},
                       "spec": {"devices": {"requests": [request]}}})
        api.put_object("resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "tmpl", "namespace": "team-a"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": f"gpu.{DRIVER}", "adminAccess": True}}]}}}})
        kubeconfig = api.kubeconfig(tmp_path)
        code, out, err = run("mine", "-n", "team-a", "--kubeconfig", str(kubeconfig))
        assert code == 1, err
        assert "allocated to claim team-b/training" in out
        code, out, _ = run("tmpl", "-n", "team-a", "--kubeconfig", str(kubeconfig), "-o", "json")
        body = json.loads(out)["claims"][0]
        assert body["source"] == "ResourceClaimTemplate from the cluster"
        assert {d["code"] for d in body["nodes"][0]["alternatives"][0]["devices"]
                if d["device"].startswith("gpu-")} == {engine.ADMIN}
        code, _, err = run("absent", "-n", "team-a", "--kubeconfig", str(kubeconfig))
        assert code == 2 and "no ResourceClaim or ResourceClaimTemplate 'absent' in namespace team-a" in err


def test_against_a_cluster_a_slices_node_selector_is_judged_on_the_nodes_labels(tmp_path):
    """A network-attached device (a slice with a nodeSelector): explain reads the cluster's
    Nodes and counts it only where their labels match, as the scheduler does."""
    selector = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "fabric", "operator": "In",
                                                             "values": ["a"]}]}]}
    with ApiServer() as api:
        api.state.slices["nas"] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "nas"},
            "spec": {"driver": DRIVER, "pool": {"name": "fabric-a", "generation": 1, "resourceSliceCount": 1},
                     "nodeSelector": selector, "devices": [{"name": "dev-0"}]}}
        api.state.slices["local"] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "local"},
            "spec": {"driver": "other.example.com", "pool": {"name": "node-b", "generation": 1,
                                                             "resourceSliceCount": 1},
                     "nodeName": "node-b", "devices": [{"name": "local-0"}]}}
        api.put_object("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                         "metadata": {"name": "nas"}, "spec": {"selectors": [
                                             {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}})
        api.add_node("node-a", labels={"fabric": "a"})
        api.add_node("node-b", labels={"fabric": "b"})
        api.put_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "nas", "namespace": "default", "uid": "u-1"},
                       "spec": {"devices": {"requests": [{"name": "d", "exactly": {"deviceClassName": "nas"}}]}}})
        code, out, err = run("nas", "--kubeconfig", str(api.kubeconfig(tmp_path)), "-o", "json")
        assert code == 0, err
        verdicts = {n["node"]: n["fits"] for n in json.loads(out)["claims"][0]["nodes"]}
        assert verdicts == {"node-a": True, "node-b": False}, out
        assert ("list", "", "nodes") in api.state.access


def test_the_installed_command_runs_as_the_readme_shows():
    done = subprocess.run([sys.executable, "-m", "driver", "explain", "-f",
                           str(REPO / "examples" / "gpu-nic-aligned" / "claim.yaml"), "--mock", "h100x8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Node mock-node: fits" in done.stdout and "would get: gpu -> gpu-" in done.stdout


def test_the_readme_shows_real_output(tmp_path):
    readme = (REPO / "README.md").read_text()
    block = readme.split("$ dra-driver explain -f claim.yaml --mock h100x8\n", 1)[1].split("```", 1)[0]
    claim = tmp_path / "claim.yaml"
    claim.write_text((REPO / "examples" / "gpu-by-model" / "claim.yaml").read_text()
                     .replace('quantity("80G")', 'quantity("80Gi")'))
    code, out, _ = run("-f", str(claim), "--mock", "h100x8")
    assert code == 1 and out.rstrip() == block.rstrip()


def test_an_allocated_result_from_the_explanation_is_what_allocation_results_would_name(published):
    """The result names the same driver/pool/device triple the allocator writes."""
    objects = published("l4")
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    (allocation,) = explain(objects, spec).nodes[0].allocation
    slices = [o for o in objects if o["kind"] == "ResourceSlice"]
    inventory, shares, counters, taints = _inventory_from_slices(slices, DRIVER)
    classes = {o["metadata"]["name"]: [s["cel"]["expression"] for s in o["spec"]["selectors"]]
               for o in objects if o["kind"] == "DeviceClass"}
    (result,) = allocation_results(allocate(spec, inventory, classes, DRIVER, set(), shares, counters, taints),
                                   DRIVER, NODE)
    assert {k: result[k] for k in ("request", "driver", "pool", "device")} == \
        {k: allocation[k] for k in ("request", "driver", "pool", "device")}


def test_other_drivers_devices_are_candidates_too(published):
    objects = published("l4")
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": "other"},
                    "spec": {"driver": "gpu.example.com", "nodeName": NODE,
                             "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1},
                             "devices": [{"name": "x0", "attributes": {"model": {"string": "X"}}}]}})
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    result = explain(objects, spec)
    other = verdicts(result)["x0"]
    assert other.driver == "gpu.example.com" and other.code == engine.CLASS
    assert other.seen["driver"] == '"gpu.example.com"'


def test_only_the_newest_pool_generation_counts():
    def slice_(generation: int, device: str) -> dict:
        return {"kind": "ResourceSlice", "metadata": {"name": f"s{generation}"},
                "spec": {"driver": DRIVER, "nodeName": "n", "pool": {"name": "n", "generation": generation,
                                                                    "resourceSliceCount": 2},
                         "devices": [{"name": device}]}}

    world = w.build([slice_(1, "old"), slice_(2, "new")] + [slice_(2, "newer") | {"metadata": {"name": "s3"}}])
    assert [d.name for d in world.devices] == ["new", "newer"]
    # An incomplete pool (1 of 2 slices of the newest generation): the scheduler takes nothing from it.
    world = w.build([slice_(1, "old"), slice_(2, "new")])
    assert world.devices == [] and world.unusable_pools == {(DRIVER, "n"): ("incomplete", frozenset({"n"}))}
    assert world.notes == [f"pool n of {DRIVER}: 1 of 2 slices of its newest generation seen (being updated): "
                           "the scheduler allocates none of its devices until it is complete"]


def _pool_slice(name: str, generation: int, count: int, devices: list[str], **where) -> dict:
    return {"kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": DRIVER, "pool": {"name": "p", "generation": generation, "resourceSliceCount": count},
                     "devices": [{"name": d} for d in devices], **where}}


def test_a_pool_moving_between_nodes_is_gathered_per_node_as_the_scheduler_does():
    # upstream's multi-host scenarios: generation 1 on node-1 (complete), 2 starting on node-2
    slices = [_pool_slice("a", 1, 2, ["d1"], nodeName="node-1"), _pool_slice("b", 1, 2, ["d2"], nodeName="node-1"),
              _pool_slice("c", 2, 2, ["d1"], nodeName="node-2")]
    world = w.build(slices)
    one, two = world.view("node-1"), world.view("node-2")
    assert [d.name for d in one.on_node("node-1")] == ["d1", "d2"] and not one.unusable_pools
    # node-2 sees 1 of 2 slices of generation 2 and nothing newer: incomplete
    assert two.on_node("node-2") == [] and two.unusable_pools == {(DRIVER, "p"): ("incomplete", None)}
    # a node that sees only old slices of an incomplete generation while a newer one exists
    # elsewhere: obsolete there, left out without an error
    slices = [_pool_slice("a", 1, 2, ["d1"], nodeName="node-1"), _pool_slice("c", 2, 1, ["d1"], nodeName="node-2")]
    old = w.build(slices).view("node-1")
    assert old.on_node("node-1") == [] and not old.unusable_pools


def test_a_nodes_view_reads_only_the_slices_that_can_target_it(monkeypatch):
    """The scheduler keeps slices by node; a view that matched every node's slices against
    each node made explain quadratic in the fleet (5-7 s at 1,000 nodes)."""
    slices = [{"kind": "ResourceSlice", "metadata": {"name": f"s{i}"},
               "spec": {"driver": DRIVER, "nodeName": f"node-{i}", "pool": {"name": f"node-{i}", "generation": 1,
                                                                          "resourceSliceCount": 1},
                        "devices": [{"name": "d"}]}} for i in range(50)]
    slices.append(_pool_slice("everywhere", 1, 1, ["e"], allNodes=True))
    world = w.build(slices)
    asked = []
    real = w.node_matches
    monkeypatch.setattr(w, "node_matches", lambda node, labels, name, *rest: asked.append(name) or real(node, labels, name, *rest))
    view = world.view("node-7")
    assert sorted(d.name for d in view.on_node("node-7")) == ["d", "e"]
    assert sorted(asked, key=str) == sorted(["node-7", None], key=str), "its own slice and the untargeted one"


def test_a_multi_node_pool_counts_the_other_nodes_slices_and_their_counters():
    slices = [_pool_slice("a", 1, 2, ["d1"], nodeName="node-1"), _pool_slice("b", 1, 2, ["d2"], nodeName="node-2")]
    view = w.build(slices).view("node-1")
    assert [d.name for d in view.on_node("node-1")] == ["d1"] and [d.name for d in view.elsewhere] == ["d2"]
    assert not view.unusable_pools


@pytest.mark.parametrize("labels,fits", [({"region": "region-1"}, True), ({"region": "region-2"}, False), (None, True)])
def test_a_slices_node_selector_is_evaluated_on_the_nodes_labels(labels, fits):
    selector = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "region", "operator": "In",
                                                             "values": ["region-1"]}]}]}
    objects = [_pool_slice("a", 1, 1, ["d1"], nodeSelector=selector)]
    if labels is not None:
        objects.append({"kind": "Node", "metadata": {"name": "node-2", "labels": labels}})
    world = w.build(objects + [{"kind": "DeviceClass", "metadata": {"name": "c"},
                                "spec": {"selectors": [{"cel": {"expression": "true"}}]}}])
    claim = {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}]}}
    report = engine.explain_node("default/x", claim, "node-2", world, "default")
    assert report.fits is fits, report.why
    if labels is None:  # labels unknown: taken to match, with a note
        assert any("nodeSelector is not evaluated" in n for n in world.notes)


@pytest.mark.parametrize("req,labels,matches", [
    ({"key": "gpu", "operator": "Exists"}, {"gpu": "x"}, True),
    ({"key": "gpu", "operator": "DoesNotExist"}, {"gpu": "x"}, False),
    ({"key": "n", "operator": "Gt", "values": ["3"]}, {"n": "4"}, True),
    ({"key": "n", "operator": "Lt", "values": ["3"]}, {"n": "4"}, False),
    ({"key": "n", "operator": "Gt", "values": ["3"]}, {"n": "four"}, False),
    ({"key": "zone", "operator": "NotIn", "values": ["a"]}, {}, True),
])
def test_node_selector_operators(req, labels, matches):
    assert w.selector_matches({"nodeSelectorTerms": [{"matchExpressions": [req]}]}, "node", labels) is matches
    # matchFields on the node's name; an empty term matches nothing
    assert w.selector_matches({"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node"]}]}]}, "node", {})
    assert not w.selector_matches({"nodeSelectorTerms": [{}]}, "node", labels)


# -- a pod's claims, allocated together (issue 41) -----------------------------------------------------
POD_CLAIMS = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: any-gpu}
spec: {spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.accel.dra.io}}]}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: first-gpu}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.accel.dra.io
        selectors: [{cel: {expression: 'device.attributes["accel.dra.io"].index == 0'}}]
---
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  resourceClaims: %s
  containers: [{name: c, image: busybox}]
"""


def _pod_file(tmp_path, entries: str) -> str:
    path = tmp_path / "pod.yaml"
    path.write_text(POD_CLAIMS % entries)
    return str(path)


def test_a_pods_claims_are_allocated_together_backtracking_across_them(tmp_path):
    # "any" is first: alone it takes GPU 0, which "first-gpu" needs; the scheduler goes back
    # and gives it GPU 1. Judged one by one, both would get GPU 0.
    pod = _pod_file(tmp_path, "[{name: any, resourceClaimTemplateName: any-gpu}, "
                              "{name: pinned, resourceClaimName: first-gpu}]")
    code, out, err = run("-f", pod, "--mock", "mixed", "-o", "json")
    assert code == 0, err
    body = {c["claim"]: c for c in json.loads(out)["claims"]}
    assert set(body) == {"default/trainer-any", "default/first-gpu"}  # each once, as the pod's
    assert [a["device"] for a in body["default/trainer-any"]["nodes"][0]["allocation"]] == ["gpu-0000-21-00-0"]
    assert [a["device"] for a in body["default/first-gpu"]["nodes"][0]["allocation"]] == ["gpu-0000-11-00-0"]
    assert "allocated together" in body["default/first-gpu"]["source"]


def test_a_pod_whose_claims_do_not_fit_together_names_the_one_that_cannot_be_placed(tmp_path):
    pod = _pod_file(tmp_path, "[{name: a, resourceClaimTemplateName: any-gpu}, "
                              "{name: b, resourceClaimTemplateName: any-gpu}, {name: c, resourceClaimName: first-gpu}]")
    code, out, _ = run("-f", pod, "--mock", "mixed", "-o", "json")
    assert code == 1
    nodes = {c["claim"]: c["nodes"][0] for c in json.loads(out)["claims"]}
    assert nodes["default/trainer-a"]["why"] == "the pod's claim default/first-gpu does not fit beside it on this node"
    assert nodes["default/first-gpu"]["why"].startswith(
        "it fits alone, but not beside the pod's claims before it (default/trainer-a, default/trainer-b), "
        "whatever devices they take")
    assert nodes["default/first-gpu"]["fits_when_free"] is True


def test_a_pod_naming_a_claim_that_is_not_in_the_file_is_one_line(tmp_path):
    pod = _pod_file(tmp_path, "[{name: a, resourceClaimTemplateName: any-gpu}, {name: b, resourceClaimName: nope}]")
    code, _, err = run("-f", pod, "--mock", "mixed")
    assert code == 2 and "Traceback" not in err
    assert err.strip().endswith("Pod trainer: spec.resourceClaims[1] (b): no ResourceClaim 'nope' in namespace "
                                "default in the file")


TAINT = [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
AFFINITY = ("affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: "
            "[{matchExpressions: [{key: pool, operator: In, values: [training]}]}]}}}")


@pytest.mark.parametrize("pod_spec,labels,node_taints,why", [
    ("nodeSelector: {pool: training}", {"pool": "inference"}, [],
     "the pod's nodeSelector pool=training does not match the node ('inference')"),
    ("nodeSelector: {pool: training}", {}, [], "the pod's nodeSelector pool=training does not match the node "
                                               "(no such label)"),
    (AFFINITY, {"pool": "inference"}, [], "the pod's required node affinity does not match the node's labels"),
    (AFFINITY, {"pool": "training"}, [], None),
    ("nodeSelector: {}", {}, TAINT, "the node's taint dedicated=ml:NoSchedule is not tolerated by the pod"),
    ("tolerations: [{key: dedicated, operator: Exists}]", {}, TAINT, None),
    ("nodeSelector: {}", {}, [dict(TAINT[0], effect="PreferNoSchedule")], None),
])
def test_a_pods_node_filters_decide_whether_the_node_is_a_candidate(tmp_path, pod_spec, labels, node_taints, why):
    text = (POD_CLAIMS % "[{name: a, resourceClaimTemplateName: any-gpu}, {name: b, resourceClaimName: first-gpu}]")
    text = text.replace("  containers:", f"  {pod_spec}\n  containers:")
    text += "---\n" + yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels},
                                      "spec": {"taints": node_taints}})
    path = tmp_path / "pod.yaml"
    path.write_text(text)
    code, out, err = run("-f", str(path), "--mock", "mixed", "-o", "json")
    nodes = [c["nodes"][0] for c in json.loads(out)["claims"]]
    if why is None:
        assert code == 0 and all(n["fits"] for n in nodes), err
    else:
        assert code == 1 and [n["why"] for n in nodes] == [why, why]
        assert all(n["fits_when_free"] is False and not n["alternatives"] for n in nodes)
