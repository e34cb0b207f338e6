"""The chart's DaemonSet pod changed as users change it, with pods holding claims on the
node (issue 39, items 3 and 4): `helm upgrade` to a new image tag and `helm rollback`
with the chart's default update strategy (kubelet.seamlessUpgrade: maxSurge 1), a driver
pod deleted by hand and one whose PID 1 is killed, and `helm uninstall` with and without
a claim still prepared.

Figures asked of each rollout: restarts of running pods, failed prepares, claims prepared
twice, ResourceSlice writes by any driver pod (the API server's audit log) on an
unchanged inventory, and how long it took; they are written to the cluster's logs folder
(`driver-pod-figures.json`) and docs/testing.md quotes them.

One install serves the whole module (a shared MPS claim held by two pods, as in
examples/gpu-mps-shared-claim, lives through every case); the cases run in file order,
uninstall last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.cluster.driverhost import DRIVER, NAMESPACE
from tests.cluster.conftest import release_minor
from tests.cluster.driverpod import PodDriver
from tests.cluster.podlogs import PodLogs
from tests.cluster.workloads import apply, events, generated_claim, get, namespace, pod, wait, wait_running
from tests.conftest import REPO

# What a prepare that did work logs (driver/prepare/preparer.py); a repeated prepare of a
# claim whose spec is in place logs claim_already_prepared (debug) instead.
PREPARED = {"claim_prepared", "claim_reprepared", "claim_restored"}
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# The real kubelet's line each time it cannot open a registered plugin's health stream
# (tests/cluster/test_instances.py); it retries every 10 s while the registration stays.
HEALTH_STREAM_FAILED = "NodeWatchResources RPC call failed"
MPS_DAEMONS = "app.kubernetes.io/component=mps-control-daemon"
SHARED = REPO / "examples" / "gpu-mps-shared-claim" / "claim.yaml"
# The template the pods made during a rollout use: the node's other H100 (the shared MPS
# claim holds one), so they run one after another.
TEMPLATE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu"},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "dev", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}}}


@dataclass
class Node:
    """What the module's cases share: the release, the followed logs of every driver pod,
    the workload namespace with the shared claim's two pods."""
    cluster: object
    drv: PodDriver
    logs: PodLogs
    ns: str
    shared_uid: str
    figures: list[dict] = field(default_factory=list)

    def record(self, figures: dict) -> None:
        self.figures.append(figures)
        (self.cluster.logs / "driver-pod-figures.json").write_text(json.dumps(self.figures, indent=1))
        print(f"driver pod figures: {json.dumps(figures)}")


@pytest.fixture(scope="module")
def node(cluster, driver_image):
    drv = PodDriver(cluster, driver_image)
    logs = PodLogs(NAMESPACE).start()
    ns = None
    try:
        drv.install(profile="mixed")
        ns = namespace(cluster, "rollout")
        apply(cluster, ns, *[d for d in yaml.safe_load_all(SHARED.read_text()) if d], TEMPLATE)
        for name in ("mps-client-a", "mps-client-b"):
            wait_running(cluster, ns, name)
        uid = get(cluster, ns, "resourceclaim", "mps-gpu")["metadata"]["uid"]
        assert logs.claim_events(PREPARED, {uid}) == {uid: 1}, logs.text()
        yield Node(cluster, drv, logs, ns, uid)
    finally:
        if ns is not None:
            cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        if drv.pod is not None:
            drv.uninstall()
        logs.stop()


# --- what the cases look at ----------------------------------------------------------------

def pod_states(cluster, ns: str, selector: str | None = None) -> dict[str, tuple]:
    """name -> (uid, container IDs, restarts, phase) of the namespace's pods."""
    args = ["get", "pods", "-n", ns, "-o", "json"] + (["-l", selector] if selector else [])
    out = {}
    for p in json.loads(cluster.kubectl(*args).stdout)["items"]:
        st = p.get("status", {}).get("containerStatuses") or []
        out[p["metadata"]["name"]] = (p["metadata"]["uid"], tuple(c.get("containerID") for c in st),
                                      sum(c.get("restartCount", 0) for c in st), p["status"].get("phase"))
    return out


def workloads(node: Node) -> dict[str, tuple]:
    """The pods that must run through everything: the shared claim's two pods and the MPS
    control daemon the driver started for them."""
    states = {f"{node.ns}/{k}": v for k, v in pod_states(node.cluster, node.ns).items() if k.startswith("mps-client")}
    states.update({f"{NAMESPACE}/{k}": v for k, v in pod_states(node.cluster, NAMESPACE, MPS_DAEMONS).items()})
    return states


def our_slices(cluster) -> dict[str, tuple[str, str]]:
    """name -> (uid, resourceVersion): any write by anyone (the kubelet's deletions too)
    changes one."""
    items = json.loads(cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    return {s["metadata"]["name"]: (s["metadata"]["uid"], s["metadata"]["resourceVersion"])
            for s in items if s["spec"]["driver"] == DRIVER}


def audit_mark(cluster) -> int:
    return len(cluster.audit(f"system:serviceaccount:{NAMESPACE}:"))


def slice_writes(cluster, since: int) -> list[str]:
    """ResourceSlice writes by any service account of the driver's namespace (every driver
    pod: the audit policy logs them all) since the mark."""
    out = []
    for ev in cluster.audit(f"system:serviceaccount:{NAMESPACE}:")[since:]:
        ref = ev.get("objectRef", {})
        if (ref.get("resource") == "resourceslices" and ev.get("verb") in WRITE_VERBS
                and ev.get("stage", "ResponseComplete") == "ResponseComplete"):
            pod_name = ev.get("user", {}).get("extra", {}).get("authentication.kubernetes.io/pod-name", ["?"])
            out.append(f"{ev['verb']} {ref.get('name')} by {pod_name[0]}: {ev.get('responseStatus', {}).get('code')}")
    return out


def failed_prepares(cluster, ns: str) -> list[str]:
    return [line for line in events(cluster, ns).splitlines() if "FailedPrepare" in line]


def sockets(cluster) -> list[Path]:
    """Every socket file in the kubelet's registration folder and under the driver's
    plugin folder (its own socket, the MPS daemons' pipes)."""
    out = []
    for top in (cluster.kubelet_dir / "plugins_registry", cluster.kubelet_dir / "plugins" / DRIVER):
        for dirpath, _, files in os.walk(top):
            for f in files:
                p = Path(dirpath) / f
                try:
                    if stat.S_ISSOCK(p.lstat().st_mode):
                        out.append(p)
                except FileNotFoundError:
                    pass
    return out


def dead_sockets(cluster) -> list[Path]:
    """The driver's sockets in the kubelet's folders that nobody listens on (a killed
    instance's, which the kubelet keeps calling)."""
    dead = []
    kubelets = {cluster.kubelet_dir / "plugins_registry", cluster.kubelet_dir / "plugins" / DRIVER}
    for p in sockets(cluster):
        if p.name.startswith(".") or p.parent not in kubelets:
            continue  # private names: the hard link of a live public one (sockets.py); MPS pipes
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            try:
                s.connect(str(p))
            except FileNotFoundError:
                continue
            except OSError:
                dead.append(p)
    return dead


def cdi_specs(cluster) -> list[str]:
    return sorted(p.name for p in cluster.cdi_dir.glob(f"{DRIVER}-*"))


def kubelet_health_errors(cluster) -> int:
    text = (cluster.logs / "kubelet.log").read_text(errors="replace")
    return sum(1 for line in text.splitlines() if HEALTH_STREAM_FAILED in line)


@dataclass
class Churn:
    """Pods created one after another while a rollout runs, each with its own GPU claim:
    created, Running, deleted, the next one. Records what each one did."""
    cluster: object
    ns: str
    prefix: str
    done: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Churn":
        self._thread = threading.Thread(target=self._run, name=f"churn-{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(240)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            name = f"{self.prefix}-{i}"
            i += 1
            t0 = time.monotonic()
            try:
                apply(self.cluster, self.ns, pod(name, template="gpu"))
                p = wait_running(self.cluster, self.ns, name, 120)
                claim = get(self.cluster, self.ns, "resourceclaim", generated_claim(self.cluster, self.ns, name))
                self.done.append({"pod": name, "claim_uid": claim["metadata"]["uid"],
                                  "seconds": round(time.monotonic() - t0, 1),
                                  "restarts": sum(c.get("restartCount", 0)
                                                  for c in p["status"].get("containerStatuses", []))})
            except Exception as e:  # noqa: BLE001 - the case reports it
                self.errors.append(f"{name}: {e}")
            finally:
                self.cluster.kubectl("delete", "pod", "-n", self.ns, name, "--wait=true", "--timeout=90s",
                                     check=False)


def run_pod_with_claim(node: Node, name: str) -> str:
    """A new pod with its own GPU claim, Running; the claim's UID."""
    apply(node.cluster, node.ns, pod(name, template="gpu"))
    wait_running(node.cluster, node.ns, name)
    return get(node.cluster, node.ns, "resourceclaim", generated_claim(node.cluster, node.ns, name))["metadata"]["uid"]


def rollout(node: Node, what: str, change) -> dict:
    """change() (a helm upgrade or rollback) with pods running and new ones being made;
    waits until the new pod serves alone; returns the figures and checks them."""
    c, drv = node.cluster, node.drv
    before, slices_before, mark = workloads(node), our_slices(c), audit_mark(c)
    assert slices_before, "no slices of ours before the rollout"
    old_pod, old_uid = drv.pod, drv.uid
    churn = Churn(c, node.ns, what).start()
    t0 = time.monotonic()
    try:
        change()
    finally:
        seconds = time.monotonic() - t0
        # the pod being made when the rollout ended is the last one
        churn.stop()
    assert drv.uid != old_uid
    after, slices_after, writes = workloads(node), our_slices(c), slice_writes(c, mark)
    churned = {d["claim_uid"] for d in churn.done}
    twice = {u: n for u, n in node.logs.claim_events(PREPARED, churned | {node.shared_uid}).items()
             if n > 1 or u == node.shared_uid}
    # the kubelet talks to the new pod: a pod made now has its claim prepared by it
    probe = run_pod_with_claim(node, f"after-{what}")
    figures = {
        "what": what, "seconds": round(seconds, 1), "old_pod": old_pod, "new_pod": drv.pod,
        "pods_made_during": len(churn.done) + len(churn.errors),
        "restarts": sum(after[k][2] - before[k][2] for k in before if k in after)
        + sum(d["restarts"] for d in churn.done),
        "failed_prepares": len(failed_prepares(c, node.ns)) + len(churn.errors),
        "prepared_twice": sum(1 for n in twice.values() if n > 1),
        "slice_writes": len(writes),
    }
    node.record(figures)
    c.kubectl("delete", "pod", "-n", node.ns, f"after-{what}", "--wait=true", "--timeout=90s", check=False)

    assert churn.done and not churn.errors, (churn.errors, churn.done)
    assert after == before, f"running pods restarted or changed:\nbefore {before}\nafter  {after}"
    assert not failed_prepares(c, node.ns), failed_prepares(c, node.ns)
    failed = [line for line in node.logs.text(last=100000).splitlines() if '"claim_failed"' in line]
    assert not failed, "\n".join(failed)
    assert twice == {node.shared_uid: 1}, f"claims prepared more than once: {twice}\n{node.logs.text()}"
    assert all(n == 1 for n in node.logs.claim_events(PREPARED, churned).values())
    if release_minor() >= 33:
        # A 1.32 kubelet (no seamless upgrade: the pod is replaced in place) deletes the
        # driver's slices as soon as its only plugin unregisters (seen on the 1.32 tier),
        # so the pod that replaces it writes them again; from 1.33 they are taken over.
        assert not writes, f"ResourceSlice writes during the {what}: {writes}"
        assert slices_after == slices_before, (slices_before, slices_after)
    assert node.logs.who("claim_prepared", probe) == [drv.pod], node.logs.text()
    return figures


# --- the cases ----------------------------------------------------------------------------

def next_version(tag: str) -> str:
    """The release after this one: 0.1.0 -> 0.1.1 (any other tag gets a suffix)."""
    parts = tag.split(".")
    if len(parts) == 3 and all(x.isdigit() for x in parts):
        return f"{parts[0]}.{parts[1]}.{int(parts[2]) + 1}"
    return f"{tag}-next"


def test_helm_upgrade_and_rollback_with_pods_running(node):
    """Item 3: `helm upgrade` to a new tag of the image (the DaemonSet rolls: a version
    bump as the chart's user makes it), then `helm rollback` to the first revision."""
    c, drv = node.cluster, node.drv
    repository, _, tag = drv.image.rpartition(":")
    bumped = next_version(tag)
    c.ctr("images", "tag", "--force", drv.image, f"{repository}:{bumped}")
    # no registry to pull it again from: kept from the kubelet's image garbage collection
    c.ctr("images", "label", f"{repository}:{bumped}", "io.cri-containerd.pinned=pinned")
    first_values = json.loads(json.dumps(drv.values))

    up = rollout(node, "upgrade", lambda: drv.upgrade({"image": {"tag": bumped}}, slices_written=False))
    (image,) = {ctr["image"] for ctr in get(c, NAMESPACE, "pod", drv.pod)["spec"]["containers"]}
    assert image == f"{repository}:{bumped}"

    back = rollout(node, "rollback", lambda: drv.rollback(first_values, slices_written=False))
    (image,) = {ctr["image"] for ctr in get(c, NAMESPACE, "pod", drv.pod)["spec"]["containers"]}
    assert image == drv.image
    assert up["old_pod"] != back["new_pod"]


def container_pid(cluster, container_id: str) -> int:
    """The host PID of a container's init, as containerd knows it."""
    for line in cluster.ctr("tasks", "ls").stdout.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"container {container_id} has no task in containerd")


def test_a_driver_pod_deleted_and_one_killed_come_back(node):
    """Item 3: `kubectl delete pod` of the driver pod, then SIGKILL to the new pod's PID 1
    (from the host: the kernel ignores a SIGKILL that the namespace's own init is sent from
    inside). Each time the driver is back, claims stay prepared and nothing is prepared
    again, no socket is left dead, the kubelet's health-stream errors stop."""
    c, drv = node.cluster, node.drv
    before, slices_before, mark = workloads(node), our_slices(c), audit_mark(c)
    spec = c.cdi_dir / f"{DRIVER}-claim_{node.shared_uid}.json"
    assert spec.exists()
    content = spec.read_text()

    deleted_uid = drv.uid
    t0 = time.monotonic()
    c.kubectl("delete", "pod", "-n", NAMESPACE, drv.pod, "--wait=false")
    drv.wait_ready(120, not_uid=deleted_uid, slices_written=False)
    deleted_seconds = time.monotonic() - t0

    p = get(c, NAMESPACE, "pod", drv.pod)
    (st,) = p["status"]["containerStatuses"]
    container, restarts = st["containerID"].split("://", 1)[1], st.get("restartCount", 0)
    registrations = sum(1 for pod_name, ev in node.logs.events(drv.pod)
                        if ev.get("event") == "kubelet_registration_succeeded")
    t0 = time.monotonic()
    os.kill(container_pid(c, container), signal.SIGKILL)

    def back() -> bool:
        p = get(c, NAMESPACE, "pod", drv.pod)
        (st,) = p["status"]["containerStatuses"]
        return (st.get("restartCount", 0) > restarts and st.get("ready") is True
                and sum(1 for _, ev in node.logs.events(drv.pod)
                        if ev.get("event") == "kubelet_registration_succeeded") > registrations)
    wait("the killed driver container restarted, Ready and registered again", back, 120,
         explain=lambda: drv.describe())
    assert drv.registered()
    killed_seconds = time.monotonic() - t0

    # the kubelet talks to the pod again, and stops calling whatever died: no new
    # NodeWatchResources failure for three of its 10 s retry periods
    errors_at = kubelet_health_errors(c)
    probe = run_pod_with_claim(node, "after-kill")
    dead = dead_sockets(c)
    quiet_from = time.monotonic()
    while time.monotonic() - quiet_from < 30 and kubelet_health_errors(c) == errors_at:
        time.sleep(1)
    after, slices_after, writes = workloads(node), our_slices(c), slice_writes(c, mark)
    figures = {
        "what": "delete+kill", "deleted_back_seconds": round(deleted_seconds, 1),
        "killed_back_seconds": round(killed_seconds, 1),
        "restarts": sum(after[k][2] - before[k][2] for k in before if k in after),
        "failed_prepares": len(failed_prepares(c, node.ns)),
        "shared_claim_prepares": node.logs.claim_events(PREPARED, {node.shared_uid})[node.shared_uid],
        "dead_sockets": len(dead), "health_stream_errors_after": kubelet_health_errors(c) - errors_at,
        "slice_writes": len(writes), "slices_changed": slices_after != slices_before,
    }
    node.record(figures)
    c.kubectl("delete", "pod", "-n", node.ns, "after-kill", "--wait=true", "--timeout=90s", check=False)

    assert after == before, f"running pods restarted or changed:\nbefore {before}\nafter  {after}"
    assert spec.exists() and spec.read_text() == content
    assert figures["shared_claim_prepares"] == 1, node.logs.text()
    assert not failed_prepares(c, node.ns), failed_prepares(c, node.ns)
    assert not dead, f"sockets nobody listens on: {dead}"
    assert kubelet_health_errors(c) == errors_at, "the kubelet still fails a dead plugin's health stream"
    assert node.logs.who("claim_prepared", probe) == [drv.pod], node.logs.text()


def leftovers(node: Node) -> dict[str, list[str]]:
    """What the driver made on the node that is still there."""
    c = node.cluster
    return {
        "sockets": sorted(str(p) for p in sockets(c)),
        "registry": sorted(p.name for p in (c.kubelet_dir / "plugins_registry").iterdir()
                           if p.name.startswith((DRIVER, "dra-", ".s-"))),
        "cdi_specs": cdi_specs(c),
        "mps_daemons": sorted(pod_states(c, NAMESPACE, MPS_DAEMONS)),
        "driver_pods": sorted(p for p in pod_states(c, NAMESPACE) if p not in pod_states(c, NAMESPACE, MPS_DAEMONS)),
    }


def test_helm_uninstall_with_and_without_a_claim_prepared(node):
    """Item 4: uninstalled while the shared claim is prepared, the claim's CDI spec, its
    checkpoint entry and its MPS daemon stay (its pods still run on them: the chart
    README says so), and a later install unprepares it when its pods go; uninstalled with
    nothing prepared, nothing the driver made is left on the node."""
    c, drv = node.cluster, node.drv
    before = workloads(node)
    spec = f"{DRIVER}-claim_{node.shared_uid}.json"
    (daemon,) = pod_states(c, NAMESPACE, MPS_DAEMONS)

    slices, mark = our_slices(c), audit_mark(c)
    t0 = time.monotonic()
    drv.uninstall()
    first = time.monotonic() - t0
    left = leftovers(node)
    assert workloads(node) == before, "the claim's pods and daemon must run on"
    assert left["cdi_specs"] == [spec] and left["mps_daemons"] == [daemon], left
    assert not left["registry"] and not left["driver_pods"], left
    # the daemon's own pipe socket stays with it; no socket of the driver
    assert all("/mps/" in s for s in left["sockets"]), left["sockets"]

    # a later install finds the claim: its pods go, the new pod unprepares it
    t0 = time.monotonic()
    drv.install(profile="mixed", fresh_node=False, slices_written=False)
    reinstall = time.monotonic() - t0
    # the same node, the same inventory: the slices were left and are taken over as they are
    reinstall_writes = slice_writes(c, mark)
    if release_minor() >= 33:  # as in rollout(): a 1.32 kubelet deleted them at uninstall
        assert our_slices(c) == slices and not reinstall_writes, (slices, our_slices(c), reinstall_writes)
    c.kubectl("delete", "pod", "-n", node.ns, "mps-client-a", "mps-client-b", "--wait=true", "--timeout=90s")
    wait("the reinstalled pod unprepared the claim",
         lambda: node.logs.who("claim_unprepared", node.shared_uid) == [drv.pod], 60,
         explain=lambda: node.logs.text())
    wait("the MPS daemon gone", lambda: not pod_states(c, NAMESPACE, MPS_DAEMONS), 60)
    assert spec not in cdi_specs(c)

    t0 = time.monotonic()
    drv.uninstall()
    second = time.monotonic() - t0
    left = leftovers(node)
    # no driver registered: the kubelet deletes the node's slices of the driver after its
    # grace period (pkg/kubelet/cm/dra/plugin: a plugin gone for good)
    t0 = time.monotonic()
    while our_slices(c) and time.monotonic() - t0 < 90:
        time.sleep(1)
    left["resourceslices"] = sorted(our_slices(c))
    slices_gone = time.monotonic() - t0
    state = sorted(str(p.relative_to(c.kubelet_dir)) for p in (c.kubelet_dir / "plugins" / DRIVER).iterdir())
    node.record({"what": "uninstall", "with_claim_seconds": round(first, 1),
                 "reinstall_seconds": round(reinstall, 1), "reinstall_slice_writes": len(reinstall_writes),
                 "empty_seconds": round(second, 1), "slices_gone_after_seconds": round(slices_gone, 1),
                 "left": left, "state_dir": state})
    assert not any(left.values()), f"left on the node after helm uninstall: {left}"
