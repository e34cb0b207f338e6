"""What one node's slices cost the real allocator, per shape, against the baseline shape.

`python -m bench alloccost`: the scheduler's DRA filter is the upstream structured allocator
of k8s.io/dynamic-resource-allocation (the release hack/allocator-oracle pins, the one the
kube-scheduler of hack/local-cluster links). This runs that allocator the way the scheduler
drives it for one pending pod (one allocator with every node's slices, then `Allocate` per
node) on the slices bench/fleet.py publishes for each shape, and prints the nanoseconds a
node costs and the ratio to the baseline shape measured in the same run. It is the fleet
benchmark's scheduler figure without the cluster around it: seconds instead of minutes, no
API writes or scheduling queue in the way, so a change to what we publish can be compared
directly; `--profile DIR` writes a Go CPU profile per case (`go tool pprof -top`).

Nodes are empty, or `--fill F` of their GPUs held by other claims (what a half-full fleet
makes the allocator walk past).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import fleet

# (shape, workload) pairs, the fleet benchmark's; the baseline's "gpu" comes first.
CASES = (("baseline", "gpu"), ("mixed", "gpu"), ("mixed", "aligned"), ("consumable", "share"),
         ("h100x8-dynamic-mig", "mig"), ("h100x8-dynamic-mig", "gpu"),
         ("h100x8-dynamic-mig-3-profiles", "mig"), ("h100x8-dynamic-mig-3-profiles", "gpu"),
         ("sriov-large", "nic"))

# The allocator features kube-scheduler v1.37.2 enables by default (its DRA feature gates):
# with these upstream picks the same implementation the scheduler runs ("incubating", as a
# pprof of the scheduler shows), not the one with every alpha feature ("experimental").
SCHEDULER_FEATURES = {"AdminAccess": True, "PrioritizedList": True, "PartitionableDevices": True,
                      "DeviceTaints": True, "DeviceBindingAndStatus": True, "ConsumableCapacity": True}

# Shapes of a driver configured otherwise than the fleet's: the shape it is a variant of,
# and the --mig-profiles it runs with.
VARIANTS = {"h100x8-dynamic-mig-3-profiles": ("h100x8-dynamic-mig", frozenset({"1g.10gb", "3g.40gb", "7g.80gb"}))}


def shape_and_inventory(name: str):
    """The shape and the inventory the driver's own discovery finds for it."""
    base, profiles = VARIANTS.get(name, (name, frozenset()))
    shape = fleet.SHAPES[base]
    return shape, fleet.baseline_inventory() if shape.profile is None else fleet.mock_inventory(shape, profiles)


@dataclass
class Cost:
    shape: str
    workload: str
    devices: int
    attributes: int
    ns_per_node: float


def node_slices(shape: fleet.Shape, inventory, node: str) -> list[dict]:
    from driver.publish import slices

    return slices.build(inventory, slices.PoolIdentity(shape.driver, node), 1,
                        sharing=shape.sharing, layout=slices.SPLIT)


def held_claims(shape: fleet.Shape, built: list[dict], node: str, fill: float) -> list[dict]:
    """Claims already allocated on the node: `fill` of its GPUs (whole devices that no
    other device's counters depend on: the gpu class's first matches), one a claim."""
    gpus = [d["name"] for s in built for d in s["spec"].get("devices", ()) if _is_gpu(shape, d)]
    take = gpus[:int(len(gpus) * fill)]
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": f"held-{node}-{i}", "namespace": "bench", "uid": f"held-{node}-{i}"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": f"gpu.{shape.driver}", "allocationMode": "ExactCount", "count": 1}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": shape.driver, "pool": node, "device": name}]}}}}
            for i, name in enumerate(take)]


def _is_gpu(shape: fleet.Shape, device: dict) -> bool:
    if shape.profile is None:
        return True
    kind = device.get("attributes", {}).get("type", {}).get("string")
    return kind == "gpu"


def measure(oracle: Path, shape_name: str, workload: str, nodes: int, repeat: int, fill: float,
            profile: Path | None) -> Cost:
    shape, inventory = shape_and_inventory(shape_name)
    names = [f"node-{i}" for i in range(nodes)]
    all_slices, held = [], []
    for n in names:
        built = node_slices(shape, inventory, n)
        all_slices += built
        held += held_claims(shape, built, n, fill) if fill else []
    one = [s for s in all_slices if s["spec"].get("nodeName") == names[0] or s["spec"]["pool"]["name"] == names[0]]
    devices = [d for s in one for d in s["spec"].get("devices", ())]
    spec = fleet.claim_spec(workload, shape, 0)
    for r in spec["devices"]["requests"]:  # what the API server's defaulting adds
        r["exactly"].setdefault("allocationMode", "ExactCount")
        r["exactly"].setdefault("count", 1)
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "pending", "namespace": "bench", "uid": "pending"},
             "spec": spec}
    request = {"op": "bench", "node": {"name": names[0]}, "nodes": names, "repeat": repeat,
               "slices": all_slices, "classes": fleet.device_classes(shape), "claims": [claim],
               "allocated": held, "features": SCHEDULER_FEATURES}
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
        request["cpuProfile"] = str(profile / f"{shape_name}-{workload}.pprof")
    out = subprocess.run([str(oracle)], input=json.dumps(request) + "\n", capture_output=True,
                         text=True, check=True)
    answer = json.loads(out.stdout)
    if "error" in answer:
        raise SystemExit(f"alloccost: {shape_name}/{workload}: the allocator said: {answer['error']}")
    if not answer.get("fits"):
        raise SystemExit(f"alloccost: {shape_name}/{workload}: the claim fits no node (fill {fill})")
    return Cost(shape_name, workload, len(devices), sum(len(d.get("attributes", {})) for d in devices),
                answer["nsPerNode"])


def build_oracle() -> Path:
    """hack/allocator-oracle built into a temporary folder (Go's caches stay Go's)."""
    if shutil.which("go") is None:
        raise SystemExit("alloccost: Go is needed to build hack/allocator-oracle (the upstream allocator)")
    out = Path(tempfile.mkdtemp(prefix="alloccost-")) / "allocator-oracle"
    subprocess.run(["go", "build", "-o", str(out), "."], cwd=fleet.REPO / "hack" / "allocator-oracle",
                   check=True, timeout=3000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench alloccost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=20, help="nodes whose slices the allocator holds (default 20)")
    ap.add_argument("--repeat", type=int, default=20, help="pods timed, each filtered on every node (default 20)")
    ap.add_argument("--fill", type=float, default=0.0, help="share of each node's GPUs already allocated")
    ap.add_argument("--case", action="append", metavar="SHAPE/WORKLOAD",
                    help="only these cases (the baseline is always measured first)")
    ap.add_argument("--profile", type=Path, help="write a Go CPU profile per case into this folder")
    args = ap.parse_args(argv)
    cases = CASES
    if args.case:
        wanted = [tuple(c.split("/", 1)) for c in args.case]
        unknown = [c for c in wanted if c not in CASES]
        if unknown:
            ap.error(f"unknown case {'/'.join(unknown[0])}; known: {', '.join('/'.join(c) for c in CASES)}")
        cases = [CASES[0]] + [c for c in wanted if c != CASES[0]]
    oracle = build_oracle()
    costs = []
    print(f"{'shape':<20} {'workload':<9} {'devices':>7} {'attrs':>6} {'us/node':>9} {'ratio':>6}")
    for shape, workload in cases:
        cost = measure(oracle, shape, workload, args.nodes, args.repeat, args.fill, args.profile)
        costs.append(cost)
        ratio = cost.ns_per_node / costs[0].ns_per_node
        print(f"{shape:<20} {workload:<9} {cost.devices:>7} {cost.attributes:>6} "
              f"{cost.ns_per_node / 1000:>9.1f} {ratio:>5.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
