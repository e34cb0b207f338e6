"""What blocks a request (`explain --blocking`): per node, the smallest set of other claims'
allocations whose removal lets the request fit, with the pods that use those claims.

Every answer comes from the engine, never from arithmetic of its own: a set "works" on a
node when the engine, run on the node with those claims' allocations taken out of the
world, places the request (a pod's claims together, as explain_pod_node does). The search,
per node:

1. the candidates: the claims holding a device that could serve the request (one not ruled
   out by its DeviceClass or selectors) or a device that draws on the same shared counters;
   no other claim can change the answer;
2. with every candidate removed it must fit, else no removal can help (item 5 of issue 41:
   the request is larger than the node, said with the engine's words);
3. the necessary claims: those without whose removal even removing all the others does not
   help. Every working set holds them, since freeing more never hurts;
4. a minimal set, greedily: from all candidates, put back each claim (those holding the
   fewest devices first) whose allocation the request can live beside;
5. the smallest set: the necessary claims plus 0, 1, 2, ... others, by increasing size, up
   to the greedy set's size, within a bound on the engine runs; where the bound is reached
   the greedy set is the answer (still minimal: no claim of it can stay) and says so;
6. of the smallest sets, the one holding the fewest devices, then used by the fewest pods
   (the least to drain), as far as the bound allows.

"Freeing more never hurts" (monotonicity) is what makes steps 3 and 4 exact; the
generated check in tests/test_blocking_generated.py holds the sets to the real allocator:
removed, the request fits; any one claim put back, it does not.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from driver.explain import engine
from driver.explain import world as w
from driver.explain.verdicts import CLASS, SELECTOR

# Engine runs per node for step 5 (the exact search), beyond the 2 x candidates of steps 3
# and 4: a node with 8 single-GPU claims and a request for 8 needs none (all are necessary);
# one with 30 candidates and a set of 6 would need C(30, 5) = 142,506 without a bound.
SEARCH_LIMIT = 300


@dataclass
class Held:
    """One claim of a blocking set: what it holds on the node, and who uses it."""

    claim: str  # namespace/name
    devices: list[str]  # device names, a share with its amounts ("gpu-0 (memory 10Gi)")
    pods: list[str]  # namespace/name of the pods in its status.reservedFor


@dataclass
class NodeBlocking:
    node: str
    fits: bool  # it fits already: nothing to remove
    helps: bool  # some removal lets it fit (false: none can, see why)
    claims: list[Held] = field(default_factory=list)  # the set to remove
    smallest: bool = True  # no smaller set works (false: the search bound was reached)
    searched: str = ""  # how far the search went, for people
    runs: int = 0  # engine runs on this node
    candidates: int = 0  # claims whose removal could matter on this node
    allocation: list[dict] = field(default_factory=list)  # what the request gets once they are gone
    why: str = ""  # why it does not fit as it is (or, with helps false, even when free)

    @property
    def size(self) -> int:
        return len(self.claims)


@dataclass
class Blocking:
    request: str  # the claim's or pod's namespace/name, or the --request text
    source: str
    nodes: list[NodeBlocking]  # by the size of their set: fitting ones first, hopeless ones last
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return any(n.fits for n in self.nodes)


def blocking(claims: list[engine.PodClaim], world: w.World, nodes: list[str] | None = None,
             request: str = "", source: str = "", filtered: dict[str, str] | None = None,
             limit: int = SEARCH_LIMIT) -> Blocking:
    """The blocking set of each node for these claims (one claim, or a pod's claims placed
    together). `filtered`: node -> why the pod's node filters leave it out."""
    for claim in claims:
        engine.requests(claim.ref, claim.spec)  # a malformed claim is a usage error first
    considered = nodes if nodes is not None else world.nodes()
    found = []
    for node in considered:
        if node in (filtered or {}):
            found.append(NodeBlocking(node, False, False, why=filtered[node], searched="not searched"))
        else:
            found.append(node_blocking(claims, node, world, limit))
    found.sort(key=lambda n: (not n.helps and not n.fits, n.size, n.node))
    return Blocking(request or " + ".join(c.ref for c in claims), source, found, list(world.notes))


def node_blocking(claims: list[engine.PodClaim], node: str, world: w.World,
                  limit: int = SEARCH_LIMIT) -> NodeBlocking:
    view = world.view(node)
    own = frozenset(c.uid for c in claims if c.uid)
    devices = _relevant(claims, view, view.on_node(node), own)
    candidates = _candidates(view, devices, own)
    local = dataclasses.replace(view, claims=candidates, _views={})
    runs = 0

    def fits(removed: frozenset[int]) -> list | None:
        nonlocal runs
        runs += 1
        kept = dataclasses.replace(local, claims=[c for i, c in enumerate(candidates) if i not in removed],
                                   _views={})
        return engine._together(claims, node, kept, devices, engine._ledger(kept, devices, own))

    everyone = frozenset(range(len(candidates)))
    placed = fits(frozenset())
    if placed is not None:
        return NodeBlocking(node, True, True, searched="fits as it is", runs=runs, candidates=len(candidates),
                            allocation=_allocation(claims, placed), why=engine.FITS)
    if not candidates or fits(everyone) is None:
        return NodeBlocking(node, False, False, searched="no claim's removal lets it fit", runs=runs,
                            candidates=len(candidates), why=_why(claims, node, world))
    why = (_why(claims, node, world) if len(claims) > 1 else
           engine._judge_node(claims[0].ref, claims[0].spec, node, local, devices,
                              engine._ledger(local, devices, own), claims[0].namespace).why)
    necessary = frozenset(i for i in everyone if fits(everyone - {i}) is None)
    # Put back the claims holding the fewest devices first: the set left tends to few large
    # holders, which is what step 5 looks for (step 6 then prefers light sets of that size).
    chosen = everyone
    for i in sorted(everyone - necessary, key=lambda i: (_weight(candidates[i], devices), i)):
        if fits(chosen - {i}) is not None:
            chosen = chosen - {i}
    smallest, searched = True, f"{len(candidates)} candidate claim(s): no smaller set works"
    others = sorted(everyone - necessary)
    budget = limit
    for extra in range(0, len(chosen) - len(necessary)):
        better, complete = None, True
        for combo in itertools.combinations(others, extra):
            if budget == 0:
                complete = False
                break
            budget -= 1
            if fits(necessary | set(combo)) is not None:
                better = necessary | set(combo)
                break
        if better is not None:
            chosen = better
            break
        if not complete:
            smallest = False
            done = f"every set of up to {len(necessary) + extra - 1} claim(s) tried; " if extra else ""
            searched = (f"gave up after {limit} sets: {done}this set of {len(chosen)} is minimal (no claim of "
                        "it can stay), a smaller one may exist")
            break
    if smallest:
        # Of the sets of that size, the one holding the fewest devices, then with the fewest
        # pods using them: the least to drain. Only a lighter set costs an engine run.
        def weight(chosen_set) -> tuple[int, int]:
            return (sum(_weight(candidates[i], devices) for i in chosen_set),
                    sum(len(_pods(candidates[i])) for i in chosen_set))

        for combo in itertools.combinations(others, len(chosen) - len(necessary)):
            if budget == 0:
                break
            lighter = necessary | set(combo)
            if weight(lighter) < weight(chosen):
                budget -= 1
                if fits(lighter) is not None:
                    chosen = lighter
    placed = fits(chosen)
    return NodeBlocking(node, False, True, [_held(candidates[i], devices, view) for i in sorted(chosen)],
                        smallest, searched, runs, len(candidates), _allocation(claims, placed or []), why)


def _relevant(claims: list[engine.PodClaim], world: w.World, devices: list[w.PoolDevice],
              own: frozenset[str]) -> list[w.PoolDevice]:
    """The node's devices that some alternative of some request does not rule out by its
    DeviceClass or selectors, in the node's order. The others never serve the request
    whatever is removed; leaving them out keeps each engine run to what matters."""
    ledger = engine._ledger(world, devices, own, vacant=True)
    alternatives = [(c.namespace, alt) for c in claims for _, alts in engine.requests(c.ref, c.spec) for alt in alts]
    return [w.RememberedDevice.of(d) for d in devices
            if any(engine.judge(alt, d, world, ledger, namespace).code not in (CLASS, SELECTOR)
                   for namespace, alt in alternatives)]


def _candidates(world: w.World, devices: list[w.PoolDevice], own: frozenset[str]) -> list[dict]:
    """The allocated claims whose removal could change the answer: they hold one of these
    devices, or one that draws on the same shared counters (a MIG partition of the same GPU,
    on this node or another node of the pool)."""
    sets = {(d.driver, d.pool, s) for d in devices for s in d.consumes}
    keys = {d.key for d in devices} | {d.key for d in world.devices + world.elsewhere
                                       if any((d.driver, d.pool, s) in sets for s in d.consumes)}
    found = []
    for claim in world.claims:
        meta = claim.get("metadata") or {}
        if meta.get("uid") and meta["uid"] in own:
            continue
        if any(f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" in keys and not r.get("adminAccess")
               for r in _results(claim)):
            found.append(claim)
    found.sort(key=lambda c: (c["metadata"].get("namespace", "default"), c["metadata"].get("name", "")))
    return found


def _results(claim: dict) -> list[dict]:
    return ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])


def _weight(claim: dict, devices: list[w.PoolDevice]) -> int:
    keys = {d.key for d in devices}
    return sum(1 for r in _results(claim) if f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" in keys)


def _held(claim: dict, devices: list[w.PoolDevice], world: w.World) -> Held:
    meta = claim.get("metadata") or {}
    namespace = meta.get("namespace", "default")
    on_node = {d.key for d in world.devices + world.elsewhere}
    held = []
    for r in _results(claim):
        if f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" not in on_node or r.get("adminAccess"):
            continue
        consumed = r.get("consumedCapacity")
        held.append(r.get("device", "?") + (f" ({', '.join(f'{k} {v}' for k, v in consumed.items())})"
                                            if consumed else ""))
    return Held(f"{namespace}/{meta.get('name', '?')}", list(dict.fromkeys(held)), _pods(claim))


def _pods(claim: dict) -> list[str]:
    """The pods in the claim's status.reservedFor, as namespace/name."""
    namespace = (claim.get("metadata") or {}).get("namespace", "default")
    return [f"{namespace}/{ref.get('name', '?')}" for ref in (claim.get("status") or {}).get("reservedFor") or []
            if isinstance(ref, dict) and ref.get("resource", "pods") == "pods"]


def _allocation(claims: list[engine.PodClaim], reports) -> list[dict]:
    """What each request would get; a pod's results name their claim."""
    return [({"claim": claim.ref} if len(claims) > 1 else {}) | result
            for claim, report in zip(claims, reports) for result in report.allocation]


def _why(claims: list[engine.PodClaim], node: str, world: w.World) -> str:
    """The engine's own words for the node as it is (and, where no removal helps, as it
    would be with nothing allocated: item 5's "no device of the node can hold it")."""
    if len(claims) == 1:
        claim = claims[0]
        return engine.explain_node(claim.ref, claim.spec, node, world, claim.namespace, claim.uid).why
    reports = engine.explain_pod_node(claims, node, world)
    failed = [r for r in reports if not r.fits]
    return failed[-1].why if failed else engine.FITS
