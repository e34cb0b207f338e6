"""Every example parses, validates strictly, and its selectors (DeviceClass + request CEL)
pick devices of the intended mock profile, and nothing of the wrong kind."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from driver.prepare import opaque

from driver.publish import slices
from driver.devices import mock
from driver.devices.model import DeviceKind
from driver.scheduling.allocator import Shares, Unsatisfiable, allocate
from driver.scheduling.cel import matches
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
    "fpga-programmed": ("alveo", {"fpga"}),
    "sriov-vf-rdma": ("sriov", {"nic"}),
    "nic-in-pod": ("sriov", {"nic"}),
    "prioritized-gpu": ("l4", {"gpu"}),
    "gpu-timeslicing": ("mixed", {"gpu"}),
    "gpu-mps-shared-claim": ("mixed", {"gpu"}),
    "gpu-consumable": ("mixed", {"gpu"}),
    "mig-dynamic": ("h100x8", {"mig"}),
}
# Examples that need the driver's --mig-mode dynamic.
DYNAMIC_MIG = {"mig-dynamic"}
# Examples whose NicConfig only the driver's NRI plugin can carry out (addresses, MTU,
# routes): prepare refuses them on a node without it, as the demo's is.
NEEDS_NRI = {"nic-in-pod"}
CLAIM_KINDS = {"ResourceClaim", "ResourceClaimTemplate"}


@pytest.fixture(scope="module")
def classes():
    objects = by_kind(render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}}), "DeviceClass")
    return {c["metadata"]["name"]: [s["cel"]["expression"] for s in c["spec"]["selectors"]] for c in objects}


def claim_specs(docs) -> list[dict]:
    return [d["spec"]["spec"] if d["kind"] == "ResourceClaimTemplate" else d["spec"]
            for d in docs if d["kind"] in CLAIM_KINDS]


def load(name):
    docs = list(yaml.safe_load_all((EXAMPLES / name / "claim.yaml").read_text()))
    return docs, claim_specs(docs)[0]


def consumable_shares(inventory) -> Shares:
    """What `--gpu-sharing consumable` publishes for the GPUs of an inventory."""
    return Shares({d.name: slices.consumable_capacity(d) for d in inventory.devices
                   if d.kind is DeviceKind.GPU})


def test_every_example_folder_is_covered():
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(INTENT)
    assert all((EXAMPLES / n / "README.md").exists() for n in INTENT)


@pytest.mark.parametrize("name", sorted(INTENT))
def test_example_validates(name):
    docs, _ = load(name)
    kinds = {d["kind"] for d in docs}
    assert "Pod" in kinds and kinds & CLAIM_KINDS and kinds <= {"Pod"} | CLAIM_KINDS
    for doc in docs:
        for version in ("1.34.0", "1.37.0"):
            kubernetes_validate.validate(doc, version, strict=True)
    named = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for pod in (d for d in docs if d["kind"] == "Pod"):
        for ref in pod["spec"]["resourceClaims"]:
            if "resourceClaimTemplateName" in ref:
                assert ("ResourceClaimTemplate", ref["resourceClaimTemplateName"]) in named
            else:
                assert ("ResourceClaim", ref["resourceClaimName"]) in named
        claim_names = {c["name"] for c in pod["spec"]["resourceClaims"]}
        for c in pod["spec"]["containers"]:
            assert {r["name"] for r in c["resources"]["claims"]} <= claim_names
    # The driver decodes every opaque config of ours (as prepare will).
    for spec in claim_specs(docs):
        for config in spec["devices"].get("config", []):
            if config["opaque"]["driver"] == DRIVER:
                opaque.decode(config["opaque"]["parameters"])


@pytest.mark.parametrize("name", sorted(INTENT))
def test_example_selects_the_intended_devices(name, built, classes, tmp_path):
    profile, kinds = INTENT[name]
    _, spec = load(name)
    if name in DYNAMIC_MIG:
        from tests.test_dynamic_mig import dynamic

        inventory = dynamic(mock.build(mock.load(profile), tmp_path / "dyn")).inventory
    else:
        inventory = built(profile)[1].inventory
    choices = allocate(spec, inventory, classes, DRIVER, shares=consumable_shares(inventory))
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


def test_consumable_example_packs_three_shares_onto_one_gpu(built, classes):
    docs, _ = load("gpu-consumable")
    inventory = built("mixed")[1].inventory
    shares = consumable_shares(inventory)
    picked = []
    for spec in claim_specs(docs):
        (choice,) = allocate(spec, inventory, classes, DRIVER, shares=shares)
        picked.append((choice.devices[0].name, choice.consumed[0]))
    assert len({device for device, _ in picked}) == 1, picked
    assert all(consumed == {"memory": "20Gi", "compute": "30"} for _, consumed in picked)
    # A fourth 30 % share would exceed 100 % compute: it goes to the other GPU.
    (fourth,) = allocate(claim_specs(docs)[0], inventory, classes, DRIVER, shares=shares)
    assert fourth.devices[0].name != picked[0][0]
    # Without consumable publishing, capacity requests fit nowhere.
    with pytest.raises(Unsatisfiable):
        allocate(claim_specs(docs)[0], inventory, classes, DRIVER)
