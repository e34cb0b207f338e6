"""A small allocator for the demo and the tests: picks devices for a claim the way the
scheduler would for the features our examples use (DeviceClass and request CEL
selectors, ExactCount, firstAvailable, matchAttribute constraints, device taints and
request tolerations, opaque configs, and consumable capacity: devices that allow multiple
allocations, capacity requests rounded by the request policy, shareID and consumedCapacity
in the result; partitionable devices: a device fits only while the shared counters it
consumes have room). A CEL runtime error fails the allocation, as in the scheduler.
It is not the scheduler: no scoring, no cross-claim bookkeeping beyond `taken` (devices
allocated whole) and `Shares` (capacity consumed on multi-allocatable devices)."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal

from driver.kube import quantity
from driver.devices.model import Device, Inventory
from driver.scheduling import taints
from driver.scheduling.cel import CelError, matches


class Unsatisfiable(Exception):
    pass


@dataclass(frozen=True)
class Choice:
    request: str  # "gpu" or "gpu/h100" for a firstAvailable subrequest
    devices: tuple[Device, ...]
    consumed: tuple[dict[str, str] | None, ...] = ()  # per device: consumedCapacity of a share


@dataclass
class Shares:
    """Multi-allocatable devices (name -> capacity entries with their request policies, as
    published) and what the claims allocated so far consume of them."""

    capacity: dict[str, dict[str, dict]] = field(default_factory=dict)
    used: dict[str, dict[str, Decimal]] = field(default_factory=dict)

    def amount(self, device: str, requests: dict) -> dict[str, Decimal] | None:
        """What a request with these capacity requests consumes, or None if it does not fit."""
        wanted: dict[str, Decimal] = {}
        if set(requests) - set(self.capacity[device]):
            return None  # asks for a capacity the device does not have
        for name, entry in self.capacity[device].items():
            total = quantity.value(entry["value"])
            policy = entry.get("requestPolicy") or {}
            if name in requests:
                amount = quantity.value(str(requests[name]))
            elif policy.get("default") is not None:
                amount = quantity.value(policy["default"])
            else:
                amount = total
            amount = _round(amount, policy)
            if amount is None or self.used.get(device, {}).get(name, Decimal(0)) + amount > total:
                return None
            wanted[name] = amount
        return wanted

    def take(self, device: str, amount: dict[str, Decimal]) -> None:
        used = self.used.setdefault(device, {})
        for name, value in amount.items():
            used[name] = used.get(name, Decimal(0)) + value


@dataclass
class Counters:
    """Shared counters of the pool (set -> counter -> total) and what allocated devices
    consume of them (KEP-4815)."""

    totals: dict[str, dict[str, Decimal]] = field(default_factory=dict)
    used: dict[str, dict[str, Decimal]] = field(default_factory=dict)
    consumes: dict[str, dict[str, dict[str, Decimal]]] = field(default_factory=dict)  # device ->

    def fits(self, device: str, others: tuple[str, ...] = ()) -> bool:
        extra: dict[tuple[str, str], Decimal] = {}
        for name in (device, *others):
            for counter_set, counters in self.consumes.get(name, {}).items():
                for counter, value in counters.items():
                    extra[(counter_set, counter)] = extra.get((counter_set, counter), Decimal(0)) + value
        for (counter_set, counter), value in extra.items():
            total = self.totals.get(counter_set, {}).get(counter)
            if total is None or self.used.get(counter_set, {}).get(counter, Decimal(0)) + value > total:
                return False
        return True

    def take(self, device: str) -> None:
        for counter_set, counters in self.consumes.get(device, {}).items():
            used = self.used.setdefault(counter_set, {})
            for counter, value in counters.items():
                used[counter] = used.get(counter, Decimal(0)) + value


MAX_INT64 = 2**63 - 1


def capacity_error(capacity: dict[str, dict], requests: dict) -> str | None:
    """The scheduler's fatal error for a capacity request on a device, or None: it aborts
    the allocation (not skips the device) when a request, or the step it rounds up to, is
    beyond int64 in the device's range arithmetic, or when what would be consumed is
    negative. A request for a capacity the device lacks only skips it. (k8s.io/
    dynamic-resource-allocation v0.37, integer range arithmetic: DRAFractionalCapacityRange
    off.)"""
    if set(requests) - set(capacity):
        return None
    for name in sorted(capacity):
        entry = capacity[name]
        policy = entry.get("requestPolicy") or {}
        bounds = policy.get("validRange") or {}
        if name not in requests:
            consumed = quantity.value(policy["default"] if policy.get("default") is not None else entry["value"])
        else:
            text = str(requests[name])
            consumed = quantity.value(text)
            if bounds.get("min") is not None and bounds.get("step") and consumed >= quantity.value(bounds["min"]):
                problem = _range_overflow(consumed, bounds, quantity.canonical(text))
                if problem:
                    return f'capacity "{name}": capacity request cannot be represented in the device\'s range arithmetic: {problem}'
        if consumed < 0:
            return f'capacity "{name}": capacity value is negative'
    return None


def _range_overflow(requested: Decimal, bounds: dict, text: str) -> str | None:
    if requested > MAX_INT64:
        return f"request {text} exceeds MaxInt64"
    # Quantity.Value() rounds up to an integer
    as_int = int(requested.to_integral_value(rounding=ROUND_CEILING))
    low = int(quantity.value(bounds["min"]).to_integral_value(rounding=ROUND_CEILING))
    step = int(quantity.value(bounds["step"]).to_integral_value(rounding=ROUND_CEILING))
    if step <= 0:
        return None
    steps = -(-(as_int - low) // step)
    if low >= 0 and steps > (MAX_INT64 - low) // step:
        return f"rounding request {text} up to the next step passes MaxInt64"
    return None


def _round(amount: Decimal, policy: dict) -> Decimal | None:
    """KEP-5075: raised to min, rounded up to min + n*step or the next valid value."""
    if policy.get("validValues"):
        values = sorted(quantity.value(v) for v in policy["validValues"])
        return next((v for v in values if v >= amount), None)
    bounds = policy.get("validRange")
    if not bounds:
        return amount
    low = quantity.value(bounds["min"])
    amount = max(amount, low)
    if bounds.get("step"):
        step = quantity.value(bounds["step"])
        # Decimal's // truncates toward zero: round the quotient up explicitly.
        steps = ((amount - low) / step).to_integral_value(rounding=ROUND_CEILING)
        amount = low + steps * step
    if bounds.get("max") and amount > quantity.value(bounds["max"]):
        return None
    return amount


def _canonical(value: Decimal) -> str:
    """As the scheduler writes it: binary sizes in binary units (20Gi), counts plain (30)."""
    if value == value.to_integral_value() and value >= 1024 and int(value) % 1024 == 0:
        return quantity.canonical(f"{int(value) >> 10}Ki")
    return quantity.canonical(format(value.normalize(), "f"))


MAX_RESULTS = 32  # resourceapi.AllocationResultsMaxSize


def _as_set(value) -> set | None:
    """An attribute as the scheduler compares it for constraints (KEP-5491): the set of its
    values, a scalar a set of one."""
    if value is None:
        return None
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return {(type(v).__name__, str(v)) for v in items} or None


def _shares_fit(shares: Shares, chosen: list[Choice], used: set[str], devices: tuple[Device, ...]) -> bool:
    """Whether the shares of every request of the claim on a shared device fit together."""
    for device in devices:
        if device.name not in used:
            continue
        trial = Shares(capacity=shares.capacity, used={k: dict(v) for k, v in shares.used.items()})
        for choice in chosen:
            for d, amount in zip(choice.devices, choice.consumed or (None,) * len(choice.devices)):
                if d.name == device.name and amount is not None:
                    wanted = {k: quantity.value(v) for k, v in amount.items()}
                    total = trial.capacity[d.name]
                    if any(trial.used.get(d.name, {}).get(k, Decimal(0)) + v > quantity.value(total[k]["value"])
                           for k, v in wanted.items()):
                        return False
                    trial.take(d.name, wanted)
    return True


def _as_published(device: Device) -> dict[str, dict]:
    """A dedicated device's capacity as its slice entry has it (no request policy)."""
    return {k: {"value": str(v)} for k, v in device.capacity.items()}


def _dedicated_holds(device: Device, requests: dict) -> bool:
    shares = Shares(capacity={device.name: _as_published(device)})
    return shares.amount(device.name, requests) is not None


def _candidates(inventory: Inventory, classes: dict[str, list[str]], exactly: dict, driver: str,
                taken: set[str], device_taints: dict[str, list[dict]],
                multiple: frozenset[str] = frozenset(), order: tuple[str, ...] | None = None) -> list[Device]:
    class_name = exactly.get("deviceClassName")
    if class_name not in classes:
        raise Unsatisfiable(f"unknown DeviceClass {class_name!r}")
    selectors = [(f"class {class_name}", i, e) for i, e in enumerate(classes[class_name])]
    selectors += [("claim", i, s["cel"]["expression"]) for i, s in enumerate(exactly.get("selectors", []))]
    chosen = []
    devices = inventory.devices if order is None else [inventory.get(n) for n in order if inventory.get(n) is not None]
    for device in devices:
        if device.name in taken:
            continue
        for owner, index, expression in selectors:
            try:
                if not matches(expression, device, driver, device.name in multiple):
                    break
            except CelError as err:
                # As the scheduler: a CEL error aborts the allocation, it does not skip a device.
                raise Unsatisfiable(f"{owner}: selector #{index}: CEL runtime error: {err.message} "
                                    f"(device {device.name})") from None
        else:
            if taints.blocking(device_taints.get(device.name, ()), exactly.get("tolerations") or ()) is None:
                chosen.append(device)
    return chosen


def allocate(claim_spec: dict, inventory: Inventory, classes: dict[str, list[str]], driver: str,
             taken: set[str] | None = None, shares: Shares | None = None,
             counters: Counters | None = None,
             device_taints: dict[str, list[dict]] | None = None,
             order: list[str] | None = None) -> list[Choice]:
    """Devices for the claim. With `shares`, multi-allocatable devices are taken by capacity
    (and `shares` records what the result consumes); with `counters`, partitionable devices
    by the room left in their counter sets (recorded likewise); `device_taints` (device ->
    its taints) keeps devices from requests that do not tolerate them. `order`: the device
    names in the order the scheduler visits them (pools and slices by name, a slice's
    devices as listed); the inventory's own order is by name."""
    taken = set(taken or ())
    shares = shares or Shares()
    counters = counters or Counters()
    devices_spec = claim_spec.get("devices", {})
    options_per_request: list[list[tuple[str, list[Device], int]]] = []
    for request in devices_spec.get("requests", []):
        alternatives = []
        if "firstAvailable" in request:
            for sub in request["firstAvailable"]:
                alternatives.append((f"{request['name']}/{sub['name']}", sub, sub.get("count", 1)))
        else:
            exactly = request["exactly"]
            alternatives.append((request["name"], exactly, exactly.get("count", 1)))
        options = []
        for name, spec, count in alternatives:
            mode = spec.get("allocationMode", "ExactCount")
            if mode != "ExactCount":  # (All is not part of the demo's claims)
                raise Unsatisfiable(f"request {name}: unsupported allocation mode {mode}")
            requests = ((spec.get("capacity") or {}).get("requests")) or {}
            candidates = []
            for device in _candidates(inventory, classes, spec, driver, taken, device_taints or {},
                                      frozenset(shares.capacity), None if order is None else tuple(order)):
                # (a share in use, even one of no capacity, has taken the device's counters)
                if not (device.name in shares.capacity and device.name in shares.used) and \
                        not counters.fits(device.name):
                    continue  # its counters are taken by what was allocated before
                problem = capacity_error(shares.capacity.get(device.name) or _as_published(device), requests)
                if problem:  # the scheduler stops here, whatever the other devices offer
                    raise Unsatisfiable(f"request {name}: checking capacity for device {device.name}: {problem}")
                if device.name in shares.capacity:
                    amount = shares.amount(device.name, requests)
                    if amount is None:
                        continue  # not enough of it left
                    candidates.append((device, amount))
                elif not requests:
                    candidates.append((device, None))
                elif _dedicated_holds(device, requests):
                    candidates.append((device, None))  # a dedicated device that can hold the request
            options.append((name, candidates, count))
        options_per_request.append(options)
    # The scheduler refuses a claim whose requests need more than its 32 results before it
    # searches (a request with alternatives counting its smallest).
    accounted = 0
    for request, options in zip(devices_spec.get("requests", []), options_per_request):
        smallest = min((count for _, _, count in options), default=0)
        if smallest > MAX_RESULTS - accounted:
            raise Unsatisfiable(f"request {request['name']}: adding {smallest} devices exceeds the claim "
                                f"limit of {MAX_RESULTS}, with {accounted} already accounted for")
        accounted += smallest
    constraints = devices_spec.get("constraints", [])

    for index, constraint in enumerate(constraints):
        if not (constraint.get("matchAttribute") or constraint.get("distinctAttribute")):
            raise Unsatisfiable(f"constraint #{index}: empty constraint (unsupported constraint type?)")

    def satisfied(choices: list[Choice]) -> bool:
        for constraint in constraints:
            names = set(constraint.get("requests") or [c.request.split("/")[0] for c in choices])
            attribute = constraint.get("matchAttribute") or constraint["distinctAttribute"]
            key = attribute.removeprefix(f"{driver}/")  # ours are stored unqualified
            sets = [_as_set(d.attributes.get(key)) for c in choices
                    if c.request.split("/")[0] in names or c.request in names for d in c.devices]
            if any(s is None for s in sets):
                return False
            if "matchAttribute" in constraint and sets and not set.intersection(*sets):
                return False
            if "distinctAttribute" in constraint and any(a & b for i, a in enumerate(sets) for b in sets[i + 1:]):
                return False
        return True

    # The fewest devices the requests from each index on need: an alternative leaving less
    # room than that in the 32 results is skipped, as the scheduler does.
    least_after = [0] * (len(options_per_request) + 1)
    for index in range(len(options_per_request) - 1, -1, -1):
        least_after[index] = least_after[index + 1] + min((c for _, _, c in options_per_request[index]), default=0)

    def search(index: int, chosen: list[Choice], used: set[str]) -> list[Choice] | None:
        if sum(len(c.devices) for c in chosen) > MAX_RESULTS:
            return None  # a claim holds at most 32 results
        if index == len(options_per_request):
            return chosen if satisfied(chosen) else None
        for name, candidates, count in options_per_request[index]:  # first alternative first
            # A device that allows multiple allocations can serve several requests of the
            # claim, while its capacity holds all of their shares.
            free = [c for c in candidates if c[0].name not in used or c[0].name in shares.capacity]
            if count > len(free):
                continue  # (combinations() of a huge count would allocate it first)
            if sum(len(c.devices) for c in chosen) + count + least_after[index + 1] > MAX_RESULTS:
                continue  # the requests after it could not fit in the claim's 32 results
            for combo in itertools.islice(itertools.combinations(free, count), 2000):
                devices = tuple(d for d, _ in combo)
                # Counters of the devices taken, each once; a shared device in use has its own.
                keys = list(dict.fromkeys([d.name for d in devices] + [d.name for c in chosen for d in c.devices]))
                keys = [k for k in keys if not (k in shares.capacity and k in shares.used)]
                if keys and not counters.fits(keys[0], tuple(keys[1:])):
                    continue
                consumed = tuple(None if a is None else {k: _canonical(v) for k, v in a.items()}
                                 for _, a in combo)
                if not _shares_fit(shares, chosen + [Choice(name, devices, consumed)], used, devices):
                    continue
                found = search(index + 1, chosen + [Choice(name, devices, consumed)],
                               used | {d.name for d in devices})
                if found is not None:
                    return found
        return None

    result = search(0, [], set())
    if result is None:
        raise Unsatisfiable("no combination of devices satisfies the claim")
    in_use = {k for k in shares.capacity if k in shares.used}  # shared devices that have their counters
    for name in dict.fromkeys(d.name for choice in result for d in choice.devices):
        if name not in in_use:
            counters.take(name)
    for choice in result:
        for device, consumed in zip(choice.devices, choice.consumed):
            if consumed is not None:
                shares.take(device.name, {k: quantity.value(v) for k, v in consumed.items()})
    return result


def allocation_results(choices: list[Choice], driver: str, pool: str) -> list[dict]:
    results = []
    for choice in choices:
        consumed = choice.consumed or (None,) * len(choice.devices)
        for device, amount in zip(choice.devices, consumed):
            result = {"request": choice.request, "driver": driver, "pool": pool, "device": device.name}
            if amount is not None:
                result.update(shareID=str(uuid.uuid4()), consumedCapacity=amount)
            results.append(result)
    return results


def allocation_config(claim_spec: dict, driver: str) -> list[dict]:
    return [{"source": "FromClaim", "requests": c.get("requests", []), "opaque": c["opaque"]}
            for c in claim_spec.get("devices", {}).get("config", [])
            if c.get("opaque", {}).get("driver") == driver]
