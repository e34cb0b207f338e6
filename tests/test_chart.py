"""The Helm chart rendered by Helm's own engine (helm-python-sdk), validated with the
strict Kubernetes schemas; RBAC compared with the API calls the driver really makes."""

from __future__ import annotations

import argparse
import time
import uuid

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from driver.devices.model import DeviceKind
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.scheduling.cel import matches
from tests.conftest import REPO, discover_profile

CHART = REPO / "charts" / "dra-accel-driver"
DRIVER = "accel.dra.io"


def render(values: dict | None = None) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="dra", namespace="dra-system", is_install=True)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def validate_all(objects):
    for obj in objects:
        version = "1.32.0" if obj["apiVersion"].endswith("v1beta1") and obj["kind"] == "DeviceClass" else "1.34.0"
        kubernetes_validate.validate(obj, version, strict=True)
        if obj["apiVersion"] != "resource.k8s.io/v1beta1":
            kubernetes_validate.validate(obj, "1.37.0", strict=True)


def container(objects):
    (ds,) = by_kind(objects, "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return ds, c, {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_default_render_is_valid():
    objects = render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}})
    validate_all(objects)
    assert sorted(o["kind"] for o in objects) == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "DaemonSet",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",  # own slices; opaque configs
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",  # own-node pods
        "DeviceClass", "DeviceClass", "DeviceClass", "DeviceClass",
        "FlowSchema", "PriorityLevelConfiguration"])
    ds, c, env = container(objects)
    assert c["args"] == ["run"], "the image's ENTRYPOINT is dra-driver"
    assert ds["spec"]["template"]["spec"]["hostNetwork"] is False
    assert env["SYSFS_ROOT"] == "/host/sys" and env["PROC_ROOT"] == "/host/proc"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}, "seamless upgrade by default"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "MOCK_PROFILE" not in env
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"} <= mounts
    # Every env var the chart sets is an option the driver knows.
    from driver.service.config import OPTIONS

    # ... or NVIDIA_VISIBLE_DEVICES=void, which is for NVIDIA's container runtime, not us.
    known = {o.env for o in OPTIONS} | {"NVIDIA_VISIBLE_DEVICES"}
    assert set(env) <= known, set(env) - known


def host_ports_after_defaulting(pod_spec: dict) -> set[tuple[str, int]]:
    """What the API server stores: for a hostNetwork pod every containerPort becomes a
    hostPort of the same number (pkg/apis/core/v1 defaulting)."""
    ports = set()
    for c in pod_spec["containers"]:
        for p in c.get("ports") or []:
            host = p.get("hostPort") or (p["containerPort"] if pod_spec.get("hostNetwork") else 0)
            if host:
                ports.add((p.get("protocol", "TCP"), host))
    return ports


def schedulable_twice_on_one_node(pod_spec: dict) -> bool:
    """The scheduler's NodePorts filter: a second copy fits beside the first only if their
    host ports do not collide."""
    return not host_ports_after_defaulting(pod_spec)


def test_seamless_upgrade_pod_fits_twice_on_one_node():
    ds, c, env = container(render())
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 1
    assert schedulable_twice_on_one_node(ds["spec"]["template"]["spec"])
    # The probes address this pod's own port, so neither pod can answer for the other.
    assert c["readinessProbe"]["httpGet"]["port"] == "healthz"
    assert {p["name"] for p in c["ports"]} == {"metrics", "healthz"}
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["host-sys"]["hostPath"]["path"] == "/sys"
    assert volumes["host-proc"]["hostPath"]["path"] == "/proc"
    assert {m["name"]: m.get("readOnly") for m in c["volumeMounts"]}["host-sys"] is True

    # hostNetwork with seamless upgrades would hang every rollout: refused with a reason.
    with pytest.raises(helm.HelmError, match="hostNetwork=true cannot be combined"):
        render({"hostNetwork": True})
    # Without seamless upgrades the strategy is replace-in-place, as before.
    ds, c, env = container(render({"hostNetwork": True, "kubelet": {"seamlessUpgrade": False}}))
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert not schedulable_twice_on_one_node(spec)  # why the combination is refused
    assert "SYSFS_ROOT" not in env and "POD_UID" not in env


def test_by_default_only_accelerator_nodes():
    ds, _, _ = container(render())
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = [t["matchExpressions"][0]["key"] for t in terms]
    assert all(len(t["matchExpressions"]) == 1 for t in terms), "terms are ORed: any one label suffices"
    for vendor in ("10de", "10ee", "8086", "15b3"):
        assert any(k.startswith("feature.node.kubernetes.io/pci-") and k.endswith(f"_{vendor}.present")
                   for k in keys), vendor
    assert all(t["matchExpressions"][0]["values"] == ["true"] for t in terms)
    # Added to, or replaced.
    ds, _, _ = container(render({"acceleratorNodes": {"extraLabels": ["my.example.com/accel"]}}))
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[-1]["matchExpressions"][0]["key"] == "my.example.com/accel" and len(terms) == len(keys) + 1
    ds, _, _ = container(render({"acceleratorNodes": {"labels": ["my.example.com/accel"]}}))
    assert len(ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]) == 1
    own = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}]}}
    assert container(render({"affinity": own}))[0]["spec"]["template"]["spec"]["affinity"] == own
    for values in ({"acceleratorNodes": {"enabled": False}}, {"mock": {"enabled": True}}):
        assert "affinity" not in container(render(values))[0]["spec"]["template"]["spec"]
    validate_all(render({"acceleratorNodes": {"extraLabels": ["my.example.com/accel"]}}))


def test_mock_profile_is_validated_against_the_built_in_profiles():
    import json

    from driver.devices import mock

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["mock"]["properties"]["profile"]["enum"] == mock.builtin_profiles()
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="profile"):
        chart.render({"mock": {"enabled": True, "profile": "h100x9"}}, name="dra", namespace="x")


def test_every_name_starts_with_the_release():
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding", "DeviceClass", "FlowSchema",
                      "PriorityLevelConfiguration"}
    for release in ("dra", "team-a"):
        chart = helm.Chart.load(str(CHART))
        out = chart.render({}, name=release, namespace="ns", is_install=True)
        objects = [d for path, text in out.items() if not path.endswith(".txt")
                   for d in yaml.safe_load_all(text) if d]
        for obj in objects:
            name = obj["metadata"]["name"]
            if obj["kind"] == "DeviceClass":
                assert name.endswith(f".{DRIVER}"), "DeviceClass names are the public API"
                continue
            assert name.startswith(f"{release}-dra-accel-driver"), (obj["kind"], name)
        assert {o["kind"] for o in objects} >= cluster_scoped


def test_chart_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict) and value and key not in ("resources",):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    missing = [key for key in leaves(values) if f"| `{key}` |" not in readme]
    assert missing == []


def test_mock_mode_and_older_kubelets():
    objects = render({"mock": {"enabled": True, "profile": "h100x8"},
                      "kubelet": {"seamlessUpgrade": False, "rootDir": "/var/lib/k0s/kubelet"}})
    validate_all(objects)
    ds, c, env = container(objects)
    assert env["MOCK_PROFILE"] == "h100x8" and "POD_UID" not in env
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert env["KUBELET_PLUGINS_DIR"] == "/var/lib/k0s/kubelet/plugins"
    assert env["STATE_DIR"] == f"/var/lib/k0s/kubelet/plugins/{DRIVER}"
    assert "driver-root" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}


def test_the_fpga_bitstream_store_is_mounted_read_only_where_the_driver_is_told():
    """fpga.bitstreams.hostPath: the node's store, read-only, at the node's own path (so
    the driver's one-line errors name it), and --fpga-bitstreams set to it; off by default."""
    ds, c, env = container(render())
    assert "FPGA_BITSTREAMS" not in env and env["FPGA_PROGRAM_TIMEOUT"] == "35"
    assert "fpga-bitstreams" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    objects = render({"fpga": {"bitstreams": {"hostPath": "/opt/fpga/bitstreams"}, "programTimeoutSeconds": 20}})
    validate_all(objects)
    ds, c, env = container(objects)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "fpga-bitstreams"]
    assert mount == {"name": "fpga-bitstreams", "mountPath": "/opt/fpga/bitstreams", "readOnly": True}
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "fpga-bitstreams"]
    assert volume["hostPath"]["path"] == "/opt/fpga/bitstreams"
    # the driver takes what the chart sets
    import argparse

    from driver.service.config import add_arguments, build

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build(parser.parse_args([]), {k: v for k, v in env.items() if isinstance(v, str)})
    assert str(config.fpga_bitstreams) == "/opt/fpga/bitstreams" and config.fpga_program_timeout == 20
    chart = helm.Chart.load(str(CHART))
    for bad in ({"fpga": {"bitstreams": {"hostPath": "relative/store"}}}, {"fpga": {"programTimeoutSeconds": 41}}):
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="dra", namespace="x")


@pytest.mark.parametrize("api_version", ["resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"])
def test_device_class_api_version(api_version):
    classes = by_kind(render({"deviceClasses": {"apiVersion": api_version}}), "DeviceClass")
    assert {c["apiVersion"] for c in classes} == {api_version}
    for c in classes:
        kubernetes_validate.validate(c, "1.33.0" if api_version.endswith("beta2") else
                                     "1.32.0" if api_version.endswith("beta1") else "1.34.0", strict=True)


def test_values_schema_rejects_bad_values():
    chart = helm.Chart.load(str(CHART))
    for bad in ({"driverName": "Bad_Name"}, {"cdiRoot": "relative"}, {"logging": {"format": "xml"}},
                {"typo": 1}):
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="dra", namespace="x")


def test_mig_profiles_reach_the_driver_as_one_list():
    _, _, env = container(render({"migMode": "dynamic", "migProfiles": ["1g.10gb", "7g.80gb"]}))
    assert env["MIG_PROFILES"] == "1g.10gb,7g.80gb"
    from driver.service.config import add_arguments, build

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build(parser.parse_args([]), {"NODE_NAME": "n", "MIG_MODE": env["MIG_MODE"],
                                           "MIG_PROFILES": env["MIG_PROFILES"]})
    assert config.mig_profiles == frozenset({"1g.10gb", "7g.80gb"})
    assert container(render())[2]["MIG_PROFILES"] == "", "every profile by default"
    with pytest.raises(helm.HelmError):
        render({"migMode": "dynamic", "migProfiles": ["3g"]})


def test_device_classes_select_exactly_their_kind(built):
    classes = {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"]
               for c in by_kind(render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1"}}), "DeviceClass")}
    assert set(classes) == {f"{k}.{DRIVER}" for k in ("gpu", "mig", "fpga", "nic")}
    from driver.publish.deviceclasses import all_classes

    assert {k: [v] for k, v in classes.items()} == all_classes(DRIVER), "demo and chart agree"
    devices = [d for p in ("mixed", "a100-mig") for d in built(p)[1].inventory.devices]
    for name, expression in classes.items():
        kind = DeviceKind(name.split(".")[0])
        selected = {d.name for d in devices if matches(expression, d, DRIVER)}
        assert selected == {d.name for d in devices if d.kind is kind}, name
        assert not any(matches(expression, d, "other.example.com") for d in devices[:3])


def test_rbac_is_exactly_what_the_driver_calls(tmp_path):
    """Run the publisher (list, watch, writes, self-heal, cleanup) and prepare against the
    emulator, record every (verb, group, resource), compare with the ClusterRole."""
    from driver import cli
    from driver.prepare.claims import ClaimReader, ClaimRef
    from driver.kube.client import Kube, api_client
    from driver.publish.publisher import Publisher
    from tests.test_publisher import Holder, Running

    from driver.prepare.mps import MpsDaemons, MpsStarting
    from driver.prepare.setup import Setup
    from driver.sim.pods import PodRunner

    (role,) = by_kind(render(), "ClusterRole")
    allowed = {(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    node, result = discover_profile("mixed", tmp_path / "m")
    with ApiServer() as api:
        api.add_node("node-a")
        kube = Kube(api_client(api.kubeconfig(tmp_path)))
        holder = Holder(result.inventory)
        publisher = Publisher(kube, DRIVER, "node-a", inventory=lambda: holder.inventory)
        with Running(publisher.run):
            assert api.wait_for(lambda: len(api.state.slices) == 3)
            time.sleep(0.3)
            api.delete_slice(f"node-a-{DRIVER}-0-gpu-0")
            assert api.wait_for(lambda: len(api.state.slices) == 3)
            from driver.devices.model import Inventory

            holder.inventory = Inventory(tuple(d for d in result.inventory.devices if d.kind is not DeviceKind.FPGA))
            publisher.trigger()
            assert api.wait_for(lambda: len(api.state.slices) == 2)
        uid = str(uuid.uuid4())
        api.put_claim(claim_allocated("default", "c", uid, []))
        ClaimReader(kube).get(ClaimRef("default", "c", uid))
        # The pods an MPS claim is reserved for (driver/prepare/mpsusers.py).
        import asyncio

        async def read_pod():
            reader = ClaimReader(kube)
            try:
                return await reader.read_pod("default", "no-such-pod")
            finally:
                reader.gets.close()

        assert asyncio.run(read_pod()) is None
        # status.devices, written as after a prepare, against a 1.36 server.
        from driver.prepare.claimstatus import StatusWriter

        writer = StatusWriter(kube, DRIVER)
        writer.publish(ClaimRef("default", "c", uid), [])
        assert writer.wait_idle(10)
        writer.close()
        # An idle claim's Event (driver/monitoring/utilization/).
        from driver.monitoring.utilization.events import ClaimEvent, EventRecorder

        EventRecorder(kube, DRIVER, "node-a").post(ClaimEvent("default", "c", uid, "DeviceIdle",
                                                              "Idle", "idle"))
        assert cli.main(["cleanup", "--node-name", "node-a", "--kubeconfig", str(api.kubeconfig(tmp_path))]) == 0
        cluster_wide = set(api.state.access)
        api.state.access.clear()  # what follows is in the driver's namespace only
        # MPS control daemons: started, found, stopped, in the driver's namespace only.
        with PodRunner(api, "node-a", tmp_path / "pods"):
            daemons = MpsDaemons(kube, DRIVER, "node-a", "dra-system", "img", tmp_path / "state",
                                 node.driver_root, start_timeout=20)
            gpu = next(d for d in result.inventory.devices if d.kind is DeviceKind.GPU)
            with pytest.raises(MpsStarting) as starting:  # the pod is made; no wait under locks
                daemons.start(gpu.name, str(gpu.attributes["uuid"]), Setup("MPS"))
            daemons.wait_ready(gpu.name, starting.value.pod)
            assert len(daemons.pods()) == 1
            daemons.stop(gpu.name)
        namespaced = set(api.state.access)
    # The 1.36 subresource is granted for our driver's name only.
    (driver_rule,) = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule["resourceNames"] == [DRIVER]
    assert cluster_wide == allowed, \
        f"unused grants: {allowed - cluster_wide}; missing grants: {cluster_wide - allowed}"
    (mps_role,) = by_kind(render(), "Role")
    assert mps_role["metadata"]["namespace"] == "dra-system"
    granted = {(verb, group, resource) for rule in mps_role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    # what the ClusterRole already allows (pods get) is not granted a second time
    needed = namespaced - allowed
    assert needed == granted, f"unused: {granted - needed}; missing: {needed - granted}"


def test_dashboard_and_pod_monitor_render_when_enabled_and_query_what_the_driver_exports():
    import json
    import re

    assert not [o for o in render() if o["kind"] == "PodMonitor" or "dashboard" in o["metadata"]["name"]]
    objects = render({"metrics": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "GPUs"}},
                                  "podMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    (monitor,) = by_kind(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" == container(objects)[1]["ports"][0]["name"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    (ds,) = by_kind(objects, "DaemonSet")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    validate_all([config_map])
    dashboard = json.loads(config_map["data"]["dra-accel-driver.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Allocated vs idle per node", "Top idle claims", "Kernel time per claim"} <= titles
    assert "utilization_ratio" not in json.dumps(dashboard), "the deprecated names are not queried"
    # Every series a panel queries is one the driver exports, with labels it has.
    from tests.test_utilization import series_names

    exported = series_names()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(dra_driver_\w+)", target["expr"]):
                assert name in exported, (panel["title"], name)
    with pytest.raises(Exception, match="metrics.port"):
        render({"metrics": {"port": 0, "podMonitor": {"enabled": True}}})


def _notes(values: dict | None = None) -> str:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="dra", namespace="dra-system", is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def test_the_notes_say_where_the_pods_run_and_how_to_check():
    """Issue 29.8: the notes said "running on every node" while the DaemonSet runs only on
    nodes with Node Feature Discovery's labels."""
    notes = _notes()
    assert "every node" not in notes.split("\n\n")[0].splitlines()[0]
    assert "only on the nodes that Node Feature Discovery (or you) labels" in notes
    assert "feature.node.kubernetes.io/pci-0302_10de.present" in notes
    assert "kubectl get pods -n dra-system -l app.kubernetes.io/instance=dra -o wide" in notes
    assert "kubectl get nodes -L feature.node.kubernetes.io/pci-0302_10de.present" in notes
    assert "acceleratorNodes.enabled=false" in notes
    assert "on every node, with mock devices (mixed)" in _notes({"mock": {"enabled": True}})
    assert "on every node that matches nodeSelector" in _notes(
        {"acceleratorNodes": {"enabled": False}, "nodeSelector": {"pool": "gpu"}})
    assert "on the nodes your affinity value selects" in _notes({"affinity": {"nodeAffinity": {}}})


@pytest.mark.parametrize("values, fragment", [
    ({"acceleratorNodes": {"labels": []}}, "acceleratorNodes.labels and acceleratorNodes.extraLabels are both empty"),
    ({"acceleratorNodes": {"labels": None}}, "acceleratorNodes.labels and acceleratorNodes.extraLabels are both empty"),
    ({"metrics": {"port": 9401}}, "metrics.port and healthz.port are both 9401"),
    ({"metrics": {"port": 8080}, "healthz": {"port": 8080}}, "metrics.port and healthz.port are both 8080"),
])
def test_values_that_could_not_run_fail_the_render(values, fragment):
    with pytest.raises(Exception) as caught:
        render(values)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("values", [
    {"acceleratorNodes": {"labels": [], "extraLabels": ["example.com/accel"]}},
    {"acceleratorNodes": {"labels": [], "enabled": False}},
    {"acceleratorNodes": {"labels": []}, "mock": {"enabled": True}},
    {"acceleratorNodes": {"labels": []}, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}}}},
    {"metrics": {"port": 0, "podMonitor": {"enabled": False}}, "healthz": {"port": 9401}},
])
def test_neighbours_of_those_values_render_valid(values):
    objects = render(values)
    validate_all(objects)
    ds, _, _ = container(objects)
    terms = ((ds["spec"]["template"]["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": ["any"]})["nodeSelectorTerms"]
    assert terms, "never an empty or null nodeSelectorTerms"


def test_an_offline_render_gives_v1_device_classes():
    """`helm template` asks no cluster: Helm knows API groups then, but no kinds. The
    DeviceClasses are resource.k8s.io/v1 (1.34+), not v1beta1 (removed in 1.38)."""
    classes = by_kind(render(), "DeviceClass")
    assert {c["apiVersion"] for c in classes} == {"resource.k8s.io/v1"}
    validate_all(classes)
    explicit = by_kind(render({"deviceClasses": {"apiVersion": "resource.k8s.io/v1beta1"}}), "DeviceClass")
    assert {c["apiVersion"] for c in explicit} == {"resource.k8s.io/v1beta1"}


def test_the_driver_s_requests_get_a_priority_level_that_holds_a_fleet_s_herd():
    """Every driver pod is one APF flow (one user); with no schema of the chart's its
    requests land in workload-low, whose hand of 6 queues × 50 turned a 1,000-node start
    into ~1,000 queue-full 429s. The chart's level queues a request from every node."""
    import math

    objects = render()
    (schema,) = by_kind(objects, "FlowSchema")
    (level,) = by_kind(objects, "PriorityLevelConfiguration")
    (account,) = by_kind(objects, "ServiceAccount")
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    (rule,) = schema["spec"]["rules"]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {
        "name": account["metadata"]["name"], "namespace": "dra-system"}}]
    # ahead of the defaults that would otherwise take it, in kube-system too
    assert schema["spec"]["matchingPrecedence"] < 900
    queuing = level["spec"]["limited"]["limitResponse"]["queuing"]
    assert queuing["handSize"] * queuing["queueLengthLimit"] >= 1000
    # what the API server's validation asks of shuffle sharding
    assert queuing["handSize"] <= queuing["queues"]
    assert math.ceil(math.log2(queuing["queues"]) * queuing["handSize"]) <= 60
    validate_all([schema, level])
    assert not by_kind(render({"apiPriority": {"enabled": False}}), "FlowSchema")
