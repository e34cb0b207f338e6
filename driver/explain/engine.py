"""Each request of a claim against each device of each node: the first reason it is out,
in the scheduler's order (DeviceClass selectors, the request's selectors, taints, other
claims' allocations, consumable capacity, shared counters), then the combinations: counts,
`matchAttribute` / `distinctAttribute` constraints and counters across the chosen devices.

It follows the allocator the demo uses (driver/scheduling/allocator.py) and reuses its capacity
rounding and counter bookkeeping, so that the two agree; tests hold them to it. One
difference is deliberate: the scheduler stops at the first CEL runtime error it meets,
which depends on the order it visits devices; here every device is evaluated and any
error is reported as aborting the node, with the device and expression.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from decimal import Decimal

from driver.kube import quantity as quantities
from driver.explain import suggest
from driver.explain import world as w
from driver.explain.verdicts import (ADMIN, ALLOCATED, CAPACITY, CAPACITY_ERROR, CEL_ERROR, CLASS, COUNTERS, FITS,
                                     SELECTOR, TAINT, Alternative, AlternativeReport, ClaimError,
                                     DeviceVerdict, Explanation, NodeReport)
from driver.scheduling import cel, taints
from driver.scheduling.allocator import Counters, Shares, _canonical, capacity_error

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


def _ledger(world: w.World, devices: list[w.PoolDevice], skip_uid: str | None) -> _Ledger:
    holders = world.holders(skip_uid)
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
    if alt.admin and world.namespaces is not None:
        labels = world.namespaces.get(namespace)
        if labels is None or labels.get(w.ADMIN_ACCESS_LABEL) != "true":
            return verdict(ADMIN, f"adminAccess needs namespace {namespace} labelled "
                                  f"{w.ADMIN_ACCESS_LABEL}=\"true\"")
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
    if alt.capacity and not device.multiple:
        # A dedicated device serves a capacity request that it could hold (KEP-5075).
        missing = sorted(set(alt.capacity) - set(device.capacity))
        if missing:
            return verdict(CAPACITY, f"asks for capacity {missing[0]}, which the device does not have")
        if _dedicated_amount(device, alt.capacity) is None:
            return verdict(CAPACITY, "asks for more capacity than the device has: " + ", ".join(
                f"{k} {v} wanted, {device.capacity[k]['value']} there" for k, v in alt.capacity.items()))
    if device.multiple:
        short = _capacity_short(device, alt.capacity, ledger.shares)
        if short:
            by = ", ".join(sorted({h.claim for h in holders}))
            return verdict(CAPACITY, short + (f" (held by {by})" if by else ""))
    if not (device.multiple and holders) and not ledger.counters.fits(device.key):
        # (a shared device already in use has taken its counters)
        return verdict(COUNTERS, _counters_short(device, ledger))
    return verdict(FITS, FITS)


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
        found = _search(options, constraints, ledger)
    except _AllConstraintError as err:
        report.why = (f"request {err.args[0]}: asks for all devices, but a claim constraint would not be "
                      "satisfied by them; the scheduler fails the allocation")
        return report
    if found is not None:
        report.fits = True
        report.why = FITS
        report.allocation = [_result(alt, d, ledger) for alt, chosen in found for d in chosen]
        return report
    report.why, report.constraints = _why_not(plan, options, constraints, ledger)
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
    if device.multiple and not alt.admin:
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


def _search(options, constraints: list[dict], ledger: _Ledger, limit: int = 2000):
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
            return chosen if satisfied(chosen) else None
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


def _why_not(plan, options, constraints, ledger) -> tuple[str, list[str]]:
    short = []
    for (name, _), per_request in zip(plan, options):
        if all(len(fitting) < max(_count(alt, fitting), 1) for alt, fitting, _ in per_request):
            short.append(f"request {name}: " + "; ".join(_shortfall(alt, fitting, alt_report)
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


def explain(claim: str, spec: dict, world: w.World, namespace: str, nodes: list[str] | None = None,
            skip_uid: str | None = None, source: str = "") -> Explanation:
    requests(claim, spec)  # a malformed claim is a usage error before any node is looked at
    considered = nodes if nodes is not None else world.nodes()
    reports = [explain_node(claim, spec, node, world, namespace, skip_uid) for node in considered]
    return Explanation(claim, source, reports, suggest.suggestions(spec, reports, world),
                       list(world.notes))
