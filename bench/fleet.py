"""A fleet of fake nodes against the real kube-scheduler and kube-apiserver of
hack/local-cluster (issue 42): what our ResourceSlices cost the cluster, beside the
simplest shape a GPU driver publishes, in one run per node count.

    python -m bench fleet [--nodes 100,500] [--pods 200] [--shapes baseline,mixed,...]

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
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.realapi import _local_cluster

REPO = Path(__file__).resolve().parent.parent
DRIVER = "accel.dra.io"
BASELINE_DRIVER = "gpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SCHEDULER_QPS = 5000
PUBLISH_WORKERS = 8


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


def mock_inventory(shape: Shape):
    """The profile's inventory through the driver's own discovery (as `dra-driver run
    --mock PROFILE` finds it); every fake node of the shape has this one."""
    from driver.devices import mock
    from driver.devices.discovery import discover

    with tempfile.TemporaryDirectory(prefix="dra-fleet-") as scratch:
        node = mock.build(mock.load(shape.profile), Path(scratch) / "mock")
        s = node.sources()
        return discover(type(s)(s.sysfs, s.proc, s.nvml, s.nic_filter, s.pci_ids, shape.mig_mode)).inventory


def publisher_for(kube, shape: Shape, node: str, inventory):
    from driver.publish import slices
    from driver.publish.publisher import Publisher

    return Publisher(kube=kube, driver=shape.driver, node=node, inventory=lambda: inventory,
                     api_version="v1", sharing=shape.sharing, counters_layout=slices.SPLIT)


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
    etcd_growth: float = 0.0
    idle_writes: float = 0.0
    explain_s: float = 0.0
    explain_rc: int = -1
    workloads: dict[str, dict] = field(default_factory=dict)


class Fleet:
    def __init__(self, cluster, nodes: list[str], pods: int) -> None:
        from driver.kube.client import Kube

        self.c, self.nodes, self.pods = cluster, nodes, pods
        self.kube = Kube.deferred(cluster.admin_kubeconfig, connections=PUBLISH_WORKERS * 2)
        self.scheduler_port: int | None = None

    # API server and etcd metrics
    def apiserver(self):
        code, body = self.c.api("GET", "/metrics", timeout=60)
        return parse_metrics(body.get("raw", "")) if code == 200 else []

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
        publishers = [publisher_for(self.kube, shape, n, inventory) for n in self.nodes]
        before, etcd0 = self.slice_counts(self.apiserver()), self.etcd_size()
        t0 = time.monotonic()
        with ThreadPoolExecutor(PUBLISH_WORKERS) as pool:
            list(pool.map(lambda p: p.reconcile(), publishers))
        fig.publish_s = time.monotonic() - t0
        after = self.slice_counts(self.apiserver())
        fig.requests, fig.writes, fig.request_bytes, fig.throttled = (a - b for a, b in zip(after, before))
        fig.etcd_growth = self.etcd_size() - etcd0
        return publishers

    def idle(self, publishers: list, seconds: float, fig: Figures) -> None:
        """A window with nothing changing, then the resync every publisher does."""
        before = self.slice_counts(self.apiserver())
        time.sleep(seconds)
        with ThreadPoolExecutor(PUBLISH_WORKERS) as pool:
            ours = sum(pool.map(lambda p: p.reconcile(), publishers))
        after = self.slice_counts(self.apiserver())
        fig.idle_writes = max(after[1] - before[1], ours)

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
        """One DELETE of the collection (kubectl delete sends one DELETE per slice: 1,500
        of them at 500 mixed nodes took over 5 minutes on this machine), then wait."""
        self.c.api("DELETE", f"{SLICES}?fieldSelector=spec.driver%3D{shape.driver}", timeout=600)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            code, body = self.c.api("GET", f"{SLICES}?fieldSelector=spec.driver%3D{shape.driver}&limit=1")
            if code == 200 and not body.get("items"):
                return
            time.sleep(1)


def run_one(n: int, shapes: list[Shape], pods: int, idle_seconds: float) -> list[Figures]:
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
        fleet = Fleet(c, nodes, min(pods, n))
        results = []
        for shape in shapes:
            fig = Figures(shape.name, n)
            for obj in device_classes(shape):
                c.api("POST", "/apis/resource.k8s.io/v1/deviceclasses", obj)
            inventory = baseline_inventory() if shape.profile is None else mock_inventory(shape)
            publishers = fleet.publish(shape, inventory, fig)
            print(f"  {shape.name}: published {fig.slices_per_node} slices/node in {fig.publish_s:.1f}s "
                  f"({fig.writes:.0f} writes, {fig.throttled:.0f} 429s)", flush=True)
            fleet.idle(publishers, idle_seconds, fig)
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
    args = parser.parse_args(argv)
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
            figs = run_one(n, [SHAPES[s] for s in names], args.pods, args.idle_seconds)
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
