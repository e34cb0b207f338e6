"""`explain --blocking` on a fleet: N nodes of a mock profile (h100x8 by default: 8 GPUs and
8 NICs each), other claims holding GPUs on every node (seeded), and a request for all 8
GPUs of a node, which fits nowhere. Prints the time of the blocking answer, and of plain
`explain` of the same request on the same fleet, measured in the same run, and their ratio.

    python3 -m bench.blocking [--nodes 100] [--profile h100x8] [--seed 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

from driver.explain import blocking, blocking_request, engine, sources
from driver.explain import world as w

DRIVER = "accel.dra.io"


def fleet(nodes: int, profile: str, seed: int) -> list[dict]:
    """The mock node's slices once per node (pool and nodeName renamed), its classes, and
    claims holding 1 to 3 GPUs each on every node, leaving 1 to 4 GPUs free."""
    rng = random.Random(seed)
    objects = sources.mock_objects(profile, DRIVER, "exclusive", "static")
    slices = [o for o in objects if o["kind"] == "ResourceSlice"]
    out = [o for o in objects if o["kind"] == "DeviceClass"]
    for n in range(nodes):
        node = f"node-{n:03d}"
        gpus = []
        for original in slices:
            copied = copy.deepcopy(original)
            copied["metadata"]["name"] = original["metadata"]["name"].replace(sources.MOCK_NODE, node)
            copied["spec"]["nodeName"] = node
            copied["spec"]["pool"]["name"] = node
            out.append(copied)
            gpus += [d["name"] for d in copied["spec"].get("devices") or []
                     if d["attributes"]["type"]["string"] == "gpu"]
        rng.shuffle(gpus)
        taken = rng.randint(len(gpus) // 2, len(gpus) - 1)
        index = 0
        while taken > 0:
            size = min(taken, rng.randint(1, 3))
            held, gpus = gpus[:size], gpus[size:]
            taken -= size
            out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                        "metadata": {"name": f"{node}-job-{index}", "namespace": "team", "uid": f"{node}-{index}"},
                        "spec": {"devices": {"requests": []}},
                        "status": {"allocation": {"devices": {"results": [
                            {"request": "gpu", "driver": DRIVER, "pool": node, "device": d} for d in held]}},
                            "reservedFor": [{"resource": "pods", "name": f"{node}-job-{index}-0", "uid": "u"}]}})
            index += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.blocking")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--profile", default="h100x8")
    parser.add_argument("--request", default="gpu=8")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    objects = fleet(args.nodes, args.profile, args.seed)
    explain_times, blocking_times = [], []
    answer = None
    for _ in range(args.runs):
        world = w.build(objects)  # fresh: no node view cached from the run before
        spec = blocking_request.claim_spec([args.request], world)
        start = time.perf_counter()
        explained = engine.explain("team/request", spec, world, "team")
        explain_times.append(time.perf_counter() - start)
        world = w.build(objects)
        start = time.perf_counter()
        answer = blocking.blocking([engine.PodClaim("team/request", spec, "team")], world)
        blocking_times.append(time.perf_counter() - start)
    assert answer is not None
    sizes: dict[int, int] = {}
    for node in answer.nodes:
        sizes[node.size] = sizes.get(node.size, 0) + 1
    runs = sum(n.runs for n in answer.nodes)
    explain_s, blocking_s = statistics.median(explain_times), statistics.median(blocking_times)
    print(f"explain --blocking, {args.nodes} nodes of {args.profile}, --request {args.request} "
          f"(fits on {sum(n.fits for n in explained.nodes)} node(s)), seed {args.seed}, median of {args.runs}:")
    print(f"  explain (why, per node):     {explain_s:7.2f} s")
    print(f"  explain --blocking:          {blocking_s:7.2f} s  ({blocking_s / explain_s:.1f} x explain; "
          f"{runs} engine runs, {runs / args.nodes:.1f} per node)")
    print(f"  set sizes (claims: nodes):   {dict(sorted(sizes.items()))}; "
          f"proven smallest on {sum(n.smallest for n in answer.nodes if n.helps)} of "
          f"{sum(n.helps for n in answer.nodes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
