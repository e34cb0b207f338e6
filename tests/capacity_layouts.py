"""Fragmented layouts of mock nodes for `dra-driver capacity` (issue 41), and their check
against the real allocator (hack/allocator-oracle, see tests/differential.py).

A layout is one mock node (a profile, with a GPU sharing and MIG mode) on which a seeded
number of claims of random kinds (1-2 GPUs, a NIC, a GPU+NIC, a MIG profile, an FPGA, a
share of a GPU) were allocated on devices taken in a random order (so that they scatter),
each allocation made by explain's engine, so that the layout is one the scheduler could
have reached. The check: for every finding of capacity on the layout, the claims of the
largest size are allocated by the oracle, and those of the next size up are not.

    python3 tests/capacity_layouts.py --count 1000 --seed 1
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from driver.explain import capacity  # noqa: E402
from driver.explain import engine  # noqa: E402
from driver.explain import world as w  # noqa: E402
from driver.publish import mocknode  # noqa: E402

DRIVER = "accel.dra.io"
NODE = mocknode.MOCK_NODE
# (profile, GPU sharing, MIG mode), weighted: the large dynamic node is rarer (its slices are big)
PROFILES = [("mixed", "exclusive", "static")] * 3 + [("mixed", "consumable", "static")] * 3 + [
    ("mixed", "exclusive", "dynamic"), ("a100-mig", "exclusive", "static"), ("a100-mig", "exclusive", "static"),
    ("l4", "exclusive", "static"), ("l4", "consumable", "static"), ("alveo", "exclusive", "static"),
    ("dfl", "exclusive", "static"), ("h100x8", "exclusive", "static"), ("h100x8", "exclusive", "static")]


@functools.lru_cache(maxsize=None)
def published(profile: str, sharing: str, mig_mode: str) -> str:
    return json.dumps(mocknode.mock_objects(profile, DRIVER, sharing, mig_mode))


@functools.lru_cache(maxsize=None)
def _empty(profile: str, sharing: str, mig_mode: str) -> w.World:
    return w.build(json.loads(published(profile, sharing, mig_mode)))


def _ask(rng: random.Random, devices: list[w.PoolDevice]) -> dict | None:
    """A random request that the node's devices could serve, as a claim spec."""
    ref = f'device.attributes["{DRIVER}"]'
    kinds = {t: [d for d in devices if d.attribute("type") == t] for t in ("gpu", "mig", "nic", "fpga")}
    choices = [k for k, ds in kinds.items() if ds]
    if not choices:
        return None
    kind = rng.choice(choices + (["pair"] if kinds["gpu"] and kinds["nic"] else []))
    if kind == "pair":
        return {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}},
                                         {"name": "nic", "exactly": {"deviceClassName": f"nic.{DRIVER}"}}],
                            "constraints": [{"matchAttribute": capacity.PCIE_ROOT}]}}
    exactly: dict = {"deviceClassName": f"{kind}.{DRIVER}", "count": 1}
    if kind == "gpu":
        shareable = [d for d in kinds["gpu"] if d.multiple]
        if shareable and rng.random() < 0.7:
            exactly["capacity"] = {"requests": rng.choice([{"memory": f"{rng.choice([5, 10, 20, 30, 40])}Gi"},
                                                           {"compute": str(rng.choice([10, 25, 50])),
                                                            "memory": "1Gi"}])}
        elif rng.random() < 0.3:
            exactly["count"] = 2
    if kind == "mig":
        profile = rng.choice(sorted({d.attribute("profile") for d in kinds["mig"]}))
        exactly["selectors"] = [{"cel": {"expression": f'{ref}.profile == "{profile}"'}}]
    return {"devices": {"requests": [{"name": kind, "exactly": exactly}]}}


def layout(seed: int) -> dict:
    rng = random.Random(seed)
    profile, sharing, mig_mode = rng.choice(PROFILES)
    objects = json.loads(published(profile, sharing, mig_mode))
    claims: list[dict] = []
    model = capacity.NodeModel.of(_empty(profile, sharing, mig_mode), NODE)
    for index in range(rng.randint(1, 8)):
        rng.shuffle(model.devices)  # the engine takes the first devices that fit: scatter them
        spec = _ask(rng, model.devices)
        if spec is None:
            break
        results = model.allocate([spec])
        if results is None:
            continue
        # the node's ledger with this claim's allocation (as the world with the claim would have it)
        model.ledger = engine._with(model.ledger, f"default/held-{index}", results)
        for n, result in enumerate(results):
            if "consumedCapacity" in result:
                result["shareID"] = f"00000000-0000-0000-{index:04d}-{n:012d}"
        claims.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": f"held-{index}", "namespace": "default", "uid": f"uid-held-{index}"},
                       "spec": spec,
                       "status": {"allocation": {"devices": {"results": results}, "nodeSelector": {
                           "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                   "values": [NODE]}]}]}}}})
    return {"seed": seed, "profile": f"{profile}/{sharing}/{mig_mode}", "objects": objects, "claims": claims}


def oracle_requests(lay: dict) -> list[tuple[dict, bool, str]]:
    """(the oracle's request, whether capacity says it fits, what it is) per finding: the
    largest size (fits), the next size up (does not)."""
    world = w.build(lay["objects"] + lay["claims"])
    found = capacity.capacity(world, DRIVER)
    slices = [o for o in lay["objects"] if o["kind"] == "ResourceSlice"]
    classes = [o for o in lay["objects"] if o["kind"] == "DeviceClass"]
    out = []
    for node in found.nodes:
        for finding in node.findings:
            for specs, fits, size in ((finding.request, True, finding.largest),
                                      (finding.next_request, False, finding.next_size)):
                if not specs:
                    continue
                claims = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": f"probe-{i}", "namespace": "default", "uid": f"uid-probe-{i}"},
                           "spec": spec} for i, spec in enumerate(specs)]
                out.append(({"op": "allocate", "node": {"name": node.node}, "slices": slices, "classes": classes,
                             "claims": claims, "allocated": lay["claims"]}, fits,
                            f"{finding.kind} {finding.label} {size}"))
    return out


def ask_all(oracle, requests: list[dict]) -> list[dict]:
    """The oracle's answers to many requests: written by a thread while the answers are
    read, so that the pipe never waits on a round trip per request."""
    proc = oracle.proc

    def write() -> None:
        for request in requests:
            proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answers = [json.loads(proc.stdout.readline()) for _ in requests]
    writer.join()
    return answers


def check(oracle, seeds, batch: int = 50) -> dict:
    """Counts of agreeing and disagreeing answers over the layouts of these seeds, and the disagreements."""
    counts = {"agree": 0, "disagree": 0, "layouts": 0}
    disagreements = []
    seeds = list(seeds)
    for start in range(0, len(seeds), batch):
        pending = []
        for seed in seeds[start:start + batch]:
            lay = layout(seed)
            counts["layouts"] += 1
            pending += [(lay, request, fits, what) for request, fits, what in oracle_requests(lay)]
        answers = ask_all(oracle, [request for _, request, _, _ in pending])
        for (lay, _, fits, what), answer in zip(pending, answers):
            theirs = bool(answer.get("fits")) and not answer.get("error")
            if theirs == fits:
                counts["agree"] += 1
            else:
                counts["disagree"] += 1
                disagreements.append({"seed": lay["seed"], "profile": lay["profile"], "probe": what,
                                      "capacity": fits, "scheduler": answer})
    return {"counts": counts, "disagreements": disagreements}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import differential

    binary = differential.build_oracle()
    if binary is None:
        print("Go is not installed: hack/allocator-oracle cannot be built", file=sys.stderr)
        return 2
    oracle = differential.Oracle(binary)
    try:
        result = check(oracle, range(args.seed, args.seed + args.count))
    finally:
        oracle.close()
    print(f"seeds {args.seed}..{args.seed + args.count - 1}: {json.dumps(result['counts'])}")
    for d in result["disagreements"][:5]:
        print(json.dumps(d)[:2000])
    return 1 if result["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
