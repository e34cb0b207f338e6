"""Every example parses, validates strictly, and its selectors (DeviceClass + request CEL)
pick devices of the intended mock profile, and nothing of the wrong kind."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from driver.sim.allocator import Unsatisfiable, allocate
from driver.sim.cel import matches
from tests.conftest import REPO
from tests.test_chart import by_kind, render

EXAMPLES = REPO / "examples"
DRIVER = "accel.dra.io"
# example -> (profile that satisfies it, the kind every chosen device must be)
INTENT = {
    "gpu-single": ("mixed", {"gpu"}),
    "gpu-by-model": ("h100x8", {"gpu"}),
    "gpu-two": ("mixed", {"gpu"}),
    "gpu-shared": ("mixed", {"gpu"}),
    "gpu-nic-aligned": ("h100x8", {"gpu", "nic"}),
    "mig": ("a100-mig", {"mig"}),
    "fpga-by-shell": ("alveo", {"fpga"}),
    "sriov-vf-rdma": ("sriov", {"nic"}),
    "prioritized-gpu": ("l4", {"gpu"}),
}


@pytest.fixture(scope="module")
def classes():
    objects = by_kind(render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}}), "DeviceClass")
    return {c["metadata"]["name"]: [s["cel"]["expression"] for s in c["spec"]["selectors"]] for c in objects}


def load(name):
    docs = list(yaml.safe_load_all((EXAMPLES / name / "claim.yaml").read_text()))
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    return docs, template["spec"]["spec"]


def test_every_example_folder_is_covered():
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(INTENT)
    assert all((EXAMPLES / n / "README.md").exists() for n in INTENT)


@pytest.mark.parametrize("name", sorted(INTENT))
def test_example_validates(name):
    docs, _ = load(name)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Pod", "ResourceClaimTemplate"]
    for doc in docs:
        for version in ("1.34.0", "1.37.0"):
            kubernetes_validate.validate(doc, version, strict=True)
    pod = next(d for d in docs if d["kind"] == "Pod")
    claim_names = {c["name"] for c in pod["spec"]["resourceClaims"]}
    for c in pod["spec"]["containers"]:
        assert {r["name"] for r in c["resources"]["claims"]} <= claim_names


@pytest.mark.parametrize("name", sorted(INTENT))
def test_example_selects_the_intended_devices(name, built, classes):
    profile, kinds = INTENT[name]
    _, spec = load(name)
    inventory = built(profile)[1].inventory
    choices = allocate(spec, inventory, classes, DRIVER)
    chosen = [d for c in choices for d in c.devices]
    assert chosen and {d.kind.value for d in chosen} == kinds
    # No request selects a device of a kind it is not meant for, on any profile.
    for request in spec["devices"]["requests"]:
        alternatives = request.get("firstAvailable") or [request["exactly"]]
        for alt in alternatives:
            expressions = classes[alt["deviceClassName"]] + [s["cel"]["expression"] for s in alt.get("selectors", [])]
            for other in ("mixed", "a100-mig", "sriov", "alveo", "dfl", "l4"):
                for device in built(other)[1].inventory.devices:
                    if all(matches(e, device, DRIVER) for e in expressions):
                        assert device.kind.value in kinds, (name, device.name)


def test_alignment_and_priorities(built, classes):
    _, pair = load("gpu-nic-aligned")
    choices = allocate(pair, built("h100x8")[1].inventory, classes, DRIVER)
    roots = {d.attributes["resource.kubernetes.io/pcieRoot"] for c in choices for d in c.devices}
    assert len(roots) == 1
    with pytest.raises(Unsatisfiable):  # a NIC-only node has no GPU to pair
        allocate(pair, built("sriov")[1].inventory, classes, DRIVER)

    _, best = load("prioritized-gpu")
    assert allocate(best, built("h100x8")[1].inventory, classes, DRIVER)[0].request == "gpu/h100"
    assert allocate(best, built("a100-mig")[1].inventory, classes, DRIVER)[0].request == "gpu/a100"
    assert allocate(best, built("l4")[1].inventory, classes, DRIVER)[0].request == "gpu/l4"

    _, model = load("gpu-by-model")
    with pytest.raises(Unsatisfiable):
        allocate(model, built("a100-mig")[1].inventory, classes, DRIVER)
