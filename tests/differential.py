"""Differential check of `dra-driver explain` (and the demo allocator) against the real structured allocator
(issue 32): a seeded generator of scenarios (pools on several nodes and on every node,
incomplete and invalid pools, shared counters, consumable capacity, taints and
tolerations, firstAvailable, matchAttribute / distinctAttribute constraints, allocationMode
All, list-typed attributes, admin access, claims already allocated), each answered by
hack/allocator-oracle (k8s.io/dynamic-resource-allocation) and by explain's engine, node by
node: the verdict, and where both fit, the devices chosen for each request.

One difference is deliberate (docs/explain.md): the scheduler stops at the first CEL
runtime error it meets, which depends on the order it visits devices and on whether it
found an allocation first; explain evaluates every device and reports any error as
aborting the node. A scenario where explain reports a CEL error is counted apart, as
"cel-error", and is not a disagreement whatever the scheduler answered.

    python3 tests/differential.py --count 10000 --seed 1     # the benchmark-sized run

prints the counts and writes every disagreeing scenario to
tests/data/conformance/differential_regressions.json (kept as fixed regression cases).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from driver.explain import engine  # noqa: E402
from driver.explain import world as w  # noqa: E402

ORACLE_SOURCE = ROOT / "hack" / "allocator-oracle"
REGRESSIONS = ROOT / "tests" / "data" / "conformance" / "differential_regressions.json"
DRIVER = "gpu.example.com"
OTHER = "nic.example.com"
D = f'device.attributes["{DRIVER}"]'
SELECTORS = [
    f'{D}.model == "a"',
    f'{D}.numa == 1',
    f'{D}.ver.isGreaterThan(semver("1.1.0"))',
    f'device.capacity["{DRIVER}"].memory.compareTo(quantity("10Gi")) >= 0',
    f'{D}.ids.includes(2)',
    f'{D}.ids.exists(i, i > 2)',
    f'"tags" in {D} && {D}.tags.exists(t, t == "x")',
    f'{D}.ok',
    'device.allowMultipleAllocations',
    f'cel.bind(a, {D}, a.numa == 0 || a.model == "b")',
    f'{D}.model.startsWith("a") && {D}.numa >= 0.5',
]
ERRING_SELECTORS = [f'{D}.tags.size() > 0']  # tags is missing on some devices: a CEL error


def build_oracle(directory: Path | None = None) -> Path | None:
    """The oracle binary, built into a temporary folder (Go caches stay Go's); None
    without Go."""
    go = shutil.which("go")
    if go is None:
        return None
    out = (directory or Path(tempfile.mkdtemp(prefix="allocator-oracle-"))) / "allocator-oracle"
    subprocess.run([go, "build", "-o", str(out), "."], cwd=ORACLE_SOURCE, check=True,
                   capture_output=True, text=True, timeout=3000)
    return out



def started_oracle(directory: Path) -> "Oracle":
    """The oracle built into directory and started, for a test's fixture: without Go the
    test is skipped, and fails under CI=true (CI installs Go)."""
    import pytest

    if shutil.which("go") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Go is required under CI=true to build hack/allocator-oracle")
        pytest.skip("Go is not installed: hack/allocator-oracle cannot be built")
    return Oracle(build_oracle(directory))

class Oracle:
    def __init__(self, binary: Path) -> None:
        self.proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def ask(self, request: dict) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- the generator ----------------------------------------------------------------------------------------
def _device(rng: random.Random, name: str, counter_set: str | None) -> dict:
    attributes = {
        "model": {"string": rng.choice(["a", "b", "ab"])},
        "numa": {"int": rng.randint(0, 1)},
        "ver": {"version": rng.choice(["1.0.0", "1.2.0", "2.0.0"])},
        "ok": {"bool": rng.random() < 0.7},
        "ids": {"ints": sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 3)))},
    }
    if rng.random() < 0.5:
        attributes["tags"] = {"strings": sorted(rng.sample(["x", "y", "z"], rng.randint(1, 2)))}
    device: dict = {"name": name, "attributes": attributes,
                    "capacity": {"memory": {"value": rng.choice(["8Gi", "16Gi"])}}}
    if rng.random() < 0.2:
        device["allowMultipleAllocations"] = True
        device["capacity"]["memory"]["requestPolicy"] = rng.choice([
            {"default": "4Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
            {"default": "8Gi", "validValues": ["4Gi", "8Gi"]},
            {},
        ])
    if rng.random() < 0.1:
        device["taints"] = [{"key": "t", "value": "v", "effect": rng.choice(["NoSchedule", "NoExecute", "None"])}]
    if counter_set and rng.random() < 0.7:
        device["consumesCounters"] = [{"counterSet": counter_set if rng.random() < 0.97 else "nope",
                                       "counters": {"mem": {"value": rng.choice(["4", "8"])}}}]
    return device


def _pool(rng: random.Random, driver: str, pool: str, node: str | None) -> list[dict]:
    where = {"nodeName": node} if node else {"allNodes": True}
    generation = rng.randint(1, 2)
    slices = []
    counter_set = None
    if driver == DRIVER and rng.random() < 0.3:
        counter_set = "cs"
        slices.append({"sharedCounters": [{"name": "cs", "counters": {"mem": {"value": rng.choice(["8", "12"])}}}]})
    count = 0
    for _ in range(rng.randint(1, 2)):
        devices = []
        for _ in range(rng.randint(1, 3)):
            name = f"dev-{count}" if rng.random() < 0.98 else "dev-0"  # rarely twice: an invalid pool
            count += 1
            devices.append(_device(rng, name, counter_set))
        slices.append({"devices": devices})
    rng.shuffle(slices)  # the scheduler sorts slices by name; the listing order is not that
    objects = []
    prefix = pool if driver == DRIVER else f"{driver.split('.')[0]}-{pool}"
    names = [f"{prefix}-{chr(ord('a') + i)}" for i in range(len(slices))]
    rng.shuffle(names)
    for name, spec in zip(names, slices):
        objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                        "spec": {"driver": driver, **where,
                                 "pool": {"name": pool, "generation": generation,
                                          "resourceSliceCount": len(slices)}, **spec}})
    if rng.random() < 0.05 and len(objects) > 1:
        objects.pop()  # a slice not seen yet: an incomplete pool
    if rng.random() < 0.1:  # an older generation still around
        old = json.loads(json.dumps(objects[0]))
        old["metadata"]["name"] += "-old"
        old["spec"]["pool"]["generation"] = generation - 1
        objects.append(old)
    return objects


def _request(rng: random.Random, name: str, classes: list[str]) -> dict:
    def exactly(sub: bool = False) -> dict:
        spec: dict = {"deviceClassName": rng.choice(classes)}
        # As the API server stores it: allocationMode and count defaulted.
        if rng.random() < 0.15:
            spec["allocationMode"] = "All"
        else:
            spec["allocationMode"] = "ExactCount"
            spec["count"] = rng.randint(1, 3) if rng.random() < 0.5 else 1
        selectors = rng.sample(SELECTORS, rng.choice([0, 0, 1, 1, 2]))
        if rng.random() < 0.05:
            selectors.append(rng.choice(ERRING_SELECTORS))
        if selectors:
            spec["selectors"] = [{"cel": {"expression": e}} for e in selectors]
        if rng.random() < 0.15:
            spec["tolerations"] = [rng.choice([{"key": "t", "operator": "Exists", "effect": "NoExecute"},
                                               {"key": "t", "operator": "Exists"},
                                               {"key": "t", "operator": "Equal", "value": "v", "effect": "NoSchedule"}])]
        if rng.random() < 0.2:
            spec["capacity"] = {"requests": {rng.choice(["memory", "memory", "memory", "cores"]):
                                             rng.choice(["2Gi", "4Gi", "6Gi", "12Gi"])}}
        if rng.random() < 0.05 and not sub:
            spec["adminAccess"] = True  # (a subrequest has no such field)
        return spec
    if rng.random() < 0.25:
        return {"name": name, "firstAvailable": [{"name": f"s{i}", **exactly(True)} for i in range(rng.randint(1, 3))]}
    return {"name": name, "exactly": exactly()}


def scenario(seed: int) -> dict:
    rng = random.Random(seed)
    nodes = [f"node-{c}" for c in "ab"[:rng.randint(1, 2)]]
    slices: list[dict] = []
    for node in nodes:
        slices += _pool(rng, DRIVER, node, node)
    if rng.random() < 0.4:
        slices += _pool(rng, DRIVER, "shared", None)
    if rng.random() < 0.15:
        slices += _pool(rng, OTHER, nodes[0], nodes[0])
    classes = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu"},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "any"}, "spec": {}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "big"},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}},
                                {"cel": {"expression": f'device.capacity["{DRIVER}"].memory.compareTo(quantity("10Gi")) >= 0'}}]}},
    ]
    requests = [_request(rng, f"r{i}", ["gpu", "gpu", "gpu", "any", "big"]) for i in range(rng.randint(1, 3))]
    spec: dict = {"devices": {"requests": requests}}
    if rng.random() < 0.3:
        constraints = []
        for _ in range(rng.randint(1, 2)):
            kind = rng.choice(["matchAttribute", "matchAttribute", "distinctAttribute"])
            attribute = rng.choice([f"{DRIVER}/model", f"{DRIVER}/numa", f"{DRIVER}/ids", f"{DRIVER}/tags"])
            constraint: dict = {kind: attribute}
            if rng.random() < 0.3:
                constraint["requests"] = [requests[0]["name"]]
            if rng.random() < 0.02:
                constraint = {"requests": [requests[0]["name"]]}  # empty: the scheduler's error
            constraints.append(constraint)
        spec["devices"]["constraints"] = constraints
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "claim", "namespace": "default", "uid": "uid-claim"}, "spec": spec}
    allocated = _allocated(rng, slices)
    return {"seed": seed, "nodes": nodes, "slices": slices, "classes": classes, "claim": claim,
            "allocated": allocated}


def _allocated(rng: random.Random, slices: list[dict]) -> list[dict]:
    """Other claims, with devices (whole or shares) already allocated to them."""
    devices = [(s["spec"]["driver"], s["spec"]["pool"]["name"], d) for s in slices
               for d in s["spec"].get("devices") or []]
    claims = []
    for i in range(rng.randint(0, 2)):
        results = []
        for driver, pool, device in rng.sample(devices, min(len(devices), rng.randint(1, 2))):
            result: dict = {"request": "r", "driver": driver, "pool": pool, "device": device["name"]}
            if device.get("allowMultipleAllocations"):
                result["shareID"] = f"00000000-0000-0000-0000-00000000000{i}"
                result["consumedCapacity"] = {"memory": rng.choice(["4Gi", "8Gi"])}
            results.append(result)
        claims.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": f"other-{i}", "namespace": "default", "uid": f"uid-{i}"},
                       "spec": {"devices": {"requests": []}},
                       "status": {"allocation": {"devices": {"results": results}}}})
    return claims


# -- the comparison ---------------------------------------------------------------------------------------
def explain_answer(sc: dict, node: str) -> dict:
    world = w.build(sc["slices"] + sc["classes"] + sc["allocated"])
    report = engine.explain_node("default/claim", sc["claim"]["spec"], node, world, "default")
    answer: dict = {"fits": report.fits, "why": report.why}
    if report.fits:
        answer["devices"] = [(r["request"], r["pool"], r["device"]) for r in report.allocation]
    return answer


def oracle_answer(oracle: Oracle, sc: dict, node: str) -> dict:
    raw = oracle.ask({"op": "allocate", "node": {"name": node}, "slices": sc["slices"], "classes": sc["classes"],
                      "claims": [sc["claim"]], "allocated": sc["allocated"]})
    if raw.get("error"):
        return {"fits": False, "error": raw["error"]}
    answer: dict = {"fits": bool(raw.get("fits"))}
    if answer["fits"]:
        results = raw["results"][0]["devices"]["results"]
        answer["devices"] = [(r["request"], r["pool"], r["device"]) for r in results]
    return answer


def compare(oracle: Oracle, sc: dict) -> list[dict]:
    """One finding per node: "agree", "cel-error" (the deliberate difference) or "disagree"."""
    findings = []
    for node in sc["nodes"]:
        ours, theirs = explain_answer(sc, node), oracle_answer(oracle, sc, node)
        if "a CEL error aborts the allocation" in ours["why"]:
            kind = "cel-error"
        elif ours["fits"] == theirs["fits"] and ours.get("devices") == theirs.get("devices"):
            kind = "agree"
        else:
            kind = "disagree"
        findings.append({"seed": sc["seed"], "node": node, "kind": kind, "explain": ours, "scheduler": theirs})
    return findings


def run(oracle: Oracle, seeds) -> dict:
    counts = {"agree": 0, "cel-error": 0, "disagree": 0}
    disagreements = []
    for seed in seeds:
        sc = scenario(seed)
        for finding in compare(oracle, sc):
            counts[finding["kind"]] += 1
            if finding["kind"] == "disagree":
                disagreements.append({"scenario": sc, "finding": finding})
    return {"counts": counts, "disagreements": disagreements}


# -- pods: several claims allocated together (issue 41) ----------------------------------------------------
def pod_scenario(seed: int) -> dict:
    """scenario(seed) as a pod with two or three claims: the scenario's claim first, then
    one or two more from a generator of their own (the one-claim scenarios stay as they are)."""
    sc = scenario(seed)
    rng = random.Random(f"pod-{seed}")
    claims = [sc["claim"]]
    for i in range(1, rng.randint(2, 3)):
        requests = [_request(rng, f"r{j}", ["gpu", "gpu", "any", "big"]) for j in range(rng.randint(1, 2))]
        claims.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": f"claim-{i}", "namespace": "default", "uid": f"uid-claim-{i}"},
                       "spec": {"devices": {"requests": requests}}})
    return {**sc, "claims": claims}


def pod_explain_answer(sc: dict, node: str) -> dict:
    world = w.build(sc["slices"] + sc["classes"] + sc["allocated"])
    claims = [engine.PodClaim(f"default/{c['metadata']['name']}", c["spec"], "default") for c in sc["claims"]]
    reports = engine.explain_pod_node(claims, node, world)
    failed = [r for r in reports if not r.fits]
    if failed:
        return {"fits": False, "why": failed[-1].why}
    return {"fits": True, "why": engine.FITS,
            "claims": [[(r["request"], r["pool"], r["device"]) for r in report.allocation] for report in reports]}


def pod_oracle_answer(oracle: Oracle, sc: dict, node: str) -> dict:
    raw = oracle.ask({"op": "allocate", "node": {"name": node}, "slices": sc["slices"], "classes": sc["classes"],
                      "claims": sc["claims"], "allocated": sc["allocated"]})
    if raw.get("error"):
        return {"fits": False, "error": raw["error"]}
    if not raw.get("fits"):
        return {"fits": False}
    return {"fits": True, "claims": [[(r["request"], r["pool"], r["device"]) for r in result["devices"]["results"]]
                                     for result in raw["results"]]}


def run_pods(oracle: Oracle, seeds) -> dict:
    """As run(), for pod_scenario(seed): explain_pod_node against the allocator given all the
    pod's claims at once."""
    counts = {"agree": 0, "cel-error": 0, "disagree": 0}
    disagreements = []
    for seed in seeds:
        sc = pod_scenario(seed)
        for node in sc["nodes"]:
            ours, theirs = pod_explain_answer(sc, node), pod_oracle_answer(oracle, sc, node)
            if "a CEL error aborts the allocation" in ours["why"]:
                kind = "cel-error"
            elif ours["fits"] == theirs["fits"] and ours.get("claims") == theirs.get("claims"):
                kind = "agree"
            else:
                kind = "disagree"
            counts[kind] += 1
            if kind == "disagree":
                disagreements.append({"seed": seed, "node": node, "explain": ours, "scheduler": theirs})
    return {"counts": counts, "disagreements": disagreements}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1, help="the first scenario's seed")
    parser.add_argument("--oracle", help="a built hack/allocator-oracle (default: build it)")
    parser.add_argument("--keep", action="store_true", help=f"add disagreements to {REGRESSIONS.name}")
    parser.add_argument("--demo", action="store_true", help="compare the demo allocator too")
    parser.add_argument("--pods", action="store_true", help="compare pods of several claims too (pod_scenario)")
    args = parser.parse_args()
    binary = Path(args.oracle) if args.oracle else build_oracle()
    if binary is None:
        print("Go is not installed: cannot build hack/allocator-oracle", file=sys.stderr)
        return 2
    oracle = Oracle(binary)
    try:
        result = run(oracle, range(args.seed, args.seed + args.count))
    finally:
        oracle.close()
    print(json.dumps({"seeds": f"{args.seed}..{args.seed + args.count - 1}", **result["counts"]}))
    pods = {"counts": {}, "disagreements": []}
    if args.pods:
        oracle = Oracle(binary)
        try:
            pods = run_pods(oracle, range(args.seed, args.seed + args.count))
        finally:
            oracle.close()
        print(json.dumps({"pods": pods["counts"]}))
        for item in pods["disagreements"][:5]:
            print(json.dumps(item))
    if args.demo:
        oracle = Oracle(binary)
        try:
            demo = compare_demo(oracle, range(args.seed, args.seed + args.count))
        finally:
            oracle.close()
        print(json.dumps({"demo allocator": demo["counts"]}))
        for example in demo["examples"]:
            print(json.dumps(example))
    for item in result["disagreements"][:5]:
        print(json.dumps(item["finding"]))
    if args.keep and result["disagreements"]:
        kept = json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []
        known = {k["seed"] for k in kept}
        oracle = Oracle(binary)
        try:
            for item in result["disagreements"]:
                sc = item["scenario"]
                if sc["seed"] not in known:
                    known.add(sc["seed"])
                    sc["scheduler"] = {node: oracle_answer(oracle, sc, node) for node in sc["nodes"]}
                    sc["why"] = f"disagreed in a run of tests/differential.py (seed {sc['seed']})"
                    kept.append(sc)
        finally:
            oracle.close()
        REGRESSIONS.write_text(json.dumps(kept, indent=1) + "\n")
    return 1 if result["disagreements"] or pods["disagreements"] or (args.demo and demo["counts"]["disagree"]) else 0



# -- the demo allocator -----------------------------------------------------------------------------------
def demo_answer(sc: dict, node: str) -> dict | None:
    """The demo allocator's answer (driver/scheduling/allocator.py), for the scenarios it models:
    one pool of one driver on the node, no allocationMode All, no admin access, no pool
    that the scheduler refuses; None for the others."""
    from driver.kube import quantity
    from driver.devices.model import Device, DeviceKind, Inventory, Version
    from driver.scheduling import allocator
    world = w.build(sc["slices"])
    on_node = world.on_node(node)
    pools = {(d.driver, d.pool) for d in on_node}
    if world.unusable_pools or len(pools) != 1:
        return None
    (driver, pool), = pools
    requests = sc["claim"]["spec"]["devices"]["requests"]
    for r in requests:
        for spec in r.get("firstAvailable") or [r.get("exactly")]:
            if spec.get("allocationMode") == "All" or spec.get("adminAccess"):
                return None
    shares, counters = allocator.Shares(), allocator.Counters()
    for (set_driver, set_pool, name), totals in world.counter_sets.items():
        if (set_driver, set_pool) == (driver, pool):
            counters.totals[name] = dict(totals)
    for d in world.devices:  # the pool's devices on other nodes use its counters too
        if (d.driver, d.pool) == (driver, pool) and d.consumes:
            counters.consumes[d.name] = {s: dict(c) for s, c in d.consumes.items()}
    devices, taints = [], {}
    for d in on_node:
        attributes = {}
        for key, value in d.attributes.items():
            (kind, v), = value.items()
            attributes[key] = Version(v) if kind == "version" else v
        devices.append(Device(d.name, DeviceKind.GPU, attributes, {k: c["value"] for k, c in d.capacity.items()}))
        if d.consumes:
            counters.consumes[d.name] = {s: dict(c) for s, c in d.consumes.items()}
        if d.multiple:
            shares.capacity[d.name] = d.capacity
        if d.taints:
            taints[d.name] = list(d.taints)
    taken: set[str] = set()
    counted: set[str] = set()
    for claim in sc["allocated"]:
        for result in claim["status"]["allocation"]["devices"]["results"]:
            if (result["driver"], result["pool"]) != (driver, pool):
                continue
            if (result.get("consumedCapacity") or result.get("shareID")) and result["device"] in shares.capacity:
                shares.take(result["device"], {k: quantity.value(v) for k, v in
                                               (result.get("consumedCapacity") or {}).items()})
            else:
                taken.add(result["device"])
            if result["device"] not in counted:  # a device takes its counters once
                counted.add(result["device"])
                counters.take(result["device"])
    classes = {c["metadata"]["name"]: [s["cel"]["expression"] for s in c["spec"].get("selectors") or []]
               for c in sc["classes"]}
    spec = json.loads(json.dumps(sc["claim"]["spec"]))
    for r in spec["devices"]["requests"]:
        for sub in r.get("firstAvailable") or []:
            sub.setdefault("count", 1)
    try:
        choices = allocator.allocate(spec, Inventory(tuple(devices)), classes, driver, taken, shares, counters, taints,
                                     order=[d.name for d in devices])
    except allocator.Unsatisfiable as error:
        return {"fits": False, "why": str(error)}
    return {"fits": True, "devices": [(c.request, pool, d.name) for c in choices for d in c.devices]}


def compare_demo(oracle: Oracle, seeds) -> dict:
    counts = {"agree": 0, "cel-error": 0, "disagree": 0, "not-modelled": 0}
    examples = []
    for seed in seeds:
        sc = scenario(seed)
        for node in sc["nodes"]:
            ours = demo_answer(sc, node)
            if ours is None:
                counts["not-modelled"] += 1
                continue
            theirs = oracle_answer(oracle, sc, node)
            if "CEL runtime error" in ours.get("why", ""):
                counts["cel-error"] += 1  # as explain, it evaluates every device: the deliberate difference
                continue
            same = ours["fits"] == theirs["fits"] and ours.get("devices") == theirs.get("devices")
            counts["agree" if same else "disagree"] += 1
            if not same and len(examples) < 5:
                examples.append({"seed": seed, "node": node, "demo": ours, "scheduler": theirs})
    return {"counts": counts, "examples": examples}


# -- upstream's allocator scenarios ---------------------------------------------------------------------
UPSTREAM = ROOT / "tests" / "data" / "upstream_allocator_scenarios.json"
# The allocator features explain models: the gates on by default in the clusters it
# explains (1.34+ GA or beta), and what hack/allocator-oracle enables by default.
MODELLED_FEATURES = {"DRAAdminAccess", "DRAPrioritizedList", "DRAPartitionableDevices", "DRADeviceTaints",
                     "DRAConsumableCapacity", "DRAListTypeAttributes"}


def upstream_scenarios() -> list[dict]:
    return json.loads(UPSTREAM.read_text())["scenarios"]


def _kind(objects: list[dict] | None, kind: str) -> list[dict]:
    return [{"kind": kind, "apiVersion": "resource.k8s.io/v1", **o} for o in objects or []]


def upstream_allocated(sc: dict) -> list[dict]:
    """The scenario's allocated state as one allocated claim: each allocated device a
    result, each share a result with its shareID (a device's summed consumed capacity on
    its first share)."""
    results = [{"request": "r", "driver": d["driver"], "pool": d["pool"], "device": d["device"]}
               for d in sc.get("allocatedDevices") or []]
    consumed = {(c["driver"], c["pool"], c["device"]): c["capacity"] for c in sc.get("aggregatedCapacity") or []}
    for d in sc.get("allocatedSharedDeviceIDs") or []:
        result = {"request": "r", "driver": d["driver"], "pool": d["pool"], "device": d["device"],
                  "shareID": d.get("shareID") or "00000000-0000-0000-0000-000000000000"}
        capacity = consumed.pop((d["driver"], d["pool"], d["device"]), None)
        if capacity is not None:
            result["consumedCapacity"] = capacity
        results.append(result)
    for (driver, pool, device), capacity in consumed.items():  # capacity without a share ID
        results.append({"request": "r", "driver": driver, "pool": pool, "device": device,
                        "shareID": "00000000-0000-0000-0000-000000000001", "consumedCapacity": capacity})
    if not results:
        return []
    return [{"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1",
             "metadata": {"name": "allocated", "namespace": "default", "uid": "uid-allocated"},
             "spec": {"devices": {"requests": []}}, "status": {"allocation": {"devices": {"results": results}}}}]


def _devices(results: list[dict]) -> list[tuple[str, str, str, str]]:
    return [(r["request"], r["driver"], r["pool"], r["device"]) for r in results]


def upstream_expected(sc: dict) -> dict:
    """What upstream's test accepted: an error, no fit, or each claim's devices."""
    if sc.get("error"):
        return {"fits": False, "error": sc["error"]}
    if not sc.get("results") and sc["claims"]:
        return {"fits": False}
    return {"fits": True, "claims": [_devices(r["devices"].get("results") or []) for r in sc.get("results") or []]}


def upstream_node(sc: dict) -> dict:
    meta = (sc.get("node") or {}).get("metadata") or {}
    return {"name": meta.get("name", "node-1"), "labels": meta.get("labels") or {}}


def upstream_oracle(oracle: Oracle, sc: dict, features: dict | None = None) -> dict:
    request = {"op": "allocate", "node": upstream_node(sc), "slices": _kind(sc["slices"], "ResourceSlice"),
               "classes": _kind(sc["classes"], "DeviceClass"), "claims": _kind(sc["claims"], "ResourceClaim"),
               "allocated": upstream_allocated(sc)}
    if features is not None:
        request["features"] = features
    raw = oracle.ask(request)
    if raw.get("error"):
        return {"fits": False, "error": raw["error"]}
    if not raw.get("fits") and sc["claims"]:
        return {"fits": False}
    return {"fits": True, "claims": [_devices(r["devices"].get("results") or []) for r in raw.get("results") or []]}


# Go field names of structured.Features for the feature gate names the recorder wrote.
GO_FEATURES = {"DRAAdminAccess": "AdminAccess", "DRAPrioritizedList": "PrioritizedList",
               "DRAPartitionableDevices": "PartitionableDevices", "DRADeviceTaints": "DeviceTaints",
               "DRAConsumableCapacity": "ConsumableCapacity", "DRAListTypeAttributes": "ListTypeAttributes",
               "DRADeviceBindingConditions+DRAResourceClaimDeviceStatus": "DeviceBindingAndStatus",
               "DRADeviceCompatibilityGroups": "CompatibilityGroups", "DRADerivedAttributes": "DerivedAttributes",
               "DRAOptionalNodeOperations": "OptionalNodeOperations",
               "DRAFractionalCapacityRange": "FractionalCapacityRange"}


def go_features(names) -> dict:
    return {GO_FEATURES[n]: True for n in names}


def upstream_explain(sc: dict) -> dict:
    """explain, the scenario's claims allocated together as a pod's are (engine.explain_pod_node:
    claim by claim, each beside the devices of the ones before, backtracking across them)."""
    node = upstream_node(sc)["name"]
    node_object = {"kind": "Node", "metadata": {"name": node, "labels": upstream_node(sc)["labels"]}}
    world = w.build(_kind(sc["slices"], "ResourceSlice") + _kind(sc["classes"], "DeviceClass")
                    + upstream_allocated(sc) + [node_object])
    claims = [engine.PodClaim(f"default/{(claim.get('metadata') or {}).get('name', f'claim-{index}')}",
                              claim["spec"], "default") for index, claim in enumerate(sc["claims"])]
    try:
        reports = engine.explain_pod_node(claims, node, world)
    except engine.ClaimError as err:
        return {"fits": False, "error": f"explain: {err}"}
    failed = [r for r in reports if not r.fits]
    if failed:
        why = failed[-1].why  # the claim that cannot be placed; those before it name it
        answer: dict = {"fits": False, "why": why}
        if _is_error(why):
            answer["error"] = why
        return answer
    return {"fits": True, "claims": [_devices([{k: r[k] for k in ("request", "driver", "pool", "device")}
                                               for r in report.allocation]) for report in reports]}


def _is_error(why: str) -> bool:
    """explain's reasons that are the scheduler's errors (not a plain "does not fit")."""
    return any(s in why for s in ("a CEL error aborts the allocation", "the scheduler fails",
                                  "currently being updated", "currently invalid"))


def upstream_demo(sc: dict) -> dict | None:
    """The demo allocator's answer to a one-claim upstream scenario it models, else None."""
    if len(sc["claims"]) != 1:
        return None
    node = upstream_node(sc)["name"]
    one = {"slices": _kind(sc["slices"], "ResourceSlice"), "classes": _kind(sc["classes"], "DeviceClass"),
           "claim": sc["claims"][0], "allocated": upstream_allocated(sc)}
    requests = one["claim"]["spec"]["devices"]["requests"]
    selectors = [s for c in one["classes"] for s in c["spec"].get("selectors") or []] + [
        s for r in requests for e in (r.get("firstAvailable") or [r.get("exactly") or {}])
        for s in e.get("selectors") or []]
    if any("cel" not in s for s in selectors):
        return None  # an unknown selector type: the API server would not store it
    if any((s.get("spec") or {}).get("nodeSelector") for s in one["slices"]):
        return None  # the demo's node has no labels: a slice's nodeSelector is not the demo's
    try:
        ours = demo_answer(one, node)
    except ValueError:
        # device or attribute names the driver's device model refuses (capacity-0), or an
        # attribute without a value: not what the driver publishes
        return None
    if ours is None:
        return None
    world = w.build(one["slices"])
    (driver,) = {d.driver for d in world.on_node(node)}
    if not ours["fits"]:
        return {"fits": False, "why": ours["why"]} | ({"error": ours["why"]} if "CEL runtime error" in ours["why"]
                                                      else {})
    return {"fits": True, "claims": [[(r, driver, p, d) for r, p, d in ours["devices"]]]}


def same_verdict(ours: dict, theirs: dict) -> bool:
    """Fit or not, an error where the scheduler gives one, and the same devices per claim."""
    if ours["fits"] != theirs["fits"] or bool(ours.get("error")) != bool(theirs.get("error")):
        return False
    return not ours["fits"] or [[tuple(x) for x in c] for c in ours["claims"]] == \
        [[tuple(x) for x in c] for c in theirs["claims"]]


if __name__ == "__main__":
    sys.exit(main())
