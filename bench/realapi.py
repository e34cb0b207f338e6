"""The prepare benchmark against the real kube-apiserver of hack/local-cluster, beside the
same measurement against our API emulator (driver/sim/apiserver.py), in one run:

    python3 -m bench.realapi [--runs 200]

What is measured, the same way on both servers: prepare p50/p99 of one claim with one
device and its ratio to the floor (gRPC round trip + claim GET + the two writes, sampled
between the prepares, bench/floor.py), and the throughput of 256 claims in one request
and of 64 concurrent one-claim requests (bench/prepare.py's shapes); then, against the
real server only, bursts of 64 one-claim prepares beside the API floor of the same burst
(the same claim GETs and status applies, no driver), in alternating rounds, with where each
claim's time went (bench/burst.py; `--only-burst` for these alone). The driver process
is the same (`dra-driver run --mock mixed`, the bench's fake kubelet); only the server it
reads claims from and writes status to changes. Against the real server the driver uses
the chart's ServiceAccount with the chart's RBAC and a node-bound token (as on a node),
and claims are made as users make them (a create, then the allocation written to status,
as the scheduler does).

Needs root and a built hack/local-cluster (hack/local-cluster/build.sh); takes the cluster
lock (/tmp/dra-cluster.lock, the one the cluster tier's runs take) and starts and stops the
cluster itself. Why both: a figure measured against an emulator depends on the emulator
(issue 30); the real server settles which figure a user gets.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench import burst as bench_burst
from bench.floor import Floor
from bench.harness import DRIVER, GPU, Driver, file_system, new_claim, settle, wait
from bench.table import Table, pct
from driver import logs
from driver.kube import releases
from driver.sim.apiserver import ApiServer
from driver.sim.kubelet import Claim, FakeKubelet

REPO = Path(__file__).resolve().parent.parent
LOCK = "/tmp/dra-cluster.lock"
# bench.floor.Floor puts its claim in `default` and GETs it there: the claims go there too.
NAMESPACE = "default"
# The emulator's node: any name; the real cluster's: its node, which the driver's token is
# bound to (the chart's own-node policy lets it write only that node's slices).
EMULATOR_NODE = "bench-node"


def token_kubeconfig(cluster, directory: Path, token: str) -> Path:
    """A kubeconfig in `directory` for the local cluster's API server that authenticates
    with `token` (a ServiceAccount's, as a driver pod's), from a token file beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token)
    path = directory / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": cluster.server,
                                               "certificate-authority": str(cluster.pki / "ca.crt")}}],
        "users": [{"name": "u", "user": {"tokenFile": str(directory / "token")}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c"}))
    return path


def _local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "hack" / "local-cluster" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass
class _RealState:
    """What bench.harness reads of the emulator's state: a request counter (settle waits
    for it to stand still) and the node's slices."""
    api: "RealApi"

    @property
    def requests(self) -> int:
        # every request of the driver's service account lands in the audit log
        # (hack/local-cluster's policy), so its size moves with the driver's traffic
        try:
            return (self.api.cluster.logs / "audit.log").stat().st_size
        except OSError:
            return 0

    @property
    def slices(self) -> dict:
        code, body = self.api.cluster.api(
            "GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={self.api.node}")
        return {s["metadata"]["name"]: s for s in body.get("items", [])} if code == 200 else {}


@dataclass
class RealApi:
    """The parts of driver.sim.apiserver.ApiServer that the bench uses, on the real API
    server: a kubeconfig for the driver, claims put in place, the state above."""
    cluster: object
    token: str
    node: str
    state: _RealState = field(init=False)

    def __post_init__(self) -> None:
        self.state = _RealState(self)

    def kubeconfig(self, directory: Path) -> Path:
        return token_kubeconfig(self.cluster, directory, self.token)

    def put_claim(self, claim: dict) -> str:
        """Create the claim as a user would (a valid spec: each request of the allocation
        asks the chart's GPU class, with admin access where the result has it), then write
        its allocation to status as the scheduler does. Returns the server's UID."""
        results = claim["status"]["allocation"]["devices"]["results"]
        admin = {r["request"].split("/")[0]: r.get("adminAccess") is True for r in results}
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": claim["metadata"]["name"], "namespace": NAMESPACE},  # as Floor's
                "spec": {"devices": {"requests": [
                    {"name": n, "exactly": {"deviceClassName": "gpu.accel.dra.io",
                                            **({"adminAccess": True} if a else {})}}
                    for n, a in admin.items()]}}}
        base = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        code, created = self.cluster.api("POST", base, body)
        if code != 201:
            raise RuntimeError(f"create claim {NAMESPACE}/{body['metadata']['name']}: {code} {created}")
        created["status"] = claim["status"]
        code, updated = self.cluster.api("PUT", f"{base}/{body['metadata']['name']}/status", created)
        if code != 200:
            raise RuntimeError(f"allocate claim {NAMESPACE}/{body['metadata']['name']}: {code} {updated}")
        return created["metadata"]["uid"]


def admin_namespace(cluster, admin: bool) -> None:
    """Label NAMESPACE for admin access (or take the label away) with the key the cluster's
    release checks: real_claim's claims ask for admin access."""
    label = releases.admin_access_label(releases.parse(cluster.vers["KUBERNETES_VERSION"]))
    if label is not None:
        cluster.kubectl("label", "namespace", NAMESPACE, f"{label}=true" if admin else f"{label}-",
                        "--overwrite", check=admin)


def real_claim(api: RealApi, device: str = GPU) -> Claim:
    """bench.harness.new_claim's claim on the real server: the same allocation (the mixed
    node's first GPU, admin access), the UID the server gave it. The node selector is the
    scheduler's for a node-local device: without it the claim is no node's, and the API
    server refuses the driver's status apply (422: a node-bound ServiceAccount may write
    `status.devices` only of claims allocated on its node; from Kubernetes 1.36)."""
    name = f"c-{uuid.uuid4().hex[:8]}"
    uid = api.put_claim({"metadata": {"name": name}, "status": {"allocation": {
        "devices": {"results": [{"request": "r", "driver": DRIVER, "pool": api.node, "device": device,
                                 "adminAccess": True}], "config": []},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [api.node]}]}]}}}})
    return Claim(NAMESPACE, name, uid)


@dataclass
class Figures:
    prep: list[float]
    floor: float
    batch: float
    concurrent: float


def measure(api, make_claim, runs: int, scratch: Path, node: str, slices: int,
            namespace: str = "default", burst=None, only_burst: bool = False,
            checkout: Path | None = None) -> Figures | None:
    """bench/prepare.py's first figures: one-claim prepare latency against the floor
    sampled between the prepares, then the batch and concurrent throughput. `namespace`:
    the driver's own (where it looks for MPS control daemon pods at start); on the real
    server the chart's, the only one its ServiceAccount may read pods in. `burst`: called
    with the driver and its kubelet at the end (the burst against its floor)."""
    driver = Driver(api, "mixed", node=node, extra=["--namespace", namespace], checkout=checkout)
    driver.start()
    try:
        kubelet: FakeKubelet = driver.kubelet()
        if not wait(lambda: len(api.state.slices) == slices, 120):
            raise RuntimeError(f"the driver published no slices: {(driver.dir / 'log').read_text()[-2000:]}")
        time.sleep(1.0)
        if only_burst:
            burst(driver, kubelet)
            kubelet.close()
            return None
        prep = []
        between = Floor(api, scratch)
        for _ in range(runs):
            claim = make_claim()
            t = time.perf_counter()
            response = kubelet.prepare([claim])
            prep.append(time.perf_counter() - t)
            assert response.claims[claim.uid].error == "", response
            kubelet.unprepare([claim])
            between.sample()
        floor = between.prepare()
        between.close()

        batch = [make_claim() for _ in range(256)]
        settle(api)
        t = time.perf_counter()
        response = kubelet.prepare(batch, timeout=120)
        batch_rate = 256 / (time.perf_counter() - t)
        assert all(not e.error for e in response.claims.values()), response
        kubelet.unprepare(batch, timeout=120)
        singles = [make_claim() for _ in range(64)]
        settle(api)
        t = time.perf_counter()
        responses = kubelet.prepare_each(singles, timeout=120)
        concurrent_rate = 64 / (time.perf_counter() - t)
        assert not any(r.claims[c.uid].error for c, r in zip(singles, responses)), responses
        kubelet.unprepare(singles, timeout=120)
        if burst is not None:
            burst(driver, kubelet)
        kubelet.close()
        return Figures(prep, floor, batch_rate, concurrent_rate)
    finally:
        driver.stop()


def rows(table: Table, label: str, f: Figures) -> None:
    p = table.latency(f"prepare: 1 claim, 1 device ({label})", f.prep, f"floor {f.floor * 1000:.3f} ms")
    table.value(f"prepare / floor ({label})", f"{p / f.floor:.2f}x", f"p99 {pct(f.prep, 0.99) / f.floor:.2f}x")
    table.value(f"throughput: 256 claims in one request ({label})", f"{f.batch:.0f} claims/s")
    table.value(f"throughput: 64 concurrent 1-claim requests ({label})", f"{f.concurrent:.0f} claims/s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.realapi", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200,
                        help="prepares measured against each API server (the real one and the "
                             "emulator) for each figure (default: 200)")
    parser.add_argument("--burst-rounds", type=int, default=5,
                        help="bursts of 64 one-claim prepares against the real server, each beside "
                             "a burst of its API floor (default: 5)")
    parser.add_argument("--driver-checkout", type=Path, default=None, metavar="DIR",
                        help="run the driver of this source tree against the real server (a "
                             "before/after: e.g. `git archive HEAD | tar -x -C DIR`)")
    parser.add_argument("--only-burst", action="store_true",
                        help="only the bursts against the real server (no emulator, no one-claim "
                             "latency, no batch)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if os.geteuid() != 0:
        print("bench.realapi: needs root (the local cluster's kubelet, containerd, mounts)", file=sys.stderr)
        return 2
    logs.configure("console", "warning")
    lc = _local_cluster()
    scratch = Path(tempfile.mkdtemp(prefix="dra-bench-real-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.platform()}; runs={args.runs}; driver from {args.driver_checkout or REPO}", flush=True)
    print(f"driver directories under {scratch.parent}: {file_system(scratch)}", flush=True)
    table = Table()

    bursts = None
    # the emulator first, while nothing else runs
    if not args.only_burst:
        with ApiServer() as api:
            api.add_node(EMULATOR_NODE)
            emulated = measure(api, lambda: new_claim(api, node=EMULATOR_NODE), args.runs, scratch,
                               EMULATOR_NODE, 3)

    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one cluster per machine; the tier's runs take it too
        cluster = lc.Cluster()
        try:
            cluster.check_built()
            t0 = time.monotonic()
            cluster.up()
            print(f"local cluster up in {time.monotonic() - t0:.1f}s "
                  f"(Kubernetes {cluster.vers['KUBERNETES_VERSION']})", flush=True)
            sys.path.insert(0, str(REPO))
            from tests.cluster.driverhost import NAMESPACE as DRIVER_NAMESPACE
            from tests.cluster.driverhost import install, service_account, token

            objects = install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                                        "mock": {"enabled": True}})
            # admin access (claims side by side on one GPU, as bench.harness.new_claim's)
            # needs the namespace's label
            admin_namespace(cluster, True)
            real = RealApi(cluster, token(cluster, service_account(objects), lc.NODE), lc.NODE)
            make = lambda: real_claim(real)  # noqa: E731
            servers = {name: int((cluster.root / "pids" / name).read_text())
                       for name in ("kube-apiserver", "etcd")}

            def burst(driver, kubelet) -> None:
                nonlocal bursts
                bursts = bench_burst.measure(real, driver, kubelet, make, real.kubeconfig(scratch / "floor"),
                                             cluster.logs / "audit.log", servers, args.burst_rounds)

            measured = measure(real, make, args.runs, scratch, lc.NODE, 3, namespace=DRIVER_NAMESPACE,
                               burst=burst, only_burst=args.only_burst, checkout=args.driver_checkout)
        finally:
            cluster.down()

    label = f"kube-apiserver {cluster.vers['KUBERNETES_VERSION']}"
    if args.only_burst:
        bench_burst.rows(table, label, bursts)
        table.print()
        bench_burst.where(bursts)
        return 0
    rows(table, "emulator", emulated)
    rows(table, label, measured)
    bench_burst.rows(table, label, bursts)
    e, r = statistics.median(emulated.prep), statistics.median(measured.prep)
    table.value("prepare p50: real / emulator", f"{r / e:.2f}x",
                f"p99 {pct(measured.prep, 0.99) / pct(emulated.prep, 0.99):.2f}x")
    table.value("batch throughput: real / emulator", f"{measured.batch / emulated.batch:.2f}x",
                f"64 concurrent: {measured.concurrent / emulated.concurrent:.2f}x")
    table.print()
    bench_burst.where(bursts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
