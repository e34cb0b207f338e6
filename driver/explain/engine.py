"""Each request of a claim against each device of each node: the first reason it is out,
in the scheduler's order (DeviceClass selectors, the request's selectors, taints, other
claims' allocations, consumable capacity, shared counters), then the combinations: counts,
`matchAttribute` / `distinctAttribute` constraints and counters across the chosen devices.

It follows the allocator the demo uses (driver/scheduling/allocator.py) and reuses its capacity
rounding and counter bookkeeping, so that the two agree; tests hold them to it. One
difference is deliberate: the scheduler stops at the first CEL runtime error it meets,
which depends on the order it visits devices; here every device is evaluated and any
error is reported as aborting the node, with the device and expression.

A pod's claims are allocated together (explain_pod_node), as the scheduler allocates them:
each claim's search is the one above, and a claim whose devices leave no room for the
claims after it is searched on for its next choice.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from decimal import Decimal

from driver.kube import quantity as quantities
from driver.kube import releases
from driver.explain import suggest
from driver.explain import world as w
from driver.explain.verdicts import (ADMIN, ALLOCATED, CAPACITY, CAPACITY_ERROR, CEL_ERROR, CLASS, COUNTERS, FITS,
                                     SELECTOR, TAINT, Alternative, AlternativeReport, ClaimError,
                                     DeviceVerdict, Explanation, NodeReport)
from driver.scheduling import cel, taints
from driver.scheduling.allocator import Counters, Shares, _canonical, _round, capacity_error

def requests(claim: str, spec: dict) -> list[tuple[str, list[Alternative]]]:
    """The claim's requests, each with its alternatives (one unless firstAvailable)."""
    devices = spec.get("devices")
    if not isinstance(devices, dict) or not isinstance(devices.get("requests"), list) or not devices["requests"]:
        raise ClaimError(f"claim {claim}: spec.devices.requests is missing or empty")
    out = []
    for index, request in enumerate(devices["requests"]):
        if not isinstance(request, dict) or not request.get("name"):
            raise ClaimError(f"claim {claim}: spec.devices.requests[{index}] has no name")
        name = request["name"]
        if "firstAvailable" in request:
            subs = request["firstAvailable"]
            if not isinstance(subs, list) or not subs:
                raise ClaimError(f"claim {claim}: request {name}: firstAvailable is empty")
            # A subrequest has no adminAccess field: the scheduler never gives it admin access.
            out.append((name, [_alternative(claim, f"{name}/{s.get('name', i)}", {**s, "adminAccess": False})
                               for i, s in enumerate(subs)]))
        else:
            # v1beta1 claims put the fields on the request itself.
            exactly = request.get("exactly", request if "deviceClassName" in request else None)
            if not isinstance(exactly, dict):
                raise ClaimError(f"claim {claim}: request {name} has neither exactly nor firstAvailable")
            out.append((name, [_alternative(claim, name, exactly)]))
    return out


def _alternative(claim: str, name: str, spec: dict) -> Alternative:
    if not spec.get("deviceClassName"):
        raise ClaimError(f"claim {claim}: request {name} has no deviceClassName")
    selectors = []
    for i, selector in enumerate(spec.get("selectors") or []):
        expression = (selector.get("cel") or {}).get("expression") if isinstance(selector, dict) else None
        if not isinstance(expression, str):
            raise ClaimError(f"claim {claim}: request {name}: selectors[{i}] has no cel.expression")
        selectors.append(expression)
    mode = spec.get("allocationMode", "ExactCount")
    if mode not in ("ExactCount", "All"):
        raise ClaimError(f"claim {claim}: request {name}: allocationMode {mode!r} is neither ExactCount nor All")
    count = spec.get("count", 1)
    if mode == "ExactCount" and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ClaimError(f"claim {claim}: request {name}: count must be a positive integer, not {count!r}")
    capacity = ((spec.get("capacity") or {}).get("requests")) or {}
    for key, value in capacity.items():
        try:
            quantities.value(str(value))
        except quantities.QuantityError as err:
            raise ClaimError(f"claim {claim}: request {name}: capacity.requests.{key}: {err}") from None
    return Alternative(name, spec["deviceClassName"], tuple(selectors), None if mode == "All" else count,
                       tuple(spec.get("tolerations") or ()), dict(capacity), bool(spec.get("adminAccess")))


@dataclass
class _Ledger:
    """What other claims hold on one node: whole devices, capacity of shares, counters."""

    holders: dict[str, list[w.Holder]]
    shares: Shares
    counters: Counters


def _ledger(world: w.World, devices: list[w.PoolDevice], skip_uid: str | frozenset[str] | None,
            vacant: bool = False) -> _Ledger:
    """What other claims hold; with `vacant`, nothing: the node as if no claim were allocated.
    `skip_uid`: the claim(s) being explained, whose own allocations do not count."""
    skip = frozenset(u for u in ([skip_uid] if isinstance(skip_uid, str) else skip_uid or ()) if u)
    holders = {} if vacant else {key: kept for key, held in world.holders().items()
                                 if (kept := [h for h in held if h.uid not in skip])}
    shares = Shares()
    counters = Counters()
    for (driver, pool, name), totals in world.counter_sets.items():
        counters.totals[f"{driver}/{pool}/{name}"] = dict(totals)
    # Shared counters are the pool's, not the node's: devices allocated on other nodes
    # use them too.
    on_node = {d.key for d in devices}
    for device in world.devices + world.elsewhere:
        if device.key not in on_node and device.consumes:
            for _ in holders.get(device.key, ()):
                counters.consumes[device.key] = {f"{device.driver}/{device.pool}/{s}": dict(c)
                                                 for s, c in device.consumes.items()}
                counters.take(device.key)
                break
    for device in devices:
        if device.consumes:
            counters.consumes[device.key] = {f"{device.driver}/{device.pool}/{s}": dict(c)
                                             for s, c in device.consumes.items()}
        if device.multiple:
            shares.capacity[device.key] = device.capacity
    for device in devices:
        for index, holder in enumerate(holders.get(device.key, ())):
            if index == 0:
                counters.take(device.key)  # a shared device takes its counters once
            if device.multiple and holder.consumed:  # a share; a result that is no share holds it whole
                shares.take(device.key, {k: quantities.value(str(v)) for k, v in holder.consumed.items()})
    return _Ledger(holders, shares, counters)


def _seen(expression: str, device: w.PoolDevice) -> dict[str, str]:
    seen = {}
    if "device.driver" in expression:
        seen["driver"] = w.display(device.driver)
    for kind, domain, name in cel.references(expression):
        label = name if domain == device.driver else f"{domain}/{name}"
        seen[label] = w.display(device.lookup(kind, domain, name))
    return seen


def judge(alt: Alternative, device: w.PoolDevice, world: w.World, ledger: _Ledger,
          namespace: str) -> DeviceVerdict:
    """The first reason this device cannot serve this request alternative, or fits."""
    def verdict(code: str, reason: str, **extra) -> DeviceVerdict:
        return DeviceVerdict(device.name, device.driver, device.pool, code, reason, **extra)

    device_class = world.classes.get(alt.device_class)
    if device_class is None:
        return verdict(CLASS, f"DeviceClass {alt.device_class} does not exist")
    unsupported = device.unsupported_attribute()
    variables = device.activation() if unsupported is None else {}
    for owner, index, expression in _selectors(alt, device_class):
        try:
            if unsupported is not None:
                # The scheduler converts every attribute before it evaluates anything:
                # one without a value of a known type fails every selector on the device.
                raise cel.CelError(expression, f"attribute {unsupported}: unsupported attribute value")
            if not cel.evaluate(expression, variables):
                seen = _seen(expression, device)
                where = f"class {alt.device_class} selector #{index}" if owner else f"selector #{index}"
                return verdict(CLASS if owner else SELECTOR, f"{where} is false", seen=seen,
                               expression=expression)
        except cel.CelError as err:
            where = f"class {alt.device_class} selector #{index}" if owner else f"selector #{index}"
            return verdict(CEL_ERROR, f"{where}: CEL runtime error: {err.message}", expression=expression,
                           seen=_seen(expression, device))
    if (alt.admin and world.namespaces is not None
            and (label := releases.admin_access_label(world.release)) is not None):
        labels = world.namespaces.get(namespace)
        if labels is None or labels.get(label) != "true":
            return verdict(ADMIN, f"adminAccess needs namespace {namespace} labelled {label}=\"true\"")
    taint = taints.blocking(device.taints, alt.tolerations)
    if taint is not None:
        return verdict(TAINT, f"taint {taints.text(taint)} is not tolerated")
    holders = ledger.holders.get(device.key, [])
    whole = [h for h in holders if not (device.multiple and h.consumed is not None)]
    # Admin access ignores other claims' allocations, not capacity or counters.
    if whole and not alt.admin:
        return verdict(ALLOCATED, f"allocated to claim {whole[0].claim}")
    problem = capacity_error(device.capacity, alt.capacity)
    if problem:
        return verdict(CAPACITY_ERROR, problem)
    # A dedicated device serves a capacity request that it could hold (KEP-5075). A request
    # that a shareable device could not hold even when free is said so, without the
    # claims holding shares of it: naming them would suggest that freeing them helps.
    if (alt.capacity or device.multiple) and _never_holds(device, alt):
        return verdict(CAPACITY, _too_large(device, alt.capacity))
    if device.multiple:
        short = _capacity_short(device, alt.capacity, ledger.shares)
        if short:
            by = ", ".join(sorted({h.claim for h in holders}))
            return verdict(CAPACITY, short + (f" (held by {by})" if by else ""))
    if not (device.multiple and holders) and not ledger.counters.fits(device.key):
        # (a shared device already in use has taken its counters)
        return verdict(COUNTERS, _counters_short(device, ledger))
    return verdict(FITS, FITS)


def _too_large(device: w.PoolDevice, requests: dict) -> str:
    """Why a capacity request does not fit the device even with nothing allocated on it."""
    missing = sorted(set(requests) - set(device.capacity))
    if missing:
        return f"asks for capacity {missing[0]}, which the device does not have"
    parts = [f"{name} {wanted} wanted, {total} there" for name, wanted, total in _over(device, requests)]
    return "asks for more capacity than the device has: " + ", ".join(parts or [
        f"{k} {v} wanted, {device.capacity[k]['value']} there" for k, v in requests.items()])


def _over(device: w.PoolDevice, requests: dict) -> list[tuple[str, str, str]]:
    """(capacity, wanted, total) for each capacity of the device that the request, rounded
    up by the device's request policy, asks more of than the device has."""
    out = []
    for name, entry in device.capacity.items():
        policy = entry.get("requestPolicy") or {}
        wanted = str(requests.get(name, policy["default"] if policy.get("default") is not None else entry["value"]))
        rounded = _round(quantities.value(wanted), policy)
        if rounded is None or rounded > quantities.value(entry["value"]):
            out.append((name, wanted, entry["value"]))
    return out


def _dedicated_amount(device: w.PoolDevice, requests: dict):
    shares = Shares()
    shares.capacity[device.key] = device.capacity
    return shares.amount(device.key, requests)


def _selectors(alt: Alternative, device_class: w.DeviceClass):
    for index, expression in enumerate(device_class.selectors):
        yield True, index, expression
    for index, expression in enumerate(alt.selectors):
        yield False, index, expression


def _capacity_short(device: w.PoolDevice, requests: dict, shares: Shares) -> str | None:
    if shares.amount(device.key, requests) is not None:
        return None
    used = shares.used.get(device.key, {})
    parts = []
    for name, entry in device.capacity.items():
        total = quantities.value(entry["value"])
        left = total - used.get(name, Decimal(0))
        wanted = requests.get(name) or (entry.get("requestPolicy") or {}).get("default") or entry["value"]
        parts.append(f"{name} {wanted} wanted, {_canonical(max(left, Decimal(0)))} of {entry['value']} left")
    return "not enough capacity left: " + "; ".join(parts)


def _counters_short(device: w.PoolDevice, ledger: _Ledger) -> str:
    counters = ledger.counters
    for counter_set, wanted in counters.consumes.get(device.key, {}).items():
        for counter, value in wanted.items():
            total = counters.totals.get(counter_set, {}).get(counter)
            if total is None:
                return f"consumes counter {counter} of set {counter_set.rsplit('/', 1)[-1]}, which no slice defines"
            used = counters.used.get(counter_set, {}).get(counter, Decimal(0))
            if used + value > total:
                users = sorted({h.claim for key, hs in ledger.holders.items() for h in hs
                                if counter in counters.consumes.get(key, {}).get(counter_set, {})})
                by = f" (used by {', '.join(users)})" if users else ""
                return (f"shared counter {counter_set.rsplit('/', 1)[-1]}/{counter} exhausted: needs "
                        f"{_canonical(value)}, {_canonical(total - used)} of {_canonical(total)} left{by}")
    return "shared counters exhausted"


def explain_node(claim: str, spec: dict, node: str, world: w.World, namespace: str,
                 skip_uid: str | None = None) -> NodeReport:
    world = world.view(node)  # the pools as the scheduler gathers them for this node
    devices = world.on_node(node)
    ledger = _ledger(world, devices, skip_uid)
    report = _judge_node(claim, spec, node, world, devices, ledger, namespace)
    report.fits_when_free = report.fits
    if report.fits or not (ledger.holders or any(ledger.counters.used.values())):
        return report
    # Judged again as if no claim were allocated: where it still does not fit, no removal
    # can help, and the reasons of that judgement name no claim that holds a device.
    vacant = _judge_node(claim, spec, node, world, devices, _ledger(world, devices, skip_uid, vacant=True),
                         namespace)
    report.fits_when_free = vacant.fits
    if not vacant.fits and vacant.why != report.why:
        report.why = vacant.why + ("" if EVEN_WHEN_FREE in vacant.why else ", even with nothing allocated")
        report.constraints = vacant.constraints
    return report


EVEN_WHEN_FREE = "no device of the node can hold it even when free"


@dataclass(frozen=True)
class PodClaim:
    """One of a pod's claims, in the order of the pod's spec.resourceClaims."""

    ref: str  # namespace/name
    spec: dict
    namespace: str
    uid: str | None = None  # a claim allocated already: its own allocation does not count


def explain_pod_node(claims: list[PodClaim], node: str, world: w.World) -> list[NodeReport]:
    """A pod's claims on one node, allocated together as the scheduler does: claim by
    claim in order, each beside the devices the earlier ones took, and where a claim finds
    no devices, back into the claims before it for their next choice. One report per claim:
    all fit, with what each would get; or the claims up to the first that cannot be placed
    beside the earlier ones whatever they choose, which says why; the claims after it are
    not judged."""
    for claim in claims:
        requests(claim.ref, claim.spec)
    world = world.view(node)
    devices = world.on_node(node)
    ledger = _ledger(world, devices, frozenset(c.uid for c in claims if c.uid))
    together = _together(claims, node, world, devices, ledger)
    if together is not None:
        for report in together:
            report.fits_when_free = True
        return together
    # The first claim that no choice of the claims before it leaves room for: the claims up
    # to it do not fit together, those before it do.
    index = next(i for i in range(len(claims)) if _together(claims[:i + 1], node, world, devices, ledger) is None)
    before = _together(claims[:index], node, world, devices, ledger) or []
    claim = claims[index]
    report = explain_node(claim.ref, claim.spec, node, world, claim.namespace, claim.uid)
    if report.fits:
        taken = ledger
        for earlier, earlier_report in zip(claims, before):
            taken = _with(taken, earlier.ref, earlier_report.allocation)
        beside = _judge_node(claim.ref, claim.spec, node, world, devices, taken, claim.namespace)
        names = ", ".join(c.ref for c in claims[:index])
        beside.why = (f"it fits alone, but not beside the pod's claims before it ({names}), whatever devices "
                      f"they take; with their first choice: {beside.why}")
        beside.fits, beside.fits_when_free, report = False, True, beside
    for earlier in before:
        earlier.fits, earlier.fits_when_free = False, True  # (each judged alone, as fits_when_free is)
        earlier.why = (f"the pod's claim {claim.ref} does not fit " + ("beside it " if report.fits_when_free else "")
                       + "on this node")
    return before + [report]


def _together(claims: list[PodClaim], node: str, world: w.World, devices: list[w.PoolDevice],
              ledger: _Ledger) -> list[NodeReport] | None:
    """The reports of these claims allocated together (the scheduler's depth-first search
    across claims), or None where they cannot all be placed."""
    if not claims:
        return []
    first, rest = claims[0], claims[1:]
    after: list[NodeReport] | None = None

    def accept(found) -> bool:
        nonlocal after
        results = [_result(alt, d, ledger) for alt, chosen in found for d in chosen]
        after = _together(rest, node, world, devices, _with(ledger, first.ref, results))
        return after is not None

    report = _judge_node(first.ref, first.spec, node, world, devices, ledger, first.namespace,
                         accept=accept if rest else None)
    if not report.fits:
        return None
    return [report] + (after or [])


def _with(ledger: _Ledger, claim: str, results: list[dict]) -> _Ledger:
    """The ledger with a claim's results counted as allocated: a device held whole, a share
    of a shareable one, the counters of a device it is the first to hold."""
    holders = {key: list(held) for key, held in ledger.holders.items()}
    shares = Shares(capacity=ledger.shares.capacity, used={k: dict(v) for k, v in ledger.shares.used.items()})
    counters = Counters(totals=ledger.counters.totals, used={k: dict(v) for k, v in ledger.counters.used.items()},
                        consumes=ledger.counters.consumes)
    for result in results:
        key = f"{result['driver']}/{result['pool']}/{result['device']}"
        # A device taken with admin access by a claim of the same pod is in use for the pod's
        # other claims (a share of a shareable one takes its capacity), unlike one an allocated
        # claim holds with admin access: k8s.io/dynamic-resource-allocation v0.37 marks every
        # device it is allocating, admin or not.
        consumed = result.get("consumedCapacity")
        if key not in holders:
            counters.take(key)
        holders.setdefault(key, []).append(w.Holder(claim, "", consumed))
        if consumed is not None:
            shares.take(key, {k: quantities.value(str(v)) for k, v in consumed.items()})
    return _Ledger(holders, shares, counters)


def _judge_node(claim: str, spec: dict, node: str, world: w.World, devices: list[w.PoolDevice],
                ledger: _Ledger, namespace: str, accept=None) -> NodeReport:
    """`accept(found)`: whether the search takes this allocation (the pod's later claims fit
    beside it); the search goes on to the next one where it does not, as the scheduler's does."""
    plan = requests(claim, spec)
    report = NodeReport(node, False, "")
    by_key = {d.key: d for d in devices}
    # Per request, per alternative: (alternative, the devices that fit it, its report).
    options: list[list[tuple[Alternative, list[w.PoolDevice], AlternativeReport]]] = []
    for _, alternatives in plan:
        per_request = []
        for alt in alternatives:
            verdicts = [judge(alt, d, world, ledger, namespace) for d in devices]
            device_class = world.classes.get(alt.device_class)
            selectors = [{"from": f"class {alt.device_class}", "index": i, "expression": e}
                         for i, e in enumerate(device_class.selectors if device_class else ())]
            selectors += [{"from": "request", "index": i, "expression": e} for i, e in enumerate(alt.selectors)]
            alt_report = AlternativeReport(alt.request, alt.device_class, selectors, alt.count, verdicts)
            report.alternatives.append(alt_report)
            fitting = [by_key[f"{v.driver}/{v.pool}/{v.device}"] for v in verdicts if v.code == FITS]
            if alt.count is None:  # All: every device the selectors accept, and at least one
                # (leaving out those that could never hold its capacity request)
                selected = [v for v in verdicts if v.code not in (CLASS, SELECTOR) and not (
                    v.code != FITS and alt.capacity and _never_holds(by_key[f"{v.driver}/{v.pool}/{v.device}"], alt))]
                fitting = _AllDevices(fitting if selected and len(fitting) == len(selected) else [])
                fitting.walk = [(by_key[f"{v.driver}/{v.pool}/{v.device}"], v.code) for v in selected]
            per_request.append((alt, fitting, alt_report))
        options.append(per_request)
    for index, constraint in enumerate((spec.get("devices") or {}).get("constraints") or []):
        if not isinstance(constraint, dict) or not (constraint.get("matchAttribute") or
                                                    constraint.get("distinctAttribute")):
            report.why = (f"constraint #{index}: empty constraint (unsupported constraint type?); "
                          "the scheduler fails the allocation")
            return report
    # What the scheduler checks request by request before it searches, each failing the
    # allocation with an error: the class exists, no pool that a request for all devices
    # would take from is incomplete or invalid, and the claim stays within its 32 results
    # (a request with alternatives counts its smallest).
    accounted = 0
    for (name, _), per_request in zip(plan, options):
        smallest = None
        for alt, fitting, _ in per_request:
            if alt.device_class not in world.classes:
                report.why = (f"request {alt.request}: DeviceClass {alt.device_class} does not exist; "
                              "the scheduler fails the allocation")
                return report
            if alt.count is None:
                for (driver, pool), (why, nodes) in sorted(world.unusable_pools.items()):
                    if nodes is None or node in nodes:
                        state = "currently being updated" if why == "incomplete" else "currently invalid"
                        report.why = (f"request {alt.request}: asks for all devices, but resource pool "
                                      f"{driver}/{pool} is {state}")
                        return report
            n = len(fitting.walk) if isinstance(fitting, _AllDevices) else alt.count
            smallest = n if smallest is None else min(smallest, n)
        if smallest is not None and smallest > MAX_RESULTS - accounted:
            report.why = (f"request {name}: adding {smallest} devices exceeds the claim limit of "
                          f"{MAX_RESULTS}, with {accounted} already accounted for; the scheduler "
                          "fails the allocation")
            return report
        accounted += smallest or 0
    errors = [(a, v) for a in report.alternatives for v in a.devices if v.code in (CEL_ERROR, CAPACITY_ERROR)]
    if errors:
        alt, v = errors[0]
        report.why = (f"request {alt.request}: {v.reason} on device {v.device}; a CEL error "
                      "aborts the allocation" if v.code == CEL_ERROR else
                      f"request {alt.request}: checking capacity for device {v.device}: {v.reason}; "
                      "the scheduler fails the allocation")
        return report
    constraints = (spec.get("devices") or {}).get("constraints") or []
    try:
        found = _search(options, constraints, ledger, accept=accept)
    except _AllConstraintError as err:
        report.why = (f"request {err.args[0]}: asks for all devices, but a claim constraint would not be "
                      "satisfied by them; the scheduler fails the allocation")
        return report
    if found is not None:
        report.fits = True
        report.why = FITS
        report.allocation = [_result(alt, d, ledger) for alt, chosen in found for d in chosen]
        return report
    report.why, report.constraints = _why_not(plan, options, constraints, ledger, by_key)
    invalid = sorted(f"{driver}/{pool}" for (driver, pool), (why, nodes) in world.unusable_pools.items()
                     if why.startswith("invalid") and (nodes is None or node in nodes))
    if invalid:
        # Not found, with an invalid pool in reach: the scheduler's answer is an error
        # (the pool might have held the devices).
        report.why += (f"; resource pool {invalid[0]} is invalid: the scheduler fails with "
                       "\"invalid resource pools were encountered\"")
    return report


def _never_holds(device: w.PoolDevice, alt: Alternative) -> bool:
    """A capacity request that the device cannot hold even with nothing allocated."""
    return bool(set(alt.capacity) - set(device.capacity)) or _dedicated_amount(device, alt.capacity) is None


def _result(alt: Alternative, device: w.PoolDevice, ledger: _Ledger) -> dict:
    result = {"request": alt.request, "driver": device.driver, "pool": device.pool, "device": device.name}
    if alt.admin:
        result["adminAccess"] = True  # as in the AllocationResult (once allocated, it blocks no other claim)
    if device.multiple:  # with admin access too: the scheduler gives such a result its share
        amount = ledger.shares.amount(device.key, alt.capacity) or {}
        result["consumedCapacity"] = {k: _canonical(v) for k, v in amount.items()}
    return result


def _count(alt: Alternative, fitting: list) -> int:
    return len(fitting) if alt.count is None else alt.count


class _AllDevices(list):
    """The devices that fit a request for all devices, and `walk`: every device it must
    take, in the scheduler's order, with its verdict code."""

    walk: list = []


def _take_all(alt, fitting: _AllDevices, chosen: list, used: set[str], ledger: _Ledger, satisfied):
    """The scheduler takes the devices of an All request one by one, in order: one that is
    not available fails the request (the next alternative is tried), one that breaks a
    constraint fails the allocation with an error. It checks a device's capacity only
    after the constraints."""
    taken: list = []
    for device, code in fitting.walk:
        if code not in (FITS, CAPACITY) or (device.key in used and not device.multiple):
            return None
        keys = list(dict.fromkeys([device.key] + [d.key for d in taken] + [d.key for _, ds in chosen for d in ds]))
        keys = [k for k in keys if not (k in ledger.holders and ledger.shares.capacity.get(k) is not None)]
        if keys and not ledger.counters.fits(keys[0], tuple(keys[1:])):
            return None
        if device.key in used and not _shares_fit(device, chosen + [(alt, (device,))], ledger):
            return None
        if not satisfied(chosen + [(alt, tuple(taken + [device]))]):
            raise _AllConstraintError(alt.request)
        if code == CAPACITY:
            return None
        taken.append(device)
    return tuple(taken)


class _AllConstraintError(Exception):
    """A request for all devices whose devices break a constraint: the scheduler's error."""


def _search(options, constraints: list[dict], ledger: _Ledger, limit: int = 2000, accept=None):
    def satisfied(chosen) -> bool:
        return all(_constraint_holds(c, chosen) for c in constraints)

    # The fewest devices the requests from each index on need (their smallest alternatives):
    # an alternative that leaves less room than that is skipped, as the scheduler does,
    # instead of searching its combinations.
    least_after = [0] * (len(options) + 1)
    for index in range(len(options) - 1, -1, -1):
        least_after[index] = least_after[index + 1] + min(
            (_count(alt, fitting) for alt, fitting, _ in options[index]), default=0)

    def search(index: int, chosen: list, used: set[str]):
        if sum(len(ds) for _, ds in chosen) > MAX_RESULTS:
            return None  # a claim holds at most 32 results
        if index == len(options):
            return chosen if satisfied(chosen) and (accept is None or accept(chosen)) else None
        for alt, fitting, _ in options[index]:  # first alternative first
            if isinstance(fitting, _AllDevices):
                combo = _take_all(alt, fitting, chosen, used, ledger, satisfied)
                if combo:
                    found = search(index + 1, chosen + [(alt, combo)], used | {d.key for d in combo})
                    if found is not None:
                        return found
                continue
            need = _count(alt, fitting)
            if need == 0:
                continue
            if sum(len(ds) for _, ds in chosen) + need + least_after[index + 1] > MAX_RESULTS:
                continue  # the requests after it could not fit in the claim's 32 results
            # A device that allows multiple allocations can serve several requests of the
            # claim, while its capacity holds all of their shares.
            free = [d for d in fitting if d.key not in used or d.multiple]
            if need > len(free):
                continue
            for combo in itertools.islice(itertools.combinations(free, need), limit):
                # Counters of the devices taken, each once; a shared device in use has its own.
                keys = list(dict.fromkeys([d.key for d in combo] + [d.key for _, ds in chosen for d in ds]))
                keys = [k for k in keys if not (k in ledger.holders and ledger.shares.capacity.get(k) is not None)]
                if keys and not ledger.counters.fits(keys[0], tuple(keys[1:])):
                    continue
                if any(d.key in used and not _shares_fit(d, chosen + [(alt, combo)], ledger) for d in combo):
                    continue
                if not satisfied(chosen + [(alt, combo)]):
                    continue  # constraints only get harder with more devices: as the scheduler, give up here
                found = search(index + 1, chosen + [(alt, combo)], used | {d.key for d in combo})
                if found is not None:
                    return found
        return None

    return search(0, [], set())


MAX_RESULTS = 32  # resourceapi.AllocationResultsMaxSize


def _quiet_search(options, constraints: list[dict], ledger: _Ledger):
    try:
        return _search(options, constraints, ledger)
    except _AllConstraintError:
        return None


def _shares_fit(device: w.PoolDevice, chosen, ledger: _Ledger) -> bool:
    """Whether the shares of every request of the claim on this device fit together."""
    shares = Shares(capacity=ledger.shares.capacity, used={k: dict(v) for k, v in ledger.shares.used.items()})
    for alt, devices in chosen:
        if all(d.key != device.key for d in devices):
            continue
        amount = shares.amount(device.key, alt.capacity)
        if amount is None:
            return False
        shares.take(device.key, amount)
    return True


def _as_set(value) -> set | None:
    """An attribute as the scheduler compares it with list-typed attributes (KEP-5491): a
    set of its values (a scalar is a set of one), typed so that 1 and "1" differ."""
    if value is None:
        return None
    items = value if isinstance(value, tuple) else (value,)
    if not items:
        return None
    return {(type(v).__name__ if not isinstance(v, w.VersionText) else "version", str(v)) for v in items}


def _constraint_holds(constraint: dict, chosen) -> bool:
    names = constraint.get("requests") or None
    values = [d.attribute(_constraint_attribute(constraint)) for alt, ds in chosen
              if names is None or alt.request.split("/")[0] in names or alt.request in names for d in ds]
    if not values:
        return True
    sets = [_as_set(v) for v in values]
    if any(s is None for s in sets):
        return False
    if "matchAttribute" in constraint:
        return bool(set.intersection(*sets))  # a value common to all
    if "distinctAttribute" in constraint:
        return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])  # pairwise disjoint
    return False  # an empty constraint: the scheduler fails the allocation


def _constraint_attribute(constraint: dict) -> str:
    return constraint.get("matchAttribute") or constraint.get("distinctAttribute") or ""


def _why_not(plan, options, constraints, ledger, by_key: dict[str, w.PoolDevice]) -> tuple[str, list[str]]:
    short = []
    for (name, _), per_request in zip(plan, options):
        if all(len(fitting) < max(_count(alt, fitting), 1) for alt, fitting, _ in per_request):
            short.append(f"request {name}: " + "; ".join(
                _hopeless(alt, alt_report, by_key) or _shortfall(alt, fitting, alt_report)
                for alt, fitting, alt_report in per_request))
    if short:
        return "; ".join(short), []
    explained = []
    for constraint in constraints:
        if _quiet_search(options, [constraint], ledger) is None:
            explained.append(_explain_constraint(constraint, options))
    if explained:
        return "constraint not met: " + explained[0], explained
    if _quiet_search(options, constraints, _without_counters(ledger)) is not None:
        return "the fitting devices share counters: no combination leaves room for all of them", []
    return "no combination of the fitting devices satisfies all constraints together", []


# The verdicts of devices that pass the class, the selectors, admin access and taints:
# what could serve the request but for other claims' allocations and its capacity.
_CANDIDATES = (ALLOCATED, CAPACITY, COUNTERS, FITS)


def _hopeless(alt: Alternative, report: AlternativeReport, by_key: dict[str, w.PoolDevice]) -> str | None:
    """"no device of the node can hold it even when free: memory 90Gi wanted, the largest
    has 81559Mi (gpu-0)" where every candidate device is too small for the capacity request
    with nothing allocated on it; None where some device could hold it. No claim is named:
    removing none of them would help."""
    candidates = [by_key[f"{v.driver}/{v.pool}/{v.device}"] for v in report.devices if v.code in _CANDIDATES]
    if not candidates or not all((alt.capacity or d.multiple) and _never_holds(d, alt) for d in candidates):
        return None
    label = "" if "/" not in alt.request else f"{alt.request}: "
    parts = []
    for name in sorted({name for d in candidates for name, _, _ in _over(d, alt.capacity)} | set(alt.capacity)):
        having = [d for d in candidates if name in d.capacity]
        if not having:
            parts.append(f"asks for capacity {name}, which no such device has")
            continue
        largest = max(having, key=lambda d: quantities.value(d.capacity[name]["value"]))
        over = dict((n, wanted) for n, wanted, _ in _over(largest, alt.capacity))
        if name in over:
            parts.append(f"{name} {over[name]} wanted, the largest has {largest.capacity[name]['value']} "
                         f"({largest.name})")
    if not parts:  # each capacity fits some device, but no device holds all of them
        parts.append(f"e.g. {candidates[0].name}: {_too_large(candidates[0], alt.capacity)}")
    return f"{label}{EVEN_WHEN_FREE}: " + "; ".join(parts)


def _shortfall(alt: Alternative, fitting: list, report: AlternativeReport) -> str:
    """"gpu: 0 of 8 fit, needs 1 (8 selector #0 is false)": the reasons of the devices of
    the class, most common first."""
    need = "all that match" if alt.count is None else str(alt.count)
    relevant = [d for d in report.devices if d.code != CLASS]
    reasons: dict[str, int] = {}
    for d in relevant:
        if d.code != FITS:
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
    why = ", ".join(f"{n} x {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])[:3])
    if not relevant:
        why = f"no device is in class {alt.device_class}"
    label = "" if "/" not in alt.request else f"{alt.request}: "
    return f"{label}{len(fitting)} of {len(relevant)} fit, needs {need}" + (f" ({why})" if why else "")


def _without_counters(ledger: _Ledger) -> _Ledger:
    return _Ledger(ledger.holders, ledger.shares, Counters())


def _explain_constraint(constraint: dict, options) -> str:
    attribute = _constraint_attribute(constraint)
    names = constraint.get("requests") or None
    values: dict[str, set[str]] = {}
    for per_request in options:
        for alt, fitting, _ in per_request:
            if names is None or alt.request.split("/")[0] in names or alt.request in names:
                values.setdefault(alt.request, set()).update(w.display(d.attribute(attribute)) for d in fitting)
    listing = "; ".join(f"{r} has {', '.join(sorted(v)) or 'no device'}" for r, v in values.items())
    if "matchAttribute" in constraint:
        return f"matchAttribute {attribute}: {listing}: no value common to all"
    return f"distinctAttribute {attribute}: {listing}: not enough distinct values"


def explain_pod(claims: list[PodClaim], world: w.World, nodes: list[str] | None = None,
                sources: list[str] | None = None, filtered: dict[str, str] | None = None) -> list[Explanation]:
    """A pod's claims, allocated together on each node (explain_pod_node): one explanation
    per claim, in the pod's order. On a node where the pod does not fit, the claims after
    the one that cannot be placed are not judged, and say so. `filtered`: node -> why the
    pod's node filters leave it out (no claim is judged there: no removal would help)."""
    for claim in claims:
        requests(claim.ref, claim.spec)
    considered = nodes if nodes is not None else world.nodes()
    per_claim: list[list[NodeReport]] = [[] for _ in claims]
    for node in considered:
        if node in (filtered or {}):
            for index in range(len(claims)):
                per_claim[index].append(NodeReport(node, False, filtered[node], fits_when_free=False))
            continue
        reports = explain_pod_node(claims, node, world)
        for index, claim in enumerate(claims):
            per_claim[index].append(reports[index] if index < len(reports) else NodeReport(
                node, False, f"not judged: the pod's claim {claims[len(reports) - 1].ref} does not fit on this node"))
    return [Explanation(claim.ref, (sources or [""] * len(claims))[index], per_claim[index],
                        suggest.suggestions(claim.spec, per_claim[index], world), list(world.notes))
            for index, claim in enumerate(claims)]


def explain(claim: str, spec: dict, world: w.World, namespace: str, nodes: list[str] | None = None,
            skip_uid: str | None = None, source: str = "") -> Explanation:
    requests(claim, spec)  # a malformed claim is a usage error before any node is looked at
    considered = nodes if nodes is not None else world.nodes()
    reports = [explain_node(claim, spec, node, world, namespace, skip_uid) for node in considered]
    return Explanation(claim, source, reports, suggest.suggestions(spec, reports, world),
                       list(world.notes))
