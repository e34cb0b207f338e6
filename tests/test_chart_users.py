"""The chart as a real user installs it (issue 40, item 6): where the DaemonSet lands under
Node Feature Discovery's labels, what `privileged: false` costs, the objects' names, and
the install steps in the READMEs.

Placement is judged on mock nodes: the labels NFD would set are computed from the mock
node's sysfs tree the way NFD's sources compute them (source/pci: `pci-<fields>.present`
for the whitelisted classes; source/custom's built-in `rdma.capable` for any PCI device of
vendor 15b3; source/network's `network-sriov.configured` for a NIC with sriov_numvfs > 0),
and the DaemonSet's rendered node affinity is evaluated against them as the scheduler does
(terms ORed, `In ["true"]`). NFD's network source also requires the interface to be up;
the mock tree has no `flags` files, so every interface counts as up.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from driver.devices import mock
from tests.conftest import REPO, discover_profile
from tests.test_chart import CHART, by_kind, container, render, validate_all

NFD = "feature.node.kubernetes.io/"
# NFD's own defaults (source/pci newDefaultConfig), with class 02 added as its docs
# suggest for NICs, and as NVIDIA's GPU operator deploys it (vendor-only labels).
NFD_DEFAULT = {"whitelist": ("03", "0b40", "12"), "fields": ("class", "vendor")}
NFD_WITH_NICS = {"whitelist": ("02", "03", "0b40", "12"), "fields": ("class", "vendor")}
NFD_GPU_OPERATOR = {"whitelist": ("02", "0200", "0207", "0300", "0302"), "fields": ("vendor",)}


def nfd_labels(sysfs: Path, whitelist: tuple[str, ...], fields: tuple[str, ...]) -> set[str]:
    labels = set()
    for function in (sysfs / "bus" / "pci" / "devices").iterdir():
        attrs = {"class": (function / "class").read_text().strip()[2:6],
                 "vendor": (function / "vendor").read_text().strip()[2:]}
        if any(attrs["class"].startswith(w) for w in whitelist):
            labels.add(f"{NFD}pci-{'_'.join(attrs[f] for f in fields)}.present")
        if attrs["vendor"] == "15b3":
            labels.add(f"{NFD}custom-rdma.capable")
    for iface in (sysfs / "class" / "net").iterdir():
        numvfs = iface / "device" / "sriov_numvfs"
        if numvfs.exists() and int(numvfs.read_text() or 0) > 0:
            labels.add(f"{NFD}network-sriov.configured")
    return labels


def placed(values: dict, labels: set[str]) -> bool:
    ds, _, _ = container(render(values))
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(all(e["operator"] == "In" and e["key"] in labels and "true" in e["values"]
                   for e in t["matchExpressions"]) for t in terms)


PLAIN_SERVER = """description: a web server, its one NIC carrying the default route
managementNic: {model: i350, ifName: eno1}
roots: []
"""
E810_WITH_VFS = """description: an Intel E810 with VFs configured beside the management NIC
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    devices:
      - {type: nic, model: e810, vfs: 8}
"""


def node(tmp_path: Path, profile: str):
    parsed = mock.load(profile) if profile in mock.builtin_profiles() else mock.parse(profile, "test")
    return discover_profile(parsed, tmp_path / "node")


def test_no_driver_pod_on_a_server_whose_only_device_is_an_intel_ethernet_port(tmp_path):
    """The chart listed pci-0200_8086 (any Intel Ethernet): with NICs whitelisted in NFD,
    a privileged driver pod ran on nearly every server, to publish nothing."""
    mock_node, result = node(tmp_path, PLAIN_SERVER)
    assert not result.inventory.devices, "the driver has nothing to publish there"
    for config in (NFD_DEFAULT, NFD_WITH_NICS, NFD_GPU_OPERATOR):
        labels = nfd_labels(mock_node.sysfs, **config)
        assert not placed({}, labels), (config, labels)
        assert not placed({"acceleratorNodes": {"sriovNics": True}}, labels)


@pytest.mark.parametrize("profile", mock.builtin_profiles())
def test_a_driver_pod_on_every_node_with_a_device_the_driver_offers(tmp_path, profile):
    """Every built-in mock node has a GPU, FPGA or RDMA NIC: placed under NFD's defaults,
    with NICs whitelisted, and with the GPU operator's vendor-only labels. The ConnectX
    nodes (sriov, sriov-large) were missed under NFD's defaults, which do not list class 02:
    NFD's built-in custom-rdma.capable finds them."""
    mock_node, result = node(tmp_path, profile)
    assert result.inventory.devices
    for config in (NFD_DEFAULT, NFD_WITH_NICS):
        assert placed({}, nfd_labels(mock_node.sysfs, **config)), config
    # The GPU operator's NFD lists no class 12: its nodes are found by their NVIDIA GPUs
    # and NICs, FPGA-only nodes only with NFD's own defaults.
    vendors = {(f / "vendor").read_text().strip() for f in (mock_node.sysfs / "bus" / "pci" / "devices").iterdir()}
    assert placed({}, nfd_labels(mock_node.sysfs, **NFD_GPU_OPERATOR)) == bool(vendors & {"0x10de", "0x15b3"})


def test_nodes_with_sriov_vfs_of_any_vendor_only_when_asked(tmp_path):
    mock_node, result = node(tmp_path, E810_WITH_VFS)
    assert any(d.name.startswith("nic-") for d in result.inventory.devices), "the E810 and its VFs"
    labels = nfd_labels(mock_node.sysfs, **NFD_WITH_NICS)
    assert f"{NFD}network-sriov.configured" in labels
    assert not placed({}, labels), "Intel Ethernet alone is no reason"
    assert placed({"acceleratorNodes": {"sriovNics": True}}, labels)
    notes = _notes({"acceleratorNodes": {"sriovNics": True}})
    assert f"{NFD}network-sriov.configured" in notes, "the notes list what places a pod"
    # extraLabels still add, and replacing `labels` keeps sriovNics.
    assert placed({"acceleratorNodes": {"labels": [], "sriovNics": True}}, labels)
    validate_all(render({"acceleratorNodes": {"sriovNics": True}}))


def _notes(values: dict | None = None, release: str = "dra") -> str:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name=release, namespace="dra-system", is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def bidirectional_in_unprivileged(objects: list[dict]) -> list[str]:
    """The API server's rule (pkg/apis/core/validation): Bidirectional mount propagation
    only in a privileged container."""
    bad = []
    for ds in by_kind(objects, "DaemonSet"):
        for c in ds["spec"]["template"]["spec"]["containers"]:
            if not (c.get("securityContext") or {}).get("privileged"):
                bad += [m["name"] for m in c["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    return bad


def test_privileged_false_says_what_it_costs():
    objects = render({"privileged": False})
    _, c, _ = container(objects)
    assert c["securityContext"]["privileged"] is False
    assert bidirectional_in_unprivileged(objects) == []
    plugins = {m["name"]: m for m in c["volumeMounts"]}["plugins"]
    assert "mountPropagation" not in plugins
    notes = _notes({"privileged": False})
    assert "privileged=false" in notes and "Bidirectional" in notes
    assert "mps_shm_not_tmpfs" in notes and "node's disk" in notes
    # The default is privileged, with the propagation, and says nothing of it.
    objects = render()
    assert {m["name"]: m for m in container(objects)[1]["volumeMounts"]}["plugins"][
        "mountPropagation"] == "Bidirectional"
    assert "privileged=false" not in _notes()


def names(release: str, values: dict | None = None) -> dict[tuple[str, str], dict]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name=release, namespace="dra-system", is_install=True)
    objects = [d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.parametrize("release, values, prefix", [
    ("dra-accel-driver", {}, "dra-accel-driver"),          # the README's release: no doubled name
    ("gpu-dra-accel-driver-prod", {}, "gpu-dra-accel-driver-prod"),
    ("dra", {}, "dra-dra-accel-driver"),                   # Helm's rule; the tests' and the tier's release
    ("team-a", {"nameOverride": "accel"}, "team-a-accel"),
    ("accel-x", {"nameOverride": "accel"}, "accel-x"),
    ("whatever", {"fullnameOverride": "dra"}, "dra"),
])
def test_object_names_follow_helms_fullname_convention(release, values, prefix):
    objects = names(release, values)
    for kind, name in objects:
        if kind == "DeviceClass":
            assert name.split(".", 1)[1] == "accel.dra.io", "claims reference DeviceClasses by name"
            continue
        assert name == prefix or name.startswith(prefix + "-"), (kind, name)
        assert "dra-accel-driver-dra-accel-driver" not in name
    assert ("DaemonSet", f"{prefix}-kubelet-plugin") in objects
    assert ("ClusterRole", prefix) in objects and ("ServiceAccount", prefix) in objects
    # The policies name the service account the pods really run as.
    policy = objects[("ValidatingAdmissionPolicy", f"{prefix}-own-node-slices")]
    assert f"system:serviceaccount:dra-system:{prefix}" in yaml.safe_dump(policy)
    validate_all(list(objects.values()))


def test_name_overrides_are_checked():
    chart = helm.Chart.load(str(CHART))
    for bad in ({"fullnameOverride": "Bad_Name"}, {"nameOverride": "x" * 41}, {"fullnameOverride": "-dra"}):
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="dra", namespace="x")


def install_steps(text: str) -> list[list[str]]:
    """The shell commands of every code block that runs `helm install`/`upgrade --install`."""
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    steps = []
    for block in blocks:
        if "helm install" not in block:
            continue
        commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]
        steps.append([c for c in commands if c])
    return steps


@pytest.mark.parametrize("page", ["README.md", "charts/dra-accel-driver/README.md", "hack/kind-up.sh"])
def test_install_steps_label_the_namespace_and_name_the_release_well(page):
    text = (REPO / page).read_text()
    steps = install_steps(text) if page.endswith(".md") else [
        [shlex.split(line) for line in text.replace("\\\n", " ").splitlines()
         if line.startswith(("kubectl", "helm"))]]
    assert steps, page
    for commands in steps:
        helm_at, helm_cmd = next((i, c) for i, c in enumerate(commands) if c[0] == "helm")
        args = helm_cmd[helm_cmd.index("--install") + 1 if "--install" in helm_cmd else 2:]
        release, namespace = args[0], helm_cmd[helm_cmd.index("--namespace") + 1]
        # The release name the page gives renders names that read well.
        assert all("dra-accel-driver-dra-accel-driver" not in n and not n.startswith(f"{release}-dra-accel-driver")
                   for _, n in names(release)), (page, release)
        # The namespace is labelled for privileged pods before the chart is installed, and
        # not made by helm, which would make it without the label.
        label = [c for c in commands[:helm_at] if c[:3] == ["kubectl", "label", "namespace"]]
        assert label and label[0][3] == namespace, (page, commands)
        assert "pod-security.kubernetes.io/enforce=privileged" in label[0], page
        assert "--create-namespace" not in helm_cmd, page
