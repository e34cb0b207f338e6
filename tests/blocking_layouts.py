"""Generated fragmented layouts for `explain --blocking` (issue 41, item 2), and their check
against the real allocator (hack/allocator-oracle, see tests/differential.py).

A layout is one node with the kinds of fragmentation the issue names, alone or mixed:
whole GPUs scattered over PCIe roots (some requests want them on one root), partitionable
GPUs whose MIG-like partitions draw on shared counters, GPUs shared by capacity, NICs on
the GPUs' roots; other claims hold some of it. The request is drawn from what the layout
offers; one layout in five asks with a pod of two claims, placed together. For each
layout where the request does not fit, the blocking set explain names is
checked with the oracle: without the set's claims the request fits; with any one of them
put back, it does not (the set is minimal). Where explain says no removal can help, the
oracle must not place it on the empty node either; where it fits, it must fit.

    python3 tests/blocking_layouts.py --count 1000 --seed 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import differential as diff  # noqa: E402
from driver.explain import blocking, engine  # noqa: E402
from driver.explain import world as w  # noqa: E402

DRIVER = "gpu.example.com"
NODE = "node-a"
KINDS = ("scattered", "mig", "shares", "nic-root", "mixed")
_A = f'device.attributes["{DRIVER}"]'
CLASSES = [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}" && {_A}.type == "{name}"'}}]}}
           for name in ("gpu", "mig", "nic")]
# name -> (memory slices, compute slices) of a MIG-like partition of a 7-compute, 8-memory GPU
PROFILES = {"1g": (1, 1), "2g": (2, 2), "3g": (4, 3), "4g": (4, 4), "7g": (8, 7)}


def layout(seed: int) -> dict:
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    parts = {"scattered", "nic-root"} if kind == "nic-root" else (
        set(rng.sample(["scattered", "mig", "shares"], 2)) if kind == "mixed" else {kind})
    devices: list[dict] = []
    counters: list[dict] = []
    roots = [f"pci{r}" for r in range(rng.randint(2, 4))]

    def attrs(type_: str, root: str, **more) -> dict:
        out = {"type": {"string": type_}, "resource.kubernetes.io/pcieRoot": {"string": root}}
        out.update({k: ({"string": v} if isinstance(v, str) else {"int": v}) for k, v in more.items()})
        return out

    if "scattered" in parts:
        for i in range(rng.randint(2, 6)):
            devices.append({"name": f"gpu-{i}", "attributes": attrs("gpu", rng.choice(roots))})
    if "nic-root" in parts:
        for i in range(rng.randint(1, 3)):
            devices.append({"name": f"nic-{i}", "attributes": attrs("nic", rng.choice(roots))})
    if "mig" in parts:
        for g in range(rng.randint(1, 2)):
            name = f"mgpu-{g}"
            counters.append({"name": name, "counters": {"memory": {"value": "8"}, "compute": {"value": "7"}}})
            slots = {"1g": 7, "2g": 3, "3g": 2, "4g": 1, "7g": 1}
            for profile, (memory, compute) in PROFILES.items():
                for s in range(slots[profile]):
                    devices.append({"name": f"{name}-{profile}-{s}", "attributes": attrs("mig", roots[g % len(roots)],
                                                                                        profile=profile),
                                    "consumesCounters": [{"counterSet": name, "counters": {
                                        "memory": {"value": str(memory)}, "compute": {"value": str(compute)}}}]})
    if "shares" in parts:
        for i in range(rng.randint(1, 3)):
            devices.append({"name": f"sgpu-{i}", "attributes": attrs("gpu", rng.choice(roots)),
                            "allowMultipleAllocations": True,
                            "capacity": {"memory": {"value": "80Gi", "requestPolicy": {
                                "default": "10Gi", "validRange": {"min": "10Gi", "step": "10Gi"}}}}})
    # Shared counters in a slice of their own, as the API (1.35+) wants them.
    specs = [{"devices": devices}] + ([{"sharedCounters": counters}] if counters else [])
    slices = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-slice-{i}"},
               "spec": {"driver": DRIVER, "nodeName": NODE,
                        "pool": {"name": NODE, "generation": 1, "resourceSliceCount": len(specs)}, **body}}
              for i, body in enumerate(specs)]
    allocated = _allocated(rng, devices)
    claims = [_claim(rng, devices)]
    # One layout in five is a pod of two claims, placed together (its own generator, so
    # that the one-claim layouts stay as they are).
    pod = random.Random(f"pod-{seed}")
    if pod.random() < 0.2:
        second = _claim(pod, devices)
        second["metadata"] |= {"name": "claim-2", "uid": "uid-claim-2"}
        claims.append(second)
    return {"seed": seed, "kind": kind, "nodes": [NODE], "slices": slices, "classes": CLASSES,
            "allocated": allocated, "claim": claims[0], "claims": claims}


def _allocated(rng: random.Random, devices: list[dict]) -> list[dict]:
    """Other claims holding some of the devices: whole devices, partitions that leave the
    counters, shares of shareable GPUs. Placed so that the layout is one the allocator
    could have made (no device twice, counters and capacity not exceeded)."""
    free = [d for d in devices]
    rng.shuffle(free)
    used_counters: dict[str, dict[str, int]] = {}
    used_memory: dict[str, int] = {}
    claims = []
    for index in range(rng.randint(1, 7)):
        results = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            choice = None
            for device in free:
                if device.get("allowMultipleAllocations"):
                    amount = rng.choice([10, 20, 30, 40])
                    if used_memory.get(device["name"], 0) + amount <= 80:
                        used_memory[device["name"]] = used_memory.get(device["name"], 0) + amount
                        choice = (device, {"memory": f"{amount}Gi"})
                        break
                    continue
                uses = device.get("consumesCounters") or []
                if any(used_counters.get(u["counterSet"], {}).get(c, 0) + int(v["value"]) > (8 if c == "memory" else 7)
                       for u in uses for c, v in u["counters"].items()):
                    continue
                for u in uses:
                    for c, v in u["counters"].items():
                        used_counters.setdefault(u["counterSet"], {})[c] = (
                            used_counters.get(u["counterSet"], {}).get(c, 0) + int(v["value"]))
                choice = (device, None)
                break
            if choice is None:
                break
            device, consumed = choice
            if consumed is None:
                free.remove(device)
            result: dict = {"request": "r", "driver": DRIVER, "pool": NODE, "device": device["name"]}
            if consumed is not None:
                result["shareID"] = f"00000000-0000-0000-0000-{index:06d}{len(results):06d}"
                result["consumedCapacity"] = consumed
            results.append(result)
        if not results:
            break
        claims.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": f"held-{index}", "namespace": "default", "uid": f"uid-held-{index}"},
                       "spec": {"devices": {"requests": []}},
                       "status": {"allocation": {"devices": {"results": results}},
                                  "reservedFor": [{"resource": "pods", "name": f"pod-{index}", "uid": f"pod-{index}"}]}})
    return claims


def _claim(rng: random.Random, devices: list[dict]) -> dict:
    whole = [d for d in devices if d["attributes"]["type"]["string"] == "gpu" and not d.get("allowMultipleAllocations")]
    shared = [d for d in devices if d.get("allowMultipleAllocations")]
    nics = [d for d in devices if d["attributes"]["type"]["string"] == "nic"]
    migs = [d for d in devices if d["attributes"]["type"]["string"] == "mig"]
    choices = []
    if whole:
        choices.append("whole")
    if shared:
        choices.append("share")
    if migs:
        choices.append("mig")
    if whole and nics:
        choices += ["pair", "pair"]
    pick = rng.choice(choices)
    constraints = []
    if pick == "whole":
        exactly = {"deviceClassName": "gpu", "allocationMode": "ExactCount", "count": rng.randint(1, len(whole) + 1),
                   "selectors": [{"cel": {"expression": "!device.allowMultipleAllocations"}}]}
        requests = [{"name": "gpu", "exactly": exactly}]
        if rng.random() < 0.4:
            constraints.append({"matchAttribute": "resource.kubernetes.io/pcieRoot"})
    elif pick == "share":
        requests = [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu", "allocationMode": "ExactCount", "count": 1,
            "selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}],
            "capacity": {"requests": {"memory": rng.choice(["30Gi", "50Gi", "70Gi", "80Gi", "90Gi"])}}}}]
    elif pick == "mig":
        profile = rng.choice(list(PROFILES))
        requests = [{"name": "mig", "exactly": {
            "deviceClassName": "mig", "allocationMode": "ExactCount", "count": rng.choice([1, 1, 2]),
            "selectors": [{"cel": {"expression": f'{_A}.profile == "{profile}"'}}]}}]
    else:
        requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu", "allocationMode": "ExactCount",
                                                "count": rng.choice([1, 1, 2]),
                                                "selectors": [{"cel": {"expression": "!device.allowMultipleAllocations"}}]}},
                    {"name": "nic", "exactly": {"deviceClassName": "nic", "allocationMode": "ExactCount", "count": 1}}]
        constraints.append({"matchAttribute": "resource.kubernetes.io/pcieRoot"})
    spec: dict = {"devices": {"requests": requests}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "claim", "namespace": "default", "uid": "uid-claim"}, "spec": spec}


# -- the check ---------------------------------------------------------------------------------------------
def explain_blocking(sc: dict) -> blocking.NodeBlocking:
    world = w.build(sc["slices"] + sc["classes"] + sc["allocated"])
    claims = [engine.PodClaim(f"default/{c['metadata']['name']}", c["spec"], "default", c["metadata"]["uid"])
              for c in sc["claims"]]
    return blocking.node_blocking(claims, NODE, world)


def _oracle_fits(oracle: diff.Oracle, sc: dict, allocated: list[dict]) -> bool | str:
    raw = oracle.ask({"op": "allocate", "node": {"name": NODE}, "slices": sc["slices"], "classes": sc["classes"],
                      "claims": sc["claims"], "allocated": allocated})
    return f"error: {raw['error']}" if raw.get("error") else bool(raw.get("fits"))


def check(oracle: diff.Oracle, sc: dict, exhaustive: bool = False) -> dict:
    """What explain answers for the layout and whether the oracle agrees with each part:
    kind "blocked" (a set found), "fits", "hopeless"; problems lists each disagreement.
    With `exhaustive`, a set said to be the smallest is also held to every smaller set of
    the layout's claims: the allocator places the request after none of them."""
    answer = explain_blocking(sc)
    named = {h.claim for h in answer.claims}
    problems = []
    if answer.fits:
        if _oracle_fits(oracle, sc, sc["allocated"]) is not True:
            problems.append("explain: fits as it is; the allocator: it does not")
        return {"kind": "fits", "problems": problems, "size": 0}
    if _oracle_fits(oracle, sc, sc["allocated"]) is not False:
        problems.append("explain: does not fit as it is; the allocator: it fits")
    if not answer.helps:
        if _oracle_fits(oracle, sc, []) is not False:
            problems.append("explain: no removal can help; the allocator places it on the empty node")
        return {"kind": "hopeless", "problems": problems, "size": 0}
    kept = [c for c in sc["allocated"] if f"default/{c['metadata']['name']}" not in named]
    if _oracle_fits(oracle, sc, kept) is not True:
        problems.append(f"the blocking set {sorted(named)} removed: the allocator still does not place it")
    for claim in sc["allocated"]:
        if f"default/{claim['metadata']['name']}" in named:
            back = kept + [claim]
            if _oracle_fits(oracle, sc, back) is not False:
                problems.append(f"not minimal: with {claim['metadata']['name']} put back the allocator places it")
    if exhaustive and answer.smallest:
        for size in range(len(named)):
            for removed in itertools.combinations(range(len(sc["allocated"])), size):
                rest = [c for i, c in enumerate(sc["allocated"]) if i not in removed]
                if _oracle_fits(oracle, sc, rest) is not False:
                    gone = [sc["allocated"][i]["metadata"]["name"] for i in removed]
                    problems.append(f"not the smallest: removing {gone} lets the allocator place it")
                    break
    return {"kind": "blocked", "problems": problems, "size": len(named), "smallest": answer.smallest}


def run(oracle: diff.Oracle, seed: int, blocked_wanted: int, max_layouts: int | None = None,
        exhaustive: int = 0) -> dict:
    """Layouts from `seed` on until `blocked_wanted` of them have a blocking set (or
    `max_layouts` were checked); the first `exhaustive` of them also against every
    smaller set."""
    counts = {"blocked": 0, "fits": 0, "hopeless": 0}
    sizes: dict[int, int] = {}
    by_kind: dict[str, int] = {}
    disagreements = []
    current = seed
    while counts["blocked"] < blocked_wanted and (max_layouts is None or current - seed < max_layouts):
        sc = layout(current)
        found = check(oracle, sc, exhaustive=counts["blocked"] < exhaustive)
        counts[found["kind"]] += 1
        if found["kind"] == "blocked":
            kind = sc["kind"] + (" (a pod of 2 claims)" if len(sc["claims"]) > 1 else "")
            by_kind[kind] = by_kind.get(kind, 0) + 1
            sizes[found["size"]] = sizes.get(found["size"], 0) + 1
            counts["not proven smallest"] = counts.get("not proven smallest", 0) + (not found["smallest"])
        if found["problems"]:
            disagreements.append({"seed": current, "kind": sc["kind"], "problems": found["problems"]})
        current += 1
    return {"seeds": f"{seed}..{current - 1}", "counts": counts, "blocked by kind": by_kind,
            "set sizes": dict(sorted(sizes.items())), "disagreements": disagreements}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="layouts with a blocking set to check")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--oracle", help="a built hack/allocator-oracle (default: build it)")
    parser.add_argument("--exhaustive", type=int, default=0,
                        help="hold the first N sets to every smaller set of claims too")
    args = parser.parse_args()
    binary = Path(args.oracle) if args.oracle else diff.build_oracle()
    if binary is None:
        print("Go is not installed: cannot build hack/allocator-oracle", file=sys.stderr)
        return 2
    oracle = diff.Oracle(binary)
    start = time.perf_counter()
    try:
        result = run(oracle, args.seed, args.count, exhaustive=args.exhaustive)
    finally:
        oracle.close()
    print(json.dumps({k: v for k, v in result.items() if k != "disagreements"}
                     | {"disagreements": len(result["disagreements"]), "seconds": round(time.perf_counter() - start, 1)}))
    for item in result["disagreements"][:5]:
        print(json.dumps(item))
    return 1 if result["disagreements"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
