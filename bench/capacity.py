"""`python -m bench capacity`: `dra-driver capacity` over a thousand mock nodes (issue 41).

Figures (median of --runs, from the objects in memory to the answer, as the command
computes it after reading its inputs):
- `mixed` x N, as published (every node the same): the goal is <= 2 s for 1,000 nodes;
- `mixed` x N fragmented: each node holds a seeded random subset of its GPUs, NICs and
  FPGAs in claims (the nodes fall into the few layouts a subset makes);
- the baseline in the same run: the per-node answer without sharing answers between
  identical nodes (each node's world built and every probe run), timed on --sample nodes
  and scaled to N; the ratio says what cutting the world per node and answering each
  distinct node once saves.

    python -m bench capacity [--nodes 1000] [--runs 3] [--sample 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from driver.explain import capacity, capacity_inputs

DRIVER = "accel.dra.io"


def _fragmented(objects: list[dict], seed: int) -> list[dict]:
    """Each node's devices (GPUs, NICs on GPU roots, FPGAs) held at random by claims."""
    rng = random.Random(seed)
    claims = []
    for obj in objects:
        if obj.get("kind") != "ResourceSlice":
            continue
        names = [d["name"] for d in obj["spec"].get("devices") or []
                 if d["name"].startswith(("gpu-", "fpga-", "nic-0000-12", "nic-0000-22"))]
        taken = [n for n in names if rng.random() < 0.4]
        if taken:
            claims.append({"kind": "ResourceClaim",
                           "metadata": {"name": f"held-{len(claims)}", "namespace": "default",
                                        "uid": f"u{len(claims)}"},
                           "spec": {"devices": {"requests": []}},
                           "status": {"allocation": {"devices": {"results": [
                               {"request": "r", "driver": DRIVER, "pool": obj["spec"]["pool"]["name"], "device": n}
                               for n in taken]}}}})
    return objects + claims


def _time(objects: list[dict], runs: int) -> tuple[float, int, int]:
    """(median seconds, nodes, distinct nodes) of capacity over these objects."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        split = capacity_inputs.per_node(objects)
        result = capacity.capacity_per_node(split, DRIVER)
        times.append(time.perf_counter() - started)
    return statistics.median(times), len(result.nodes), len({item.key for item in split})


def _per_node_baseline(objects: list[dict], sample: int) -> float:
    """Seconds a node without sharing answers: its world built, every probe run."""
    every = capacity_inputs.per_node(objects)
    split = every[::max(len(every) // sample, 1)][:sample]  # spread over the nodes: their layouts differ
    started = time.perf_counter()
    for item in split:
        capacity.node_capacity(capacity_inputs.NodeWorld(item.node, item.objects, item.key).world, item.node, DRIVER)
    return (time.perf_counter() - started) / len(split)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench capacity")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sample", type=int, default=20, help="nodes timed for the per-node baseline")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    objects = capacity_inputs.mock_nodes([f"mixedx{args.nodes}"], DRIVER, "exclusive", "static")
    print(f"{args.nodes} mixed nodes published (mock discovery, once): {time.perf_counter() - started:.2f} s")
    capacity.node_capacity(capacity_inputs.per_node(objects)[0].world, "mock-node-1", DRIVER)  # CEL compiled once
    fragmented = _fragmented(objects, args.seed)
    per_node = _per_node_baseline(fragmented, args.sample)
    print(f"baseline: one node answered alone (world built, every probe): {per_node * 1000:.1f} ms "
          f"-> {per_node * args.nodes:.2f} s for {args.nodes} nodes")
    for name, objs in (("as published", objects), (f"fragmented (seed {args.seed})", fragmented)):
        seconds, nodes, distinct = _time(objs, args.runs)
        print(f"capacity, {nodes} mixed nodes {name}: {seconds:.2f} s median of {args.runs} "
              f"({distinct} distinct nodes; goal <= 2 s; {per_node * args.nodes / seconds:.1f}x faster than "
              "the baseline)")
    return 0
