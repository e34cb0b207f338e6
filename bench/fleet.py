"""A fleet of fake nodes against the real kube-scheduler and kube-apiserver of
hack/local-cluster (issue 42): what our ResourceSlices cost the cluster, beside the
simplest shape a GPU driver publishes, in one run per node count.

    python -m bench fleet [--nodes 100,500] [--pods 200] [--shapes baseline,mixed,...]
                          [--credentials admin|driver|admin,driver] [--concurrency 8|all] [--publish-only]

For each N: the local cluster comes up (it takes the cluster lock), kwok keeps N fake nodes
Ready (hack/local-cluster's Cluster.add_fake_nodes), and then, shape by shape:

1. every fake node's slices are published through the driver's own code (mock discovery of
   the profile, driver.publish.publisher.Publisher's reconcile: GET node, LIST, POSTs) with
   the admin's credentials, 8 nodes at a time; the API server's own metrics give the
   requests, 429s and bytes it took, etcd's the database growth;
2. after an idle window every node's publisher reconciles once more (its resync): the
   slice writes it makes are the idle writes (0 expected);
3. `dra-driver explain` on a claim that fits nowhere, across the fleet (wall time);
4. per workload, claims and pods are created while kube-scheduler is stopped, then it is
   started (client QPS 5000, so its API writes do not bound it) and the pods are placed:
   pods/s from the first to the last placement, p50/p99 of its
   scheduler_scheduling_attempt_duration_seconds (a fresh process, so only these pods);
5. the slices are deleted before the next shape.

`--credentials driver` publishes as the fleet's DaemonSet would: the chart is installed
(its ServiceAccount, RBAC and own-node admission policy; its DaemonSet on no node) and
every fake node's publisher has its own client with a token of the chart's ServiceAccount
bound to that Node object, so API Priority and Fairness classifies the requests as a real
fleet's (no FlowSchema in the chart: `service-accounts`, priority level workload-low), and
the admission policy checks each node writes only its own slices. `--concurrency all`
starts every node's publisher at the same moment (the worst start-up herd: a fleet's
pods start over seconds). The publish figures then add the 429s the server answered and
the publishers' resends (Publisher's Retry-After handling), the APF counters of the
priority level the requests landed in, and the peak of its queue sampled during the
publish. `--publish-only` skips the idle window, explain and the workloads.

The baseline is what upstream's example driver publishes: 8 GPUs a node with four
attributes and a memory capacity, no counters, in one slice. Each of our figures is printed
as a ratio to the baseline's whole-GPU figure of the same run. Needs root, a built
hack/local-cluster and `hack/local-cluster/build.sh kwok`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.realapi import _local_cluster, token_kubeconfig

REPO = Path(__file__).resolve().parent.parent
DRIVER = "accel.dra.io"
BASELINE_DRIVER = "gpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SCHEDULER_QPS = 5000
PUBLISH_WORKERS = 8
CREDENTIALS = ("admin", "driver")
APF_SAMPLE_SECONDS = 0.25  # how often the API server's APF gauges are read during a publish


# -- shapes: what each fake node publishes ------------------------------------------------

@dataclass(frozen=True)
class Shape:
    name: str
    profile: str | None  # a mock profile; None: the baseline
    mig_mode: str = "static"
    sharing: str = "exclusive"
    workloads: tuple[str, ...] = ()
    driver: str = DRIVER


SHAPES = {
    "baseline": Shape("baseline", None, workloads=("gpu",), driver=BASELINE_DRIVER),
    "mixed": Shape("mixed", "mixed", workloads=("gpu", "aligned", "mix")),
    "consumable": Shape("consumable", "mixed", sharing="consumable", workloads=("share",)),
    "h100x8-dynamic-mig": Shape("h100x8-dynamic-mig", "h100x8", mig_mode="dynamic", workloads=("mig", "gpu")),
    "sriov-large": Shape("sriov-large", "sriov-large", workloads=("nic",)),
}


def baseline_inventory():
    """8 GPUs as the upstream example driver publishes them: index, uuid, model,
    driverVersion and a memory capacity, nothing else."""
    from driver.devices.model import Device, DeviceKind, Inventory, Version

    return Inventory(tuple(
        Device(f"gpu-{i}", DeviceKind.GPU, {"index": i, "uuid": f"gpu-{i:08x}-0000-0000-0000-000000000000",
                                            "model": "LATEST-GPU-MODEL", "driverVersion": Version("1.0.0")},
               {"memory": "80Gi"}) for i in range(8)))


def mock_inventory(shape: Shape, mig_profiles: frozenset[str] = frozenset()):
    """The profile's inventory through the driver's own discovery (as `dra-driver run
    --mock PROFILE [--mig-profiles ...]` finds it); every fake node of the shape has this one."""
    from driver.devices import mock
    from driver.devices.discovery import discover

    with tempfile.TemporaryDirectory(prefix="dra-fleet-") as scratch:
        node = mock.build(mock.load(shape.profile), Path(scratch) / "mock")
        s = node.sources()
        return discover(type(s)(s.sysfs, s.proc, s.nvml, s.nic_filter, s.pci_ids, shape.mig_mode,
                                s.owned_mig, s.away_netdevs, mig_profiles)).inventory


def publisher_for(kube, shape: Shape, node: str, inventory, api_version: str, server: tuple[int, int]):
    # A Publisher per node, each with its own retry state: nodes turned away by APF wait
    # and resend as the driver does (Publisher._request), not as the bench would. The
    # resource.k8s.io version and the server's release are asked once for the fleet (each
    # driver asks them once at its start, which the fleet's start-up would only add to);
    # the counters' layout follows the release, as the driver's does.
    from driver.publish.publisher import Publisher

    return Publisher(kube=kube, driver=shape.driver, node=node, inventory=lambda: inventory,
                     api_version=api_version, sharing=shape.sharing, server=server)


def device_classes(shape: Shape) -> list[dict]:
    from driver.publish.mocknode import class_objects

    if shape.profile is None:
        return [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                 "metadata": {"name": f"gpu.{BASELINE_DRIVER}"},
                 "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{BASELINE_DRIVER}"'}}]}}]
    return class_objects(shape.driver)


# -- workloads: one claim per pod ---------------------------------------------------------

def claim_spec(workload: str, shape: Shape, i: int) -> dict:
    """The claim's spec for pod number i of `workload`."""
    d = shape.driver
    one = lambda kind, **extra: {"name": kind, "exactly": {"deviceClassName": f"{kind}.{d}", **extra}}  # noqa: E731
    if workload == "gpu":
        return {"devices": {"requests": [one("gpu")]}}
    if workload == "nic":
        return {"devices": {"requests": [one("nic")]}}
    if workload == "share":
        return {"devices": {"requests": [one("gpu", capacity={"requests": {"memory": "10Gi", "compute": "10"}})]}}
    if workload == "mig":
        return {"devices": {"requests": [one("mig", selectors=[{"cel": {
            "expression": f'device.attributes["{d}"].profile == "1g.10gb"'}}])]}}
    if workload == "aligned":
        return {"devices": {"requests": [one("gpu"), one("nic")],
                            "constraints": [{"requests": ["gpu", "nic"],
                                             "matchAttribute": "resource.kubernetes.io/pcieRoot"}]}}
    if workload == "mix":
        return claim_spec(("gpu", "aligned")[i % 2], shape, i)
    raise ValueError(f"unknown workload {workload!r}")


def impossible_claim(shape: Shape) -> dict:
    """A claim no node can hold (more GPUs than a node has): explain walks every node."""
    return {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": f"gpu.{shape.driver}", "allocationMode": "ExactCount", "count": 64}}]}}


# -- metrics --------------------------------------------------------------------------------

def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition, read with
    prometheus_client's parser (as the driver's own metric tests read theirs)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples, name: str, **match: str | Callable[[str], bool]) -> float:
    def ok(labels: dict) -> bool:
        return all((v(labels.get(k, "")) if callable(v) else labels.get(k) == v) for k, v in match.items())
    return sum(v for n, labels, v in samples if n == name and ok(labels))


def quantile(samples, name: str, q: float, **match: str) -> float | None:
    """A quantile of a Prometheus histogram (linear within the bucket, as
    histogram_quantile does)."""
    buckets = sorted((float(labels["le"]), v) for n, labels, v in samples
                     if n == name + "_bucket" and all(labels.get(k) == x for k, x in match.items()))
    merged: dict[float, float] = {}
    for le, v in buckets:
        merged[le] = merged.get(le, 0) + v
    les = sorted(merged)
    if not les or merged[les[-1]] == 0:
        return None
    rank = q * merged[les[-1]]
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        if merged[le] >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(merged[le] - prev_count, 1e-9)
        prev_le, prev_count = le, merged[le]
    return les[-1]


def delta(after, before) -> list[tuple[str, dict[str, str], float]]:
    """Counter and histogram samples of `after` less those of `before` (same name and labels)."""
    was = {(n, tuple(sorted(labels.items()))): v for n, labels, v in before}
    return [(n, labels, v - was.get((n, tuple(sorted(labels.items()))), 0.0)) for n, labels, v in after]


def apf_figures(before, after, peaks: dict[str, float]) -> dict:
    """Where the publish's requests landed in API Priority and Fairness and what it did to
    them: the (flow schema, priority level) that dispatched the most requests in the window
    (ours: nothing else runs then but the cluster's own components, which are exempt or in
    other levels), its rejections by reason, its wait in queue (p99) and the queue's peak."""
    d = delta(after, before)
    dispatched: dict[tuple[str, str], float] = {}
    for n, labels, v in d:
        if n == "apiserver_flowcontrol_dispatched_requests_total" and v > 0:
            key = (labels.get("flow_schema", ""), labels.get("priority_level", ""))
            dispatched[key] = dispatched.get(key, 0.0) + v
    if not dispatched:
        return {}
    (schema, level), count = max(dispatched.items(), key=lambda kv: kv[1])
    rejected = {labels.get("reason", ""): v for n, labels, v in d
                if n == "apiserver_flowcontrol_rejected_requests_total" and v > 0
                and labels.get("priority_level") == level}
    wait = quantile(d, "apiserver_flowcontrol_request_wait_duration_seconds", 0.99,
                    priority_level=level, execute="true")
    return {"flow_schema": schema, "priority_level": level, "dispatched": count,
            "rejected": rejected, "rejected_all_levels": total(d, "apiserver_flowcontrol_rejected_requests_total"),
            "wait_p99_ms": 1000 * (wait or 0.0),
            "inqueue_peak": peaks.get(f"inqueue/{level}", 0.0), "executing_peak": peaks.get(f"executing/{level}", 0.0),
            "seats_peak": peaks.get(f"seats/{level}", 0.0),
            "seats_limit": total(after, "apiserver_flowcontrol_nominal_limit_seats", priority_level=level),
            "seats_limit_now": total(after, "apiserver_flowcontrol_current_limit_seats", priority_level=level),
            "others": {f"{k[0]}/{k[1]}": v for k, v in dispatched.items() if k != (schema, level)}}


class ApfSampler:
    """Reads the API server's APF gauges every APF_SAMPLE_SECONDS while a publish runs and
    keeps each priority level's peak of requests in queue and executing (the gauges
    alone; the rest of /metrics is not parsed, so the sampling takes little of the CPU the
    publishers need)."""

    GAUGES = {"apiserver_flowcontrol_current_inqueue_requests": "inqueue",
              "apiserver_flowcontrol_current_executing_requests": "executing",
              # requests occupy seats by their width (a LIST of many objects up to 10,
              # a write one plus its watchers' share): what the level's limit counts
              "apiserver_flowcontrol_current_executing_seats": "seats"}

    def __init__(self, fetch: Callable[[], str]) -> None:
        self.fetch, self.peaks = fetch, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apf-sampler", daemon=True)

    def __enter__(self) -> "ApfSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(APF_SAMPLE_SECONDS):
            try:
                text = self.fetch()
            except OSError:
                continue
            lines = "\n".join(line for line in text.splitlines()
                               if line.split("{", 1)[0] in self.GAUGES)
            now: dict[str, float] = {}
            for name, labels, v in parse_metrics(lines):
                key = f"{self.GAUGES[name]}/{labels.get('priority_level', '')}"
                now[key] = now.get(key, 0.0) + v  # summed over the level's flow schemas
            for key, v in now.items():
                self.peaks[key] = max(self.peaks.get(key, 0.0), v)


class DriverCredentials:
    """The chart installed (ServiceAccount, RBAC, admission policies; its DaemonSet on no
    node) and, per fake node, a client with a token of the chart's ServiceAccount bound to
    that Node: the identity a DaemonSet pod on that node has.

    Bound to the Node rather than to a pod: a pod-bound token needs the pod, and a
    DaemonSet's pods on kwok's nodes would be N more objects and watches with nothing to
    run. What the server does with the request is the same either way: the user is the
    ServiceAccount (which is what APF's `service-accounts` FlowSchema matches and
    distinguishes flows by), and the token carries the node's name, which the chart's
    own-node policy checks on every slice write (tests/cluster/driverhost.py's `token`
    makes the same choice for the host-process driver)."""

    def __init__(self, cluster, scratch: Path) -> None:
        sys.path.insert(0, str(REPO))
        from tests.cluster.driverhost import NAMESPACE, install, service_account

        objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                                    "mock": {"enabled": True}})
        self.cluster, self.scratch = cluster, scratch
        self.namespace, self.account = NAMESPACE, service_account(objects)
        self.user = f"system:serviceaccount:{NAMESPACE}:{self.account}"

    def token(self, node: str, uid: str, seconds: int = 7200) -> str:
        code, body = self.cluster.api(
            "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{self.account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": seconds,
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}}})
        if code != 201:
            raise RuntimeError(f"TokenRequest for node {node}: {code} {body.get('message', body)}")
        return body["status"]["token"]

    def kubes(self, nodes: list[str]) -> dict[str, object]:
        """A client per node (its own connection, as each node's driver has)."""
        from driver.kube.client import Kube

        import local_cluster

        code, listing = self.cluster.api(
            "GET", f"/api/v1/nodes?labelSelector={local_cluster.FAKE_NODE_LABEL}%3D{local_cluster.FAKE_NODE_VALUE}",
            timeout=120)
        uids = {n["metadata"]["name"]: n["metadata"]["uid"] for n in listing.get("items") or []}

        def one(node: str):
            kubeconfig = token_kubeconfig(self.cluster, self.scratch / node, self.token(node, uids[node]))
            kube = Kube.deferred(kubeconfig, connections=2)
            # Made now, not by the first request inside the timed publish: 1,000 clients
            # (kubeconfig, TLS context) cost ~25 ms of this one process's CPU each on 2
            # loaded cores, which each node's driver spends on its own CPU.
            kube.connect()
            return node, kube

        with ThreadPoolExecutor(PUBLISH_WORKERS) as pool:
            return dict(pool.map(one, nodes))


# -- the run --------------------------------------------------------------------------------

@dataclass
class Figures:
    shape: str
    nodes: int
    slices_per_node: int = 0
    bytes_per_node: int = 0
    publish_s: float = 0.0
    requests: float = 0.0
    writes: float = 0.0
    request_bytes: float = 0.0
    throttled: float = 0.0  # 429s
    credentials: str = "admin"
    concurrency: int = PUBLISH_WORKERS
    resends: int = 0  # requests the publishers sent again after a 429
    longest_wait_s: float = 0.0  # the longest wait before one of those
    failed_passes: int = 0  # reconciles that failed (retried after the run loop's backoff)
    # why they failed: the error's first words -> count
    failures: dict[str, int] = field(default_factory=dict)
    without_owner: int = 0  # nodes whose GET node failed: slices published without their owner reference
    apf: dict = field(default_factory=dict)  # priority level, rejected, dispatched, queue peak
    etcd_growth: float = 0.0
    idle_writes: float = 0.0
    # one attribute of one device changed on one node: that node's reconcile (a fresh
    # publisher: it LISTs its node's slices first, as a driver does after a restart; a running
    # driver's watch keeps that copy and skips the LIST)
    change_requests: float = 0.0
    change_writes: float = 0.0
    change_bytes: float = 0.0
    explain_s: float = 0.0
    explain_rc: int = -1
    workloads: dict[str, dict] = field(default_factory=dict)


class Fleet:
    def __init__(self, cluster, nodes: list[str], pods: int, credentials: str = "admin",
                 concurrency: int = PUBLISH_WORKERS) -> None:
        from driver.kube.client import Kube

        self.c, self.nodes, self.pods = cluster, nodes, pods
        self.credentials, self.concurrency = credentials, concurrency
        self.kube = Kube.deferred(cluster.admin_kubeconfig, connections=max(PUBLISH_WORKERS * 2, concurrency))
        self.node_kubes: dict[str, object] = {}
        if credentials == "driver":
            t0 = time.monotonic()
            self._scratch = tempfile.TemporaryDirectory(prefix="dra-fleet-tokens-")
            creds = DriverCredentials(cluster, Path(self._scratch.name))
            self.node_kubes = creds.kubes(nodes)
            print(f"  chart installed, {len(nodes)} node-bound tokens of {creds.user} in "
                  f"{time.monotonic() - t0:.0f}s", flush=True)
        self.scheduler_port: int | None = None

    # API server and etcd metrics
    def apiserver(self):
        return parse_metrics(self.apiserver_text())

    def apiserver_text(self) -> str:
        code, body = self.c.api("GET", "/metrics", timeout=60)
        if code != 200:
            raise OSError(f"GET /metrics: {code}")
        return body.get("raw", "")

    def _reconcile(self, publisher, fig: Figures, lock: threading.Lock) -> int:
        """One node's first publish as its driver's run loop makes it: a failed pass (a
        request throttled past Publisher's resends, say) is retried after the loop's
        backoff, never before the server's Retry-After."""
        from driver.kube.client import ApiError
        from driver.publish.publisher import BACKOFF_BASE, BACKOFF_CAP

        rng = random.Random()
        for failures in range(1, 9):
            try:
                return publisher.reconcile()
            except ApiError as err:
                with lock:
                    fig.failed_passes += 1
                    why = " ".join(str(err).split()[:12])
                    fig.failures[why] = fig.failures.get(why, 0) + 1
                delay = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1)) * rng.uniform(0.5, 1.0)
                # getattr: the same bench runs the publisher of before Retry-After was read
                time.sleep(max(delay, getattr(err, "retry_after", None) or 0.0))
        return publisher.reconcile()

    def etcd_size(self) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.c.ports['etcd']}/metrics", timeout=10) as r:
                return total(parse_metrics(r.read().decode()), "etcd_mvcc_db_total_size_in_use_in_bytes")
        except OSError:
            return 0.0

    def slice_counts(self, samples) -> tuple[float, float, float, float]:
        """(requests, writes, request body bytes, 429s) on resourceslices, so far."""
        rs = {"resource": "resourceslices"}
        writes = lambda v: v in ("POST", "PUT", "PATCH", "DELETE", "CREATE", "UPDATE", "APPLY")  # noqa: E731
        return (total(samples, "apiserver_request_total", **rs),
                total(samples, "apiserver_request_total", verb=writes, **rs),
                total(samples, "apiserver_request_body_size_bytes_sum", **rs),
                total(samples, "apiserver_request_total", code="429"))

    def publish(self, shape: Shape, inventory, fig: Figures) -> list:
        from driver.publish import slices

        built = slices.build(inventory, slices.PoolIdentity(shape.driver, self.nodes[0]), 1,
                             sharing=shape.sharing, layout=slices.SPLIT)
        fig.slices_per_node = len(built)
        fig.bytes_per_node = len(json.dumps(built))
        version, server = self.kube.resource_version(), self.kube.server_version()
        publishers = [publisher_for(self.node_kubes.get(n, self.kube), shape, n, inventory, version, server)
                      for n in self.nodes]
        fig.credentials, fig.concurrency = self.credentials, self.concurrency
        samples0, etcd0 = self.apiserver(), self.etcd_size()
        before = self.slice_counts(samples0)
        lock = threading.Lock()
        with ApfSampler(self.apiserver_text) as sampler:
            t0 = time.monotonic()
            with ThreadPoolExecutor(self.concurrency) as pool:
                list(pool.map(lambda p: self._reconcile(p, fig, lock), publishers))
            fig.publish_s = time.monotonic() - t0
        samples1 = self.apiserver()
        after = self.slice_counts(samples1)
        fig.requests, fig.writes, fig.request_bytes, fig.throttled = (a - b for a, b in zip(after, before))
        fig.etcd_growth = self.etcd_size() - etcd0
        fig.resends = sum(getattr(p.stats, "throttled", 0) for p in publishers)
        fig.longest_wait_s = max((getattr(p.stats, "throttle_wait_max", 0.0) for p in publishers), default=0.0)
        fig.apf = apf_figures(samples0, samples1, sampler.peaks)
        # their next pass rewrites every slice to add it: writes the start-up owes
        fig.without_owner = sum(p.node_uid is None for p in publishers)
        return publishers

    def idle(self, publishers: list, seconds: float, fig: Figures) -> None:
        """A window with nothing changing, then the resync every publisher does."""
        before = self.slice_counts(self.apiserver())
        time.sleep(seconds)
        with ThreadPoolExecutor(PUBLISH_WORKERS) as pool:
            ours = sum(pool.map(lambda p: p.reconcile(), publishers))
        after = self.slice_counts(self.apiserver())
        fig.idle_writes = max(after[1] - before[1], ours)

    def one_change(self, shape: Shape, inventory, fig: Figures) -> None:
        """One attribute of one device on one node changes (as a NIC's linkState does when
        its link drops): what that node's publisher sends, then the same to change it back."""
        import dataclasses

        device = next((d for d in inventory.devices if "linkState" in d.attributes), inventory.devices[0])
        name = "linkState" if "linkState" in device.attributes else next(
            k for k, v in device.attributes.items() if isinstance(v, str))
        changed = dataclasses.replace(device, attributes={**device.attributes, name: f"{device.attributes[name]}-changed"})
        after = type(inventory)(tuple(changed if d is device else d for d in inventory.devices),
                                inventory.counter_sets)
        node = self.nodes[0]
        before = self.slice_counts(self.apiserver())
        version, server = self.kube.resource_version(), self.kube.server_version()
        publisher_for(self.kube, shape, node, after, version, server).reconcile()
        changed_counts = self.slice_counts(self.apiserver())
        publisher_for(self.kube, shape, node, inventory, version, server).reconcile()
        fig.change_requests, fig.change_writes, fig.change_bytes = (
            a - b for a, b in zip(changed_counts[:3], before[:3]))

    def explain(self, shape: Shape, fig: Figures, namespace: str) -> None:
        name = "fleet-impossible"
        self.c.api("POST", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
                   {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name}, "spec": impossible_claim(shape)})
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "driver", "explain", name, "-n", namespace,
                            "--kubeconfig", str(self.c.admin_kubeconfig), "-o", "json"],
                           capture_output=True, text=True, cwd=REPO, timeout=600,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        fig.explain_s, fig.explain_rc = time.monotonic() - t0, p.returncode
        if p.returncode not in (0, 1):
            print(f"  explain failed ({p.returncode}): {p.stderr.strip()[-400:]}", flush=True)
        self.c.api("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")

    def scheduler_metrics(self):
        # its serving certificate is self-signed; the admin's client certificate passes
        # its delegated authentication (system:masters may read /metrics anyway)
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.load_cert_chain(str(self.c.pki / "admin.crt"), str(self.c.pki / "admin.key"))
        with urllib.request.urlopen(f"https://127.0.0.1:{self.scheduler_port}/metrics", context=ctx,
                                    timeout=10) as r:
            return parse_metrics(r.read().decode())

    def workload(self, shape: Shape, workload: str, namespace: str) -> dict:
        """Claims and pods made while the scheduler is stopped, then placed by a fresh one."""
        import local_cluster

        self.c.stop_scheduler()
        claims = "/apis/resource.k8s.io/v1/namespaces/" + namespace + "/resourceclaims"

        def make(i: int) -> None:
            name = f"{workload}-{i:05d}"
            code, body = self.c.api("POST", claims, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                     "metadata": {"name": name},
                                                     "spec": claim_spec(workload, shape, i)})
            if code != 201:
                raise RuntimeError(f"claim {name}: {code} {body.get('message', body)}")
            code, body = self.c.api("POST", f"/api/v1/namespaces/{namespace}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"nodeSelector": {local_cluster.FAKE_NODE_LABEL: local_cluster.FAKE_NODE_VALUE},
                         "tolerations": [local_cluster.FAKE_NODE_TOLERATION],
                         "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "d"}]}}],
                         "resourceClaims": [{"name": "d", "resourceClaimName": name}]}})
            if code != 201:
                raise RuntimeError(f"pod {name}: {code} {body.get('message', body)}")

        with ThreadPoolExecutor(PUBLISH_WORKERS) as pool:
            list(pool.map(make, range(self.pods)))
        # Not waiting for /readyz (polled every 0.5 s it let all pods be placed unseen):
        # its port serves before its informers have synced, and it places nothing before.
        self.scheduler_port = self.c.restart_scheduler(SCHEDULER_QPS, wait=False)
        start = last = None
        deadline = time.monotonic() + max(120.0, self.pods / 2)
        scheduled, samples = 0.0, []
        while time.monotonic() < deadline:
            before = time.monotonic()
            try:
                samples = self.scheduler_metrics()
            except OSError:  # not listening yet
                time.sleep(0.02)
                continue
            scheduled = total(samples, "scheduler_schedule_attempts_total", result="scheduled")
            if not scheduled:
                start = before  # the last scrape that saw none placed: placing began after it
            elif scheduled >= self.pods:
                last = time.monotonic()
                break
            time.sleep(0.02)
        attempts = "scheduler_scheduling_attempt_duration_seconds"
        algorithm = "scheduler_scheduling_algorithm_duration_seconds"
        out = {"placed": scheduled,
               "unschedulable": total(samples, "scheduler_schedule_attempts_total", result="unschedulable"),
               "p50_ms": 1000 * (quantile(samples, attempts, 0.5, result="scheduled") or 0),
               "p99_ms": 1000 * (quantile(samples, attempts, 0.99, result="scheduled") or 0),
               "algo_p50_ms": 1000 * (quantile(samples, algorithm, 0.5) or 0),
               "algo_p99_ms": 1000 * (quantile(samples, algorithm, 0.99) or 0)}
        # From the last scrape that saw nothing placed to the first that saw all: at most
        # one scrape (a few ms) more than the scheduler took, the same for every shape.
        out["pods_s"] = scheduled / (last - start) if start and last else 0.0
        self.cleanup(namespace)
        return out

    def cleanup(self, namespace: str) -> None:
        self.c.kubectl("delete", "pods", "--all", "-n", namespace, "--force", "--grace-period=0",
                       "--wait=true", timeout=600, check=False)
        self.c.kubectl("delete", "resourceclaims", "--all", "-n", namespace, "--wait=true", timeout=600, check=False)

    def unpublish(self, shape: Shape) -> None:
        """DELETEs of the collection (kubectl delete sends one DELETE per slice: 1,500
        of them at 500 mixed nodes took over 5 minutes on this machine) until none is left.
        The server stops one at its request timeout (60 s) with the connection closed and
        the rest still there: 7,000 slices of h100x8 at 1,000 nodes, 192 MiB, took longer."""
        selector = f"{SLICES}?fieldSelector=spec.driver%3D{shape.driver}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                self.c.api("DELETE", selector, timeout=120)
            except OSError:  # closed at the server's request timeout: what is left goes next round
                pass
            code, body = self.c.api("GET", f"{selector}&limit=1")
            if code == 200 and not body.get("items"):
                return
            time.sleep(1)
        raise RuntimeError(f"{shape.name}: slices still there after 15 minutes of deleting")


def run_one(n: int, shapes: list[Shape], pods: int, idle_seconds: float, credentials: str = "admin",
            concurrency: int | None = PUBLISH_WORKERS, publish_only: bool = False) -> list[Figures]:
    """One N. concurrency None: every node's publisher at once. credentials: "admin",
    "driver", or (publish only) both, "admin,driver": each shape published by each in turn
    on the same cluster, for a comparison within one run."""
    lc = _local_cluster()
    c = lc.Cluster()
    t0 = time.monotonic()
    c.up()
    try:
        namespace = "fleet"
        c.api("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        nodes = c.add_fake_nodes(n)
        print(f"N={n}: cluster up and {n} fake nodes Ready in {time.monotonic() - t0:.0f}s", flush=True)
        # At most one pod per node: the mixed profile has 2 GPUs a node, so this fills half
        # of them, and every shape meets the same pods on the same nodes (a fuller fleet
        # costs more per pod; that would be measuring the fill, not the shape).
        fleets = [Fleet(c, nodes, min(pods, n), who, concurrency or n) for who in credentials.split(",")]
        results = []
        for shape in shapes:
            for obj in device_classes(shape):
                c.api("POST", "/apis/resource.k8s.io/v1/deviceclasses", obj)
            inventory = baseline_inventory() if shape.profile is None else mock_inventory(shape)
            for fleet in fleets:
                fig = Figures(shape.name, n)
                publishers = fleet.publish(shape, inventory, fig)
                print(f"  {shape.name}: published {fig.slices_per_node} slices/node in {fig.publish_s:.1f}s "
                      f"({fig.writes:.0f} writes, {fig.throttled:.0f} 429s; as {fleet.credentials}, "
                      f"{fleet.concurrency} at once: {fig.resends} resends, longest wait {fig.longest_wait_s:.1f}s, "
                      f"{fig.failed_passes} failed passes, {fig.without_owner} nodes' slices without "
                      f"their owner reference)", flush=True)
                print(f"  {shape.name}: APF {json.dumps(fig.apf)}", flush=True)
                for why, count in sorted(fig.failures.items(), key=lambda kv: -kv[1])[:3]:
                    print(f"  {shape.name}: {count} passes failed: {why}", flush=True)
                if publish_only:
                    fleet.unpublish(shape)
                    results.append(fig)
            if publish_only:
                continue
            (fleet,) = fleets
            fleet.idle(publishers, idle_seconds, fig)
            fleet.one_change(shape, inventory, fig)
            print(f"  {shape.name}: one device's attribute changed on one node: {fig.change_requests:.0f} "
                  f"requests, {fig.change_writes:.0f} writes, {fig.change_bytes / 1024:.1f} KiB sent", flush=True)
            fleet.explain(shape, fig, namespace)
            # each figure as soon as it is measured: a run cut short still tells them
            print(f"  {shape.name}: {fig.requests:.0f} requests, {fig.request_bytes / 2**20:.1f} MiB sent, "
                  f"etcd +{fig.etcd_growth / 2**20:.1f} MiB, {fig.idle_writes:.0f} idle writes, "
                  f"explain {fig.explain_s:.2f}s (exit {fig.explain_rc})", flush=True)
            for w in shape.workloads:
                fig.workloads[w] = fleet.workload(shape, w, namespace)
                print(f"  {shape.name}/{w}: {fig.workloads[w]}", flush=True)
            fleet.unpublish(shape)
            results.append(fig)
        return results
    finally:
        try:
            c.remove_fake_nodes()
        finally:
            c.down()


def print_table(figs: list[Figures]) -> None:
    base = next((f for f in figs if f.shape == "baseline"), None)
    bw = (base.workloads.get("gpu") or {}) if base else {}
    n = figs[0].nodes if figs else 0
    print(f"\nN = {n} fake nodes (ratios: to the baseline's whole-GPU figure of this run)")
    print(f"{'shape':<20} {'slices/node':>11} {'KiB/node':>9} {'publish s':>9} {'requests':>8} {'writes':>7} "
          f"{'MiB sent':>8} {'429s':>5} {'etcd MiB':>8} {'idle writes':>11} {'explain s':>9}")
    for f in figs:
        print(f"{f.shape:<20} {f.slices_per_node:>11} {f.bytes_per_node / 1024:>9.1f} {f.publish_s:>9.1f} "
              f"{f.requests:>8.0f} {f.writes:>7.0f} {f.request_bytes / 2**20:>8.1f} {f.throttled:>5.0f} "
              f"{f.etcd_growth / 2**20:>8.1f} {f.idle_writes:>11.0f} {f.explain_s:>9.2f}")
    print(f"{'shape (start-up publish)':<24} {'as':>6} {'at once':>7} {'resends':>7} {'longest wait s':>14} "
          f"{'failed passes':>13} {'APF level':>14} {'rejected':>8} {'queue peak':>10} {'executing peak':>14} "
          f"{'seats peak/limit':>16} {'wait p99 ms':>11}")
    for f in figs:
        a = f.apf or {}
        print(f"{f.shape:<24} {f.credentials:>6} {f.concurrency:>7} {f.resends:>7} {f.longest_wait_s:>14.1f} "
              f"{f.failed_passes:>13} {a.get('priority_level', '?'):>14} {a.get('rejected_all_levels', 0):>8.0f} "
              f"{a.get('inqueue_peak', 0):>10.0f} {a.get('executing_peak', 0):>14.0f} "
              f"{'%.0f/%.0f' % (a.get('seats_peak', 0), a.get('seats_limit_now') or a.get('seats_limit', 0)):>16} "
              f"{a.get('wait_p99_ms', 0):>11.1f}")
    print(f"{'shape/workload':<30} {'pods/s':>8} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99 ratio':>9} "
          f"{'algo p50':>8} {'algo p99':>8} {'ratio':>6} {'placed':>7}")
    for f in figs:
        for w, r in f.workloads.items():
            ratio = r["pods_s"] / bw["pods_s"] if bw.get("pods_s") else float("nan")
            p99r = r["p99_ms"] / bw["p99_ms"] if bw.get("p99_ms") else float("nan")
            algr = r["algo_p99_ms"] / bw["algo_p99_ms"] if bw.get("algo_p99_ms") else float("nan")
            print(f"{f.shape + '/' + w:<30} {r['pods_s']:>8.1f} {ratio:>6.2f} {r['p50_ms']:>8.1f} "
                  f"{r['p99_ms']:>8.1f} {p99r:>9.2f} {r['algo_p50_ms']:>8.1f} {r['algo_p99_ms']:>8.1f} "
                  f"{algr:>6.2f} {r['placed']:>7.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fleet")
    parser.add_argument("--nodes", default="100,500", help="fake node counts, one run each (default: 100,500)")
    parser.add_argument("--pods", type=int, default=200, help="pods placed per workload, at most one per node (default: 200)")
    parser.add_argument("--shapes", default="baseline,mixed,consumable,h100x8-dynamic-mig",
                        help=f"of {','.join(SHAPES)} (baseline always runs first)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="the idle window (default: 20)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--credentials", default="admin",
                        help="publish as the admin (system:masters, exempt from API Priority and Fairness; "
                             "the default) or as the driver: the chart's ServiceAccount, a node-bound token per "
                             "node; with --publish-only also 'admin,driver' (both in turn, same cluster)")
    parser.add_argument("--concurrency", default=str(PUBLISH_WORKERS),
                        help=f"node publishers running at once, or 'all' (every node at the same moment) "
                             f"(default: {PUBLISH_WORKERS})")
    parser.add_argument("--publish-only", action="store_true",
                        help="only the start-up publish of each shape: no idle window, explain or workloads")
    args = parser.parse_args(argv)
    who = args.credentials.split(",")
    if not who or any(w not in CREDENTIALS for w in who) or len(set(who)) != len(who):
        parser.error(f"--credentials {args.credentials}: admin, driver, or admin,driver")
    if len(who) > 1 and not args.publish_only:
        parser.error(f"--credentials {args.credentials}: both in one run only with --publish-only")
    if args.concurrency == "all":
        concurrency = None
    elif args.concurrency.isdigit() and int(args.concurrency) > 0:
        concurrency = int(args.concurrency)
    else:
        parser.error(f"--concurrency {args.concurrency}: a positive number of publishers, or 'all'")
    try:
        counts = [int(x) for x in args.nodes.split(",") if x]
    except ValueError:
        parser.error(f"--nodes {args.nodes}: a comma-separated list of node counts")
    unknown = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    names = ["baseline"] + [s for s in args.shapes.split(",") if s and s != "baseline"]
    from driver import logs

    logs.configure("console", "warning")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"pods per workload {args.pods}, idle window {args.idle_seconds:.0f}s", flush=True)
    everything = []
    for n in counts:
        try:
            figs = run_one(n, [SHAPES[s] for s in names], args.pods, args.idle_seconds, args.credentials,
                           concurrency, args.publish_only)
        except Exception as err:  # the local cluster's ClusterError (not built, not root, ...)
            if type(err).__name__ != "ClusterError":
                raise
            print(f"python -m bench fleet: N={n}: {err}", file=sys.stderr)
            return 1
        print_table(figs)
        everything += [f.__dict__ for f in figs]
        if args.json:
            args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
