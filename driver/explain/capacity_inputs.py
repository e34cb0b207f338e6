"""What `dra-driver capacity` reads, and how it reads a large cluster quickly.

Inputs are explain's (driver.explain.sources): a cluster through a kubeconfig, files of
ResourceSlices and allocated ResourceClaims, or mock nodes. `--mock PROFILE[xN]` is N
mock nodes of a profile (mock-node-1, mock-node-2, ...), each publishing its own pool.

A thousand nodes: the world is cut into one world per node where every slice names its
node (`nodeName`) and no pool spans nodes, each with the claims allocated from its pools;
nodes whose slices and allocations are the same but for the node's and pools' names get
the same answer, computed once. Where a slice is for all nodes or a node selector, or a
pool spans nodes, the whole world is kept (the engine gathers each node's view).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from driver.explain import sources
from driver.explain import world as w

_MOCK = re.compile(r"^(?P<profile>.+?)(?:x(?P<count>\d+))?$")


def mock_nodes(specs: list[str], driver: str, gpu_sharing: str, mig_mode: str) -> list[dict]:
    """The objects of `--mock PROFILE[xN]` (repeatable): one node `mock-node` for a single
    PROFILE, else mock-node-1, mock-node-2, ... across all of them; DeviceClasses once.
    A profile whose name ends in xN itself (h100x8) is that profile, not 'h100' eight times."""
    from driver.devices.mock import builtin_profiles

    known = set(builtin_profiles())
    plan: list[tuple[str, int]] = []
    for spec in specs:
        match = _MOCK.match(spec)
        if spec in known or match is None or match.group("count") is None:
            plan.append((spec, 1))
            continue
        count = int(match.group("count"))
        if count < 1:
            raise sources.SourceError(f"--mock {spec}: the node count must be at least 1")
        plan.append((match.group("profile"), count))
    total = sum(n for _, n in plan)
    objects: list[dict] = []
    classes: dict[str, dict] = {}
    index = 0
    for profile, count in plan:
        published = sources.mock_objects(profile, driver, gpu_sharing, mig_mode)
        for obj in published:
            if obj.get("kind") == "DeviceClass":
                classes.setdefault(obj["metadata"]["name"], obj)
        slices = [o for o in published if o.get("kind") == "ResourceSlice"]
        for _ in range(count):
            index += 1
            name = sources.MOCK_NODE if total == 1 else f"{sources.MOCK_NODE}-{index}"
            objects += [renamed(o, sources.MOCK_NODE, name) for o in slices]
    return objects + list(classes.values())


def renamed(slice_object: dict, old: str, new: str) -> dict:
    """A mock node's slice as another node publishes it: node name, pool, slice name."""
    obj = copy.deepcopy(slice_object)
    spec = obj["spec"]
    if spec.get("nodeName") == old:
        spec["nodeName"] = new
    pool = spec.get("pool") or {}
    if pool.get("name") == old:
        pool["name"] = new
    meta = obj.setdefault("metadata", {})
    if str(meta.get("name", "")).startswith(old):
        meta["name"] = new + meta["name"][len(old):]
    return obj


@dataclass
class NodeWorld:
    """One node's own objects, and the key of its content without names (same key, same
    answer); its world is built when first asked for (a node answered already needs none)."""

    node: str
    objects: list[dict]
    key: str
    _world: w.World | None = None

    @property
    def world(self) -> w.World:
        if self._world is None:
            self._world = w.build(self.objects)
        return self._world


def per_node(objects: list[dict], nodes: list[str] | None = None) -> list[NodeWorld] | None:
    """One world per node, or None where the cluster does not cut into nodes (a slice for
    all nodes or a node selector, a pool with slices on several nodes)."""
    slices = [o for o in objects if o.get("kind") == "ResourceSlice"]
    pool_node: dict[tuple[str, str], str] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        node = spec.get("nodeName")
        if not node or spec.get("perDeviceNodeSelection"):
            return None
        key = (spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""))
        if pool_node.setdefault(key, node) != node:
            return None
    shared = [o for o in objects if o.get("kind") in ("DeviceClass", "Namespace", "DeviceTaintRule")]
    grouped: dict[str, list[dict]] = {}
    for obj in slices:
        grouped.setdefault(obj["spec"]["nodeName"], []).append(obj)
    for obj in objects:
        if obj.get("kind") == "Node":
            name = (obj.get("metadata") or {}).get("name")
            if name in grouped:
                grouped[name].append(obj)
    claims: dict[str, list[dict]] = {}
    for obj in objects:
        if obj.get("kind") != "ResourceClaim":
            continue
        results = ((((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])
        pools = {(r.get("driver", ""), r.get("pool", "")) for r in results}
        for node in sorted({pool_node[k] for k in pools if k in pool_node}):
            claims.setdefault(node, []).append(obj)
    wanted = nodes if nodes is not None else sorted(grouped)
    out = []
    for node in wanted:
        if node not in grouped:
            continue
        mine = grouped[node] + claims.get(node, [])
        key = _key(node, grouped[node], claims.get(node, []))
        if any(o.get("kind") == "DeviceTaintRule" for o in shared):
            key = node + key  # a rule may name a pool, whose name is the node's own: never shared
        out.append(NodeWorld(node, mine + shared, key))
    return out


def _key(node: str, objects: list[dict], claims: list[dict]) -> str:
    """The node's slices, Node labels and taints, and what is allocated from its pools, with the
    node's and its pools' names (and the claims' names) left out."""
    pools = sorted({(o["spec"].get("pool") or {}).get("name", "") for o in objects if o.get("kind") == "ResourceSlice"})
    index = {name: f"pool-{i}" for i, name in enumerate(pools)}
    parts = []
    for obj in objects:
        if obj.get("kind") == "ResourceSlice":
            spec = dict(obj["spec"])
            spec.pop("nodeName", None)
            pool = dict(spec.get("pool") or {})
            pool["name"] = index.get(pool.get("name", ""), "")
            spec["pool"] = pool
            parts.append(["slice", spec])
        else:  # a Node
            parts.append(["node", (obj.get("metadata") or {}).get("labels"), (obj.get("spec") or {}).get("taints")])
    for claim in claims:
        results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])
        parts.append(["claim", [{**r, "pool": index.get(r.get("pool", ""), r.get("pool"))} for r in results]])
    return "\n".join(sorted(json.dumps(p, sort_keys=True) for p in parts))
