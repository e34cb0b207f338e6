"""A small allocator for the demo and the tests: picks devices for a claim the way the
scheduler would for the features our examples use (DeviceClass and request CEL
selectors, ExactCount, firstAvailable, matchAttribute constraints, opaque configs).
It is not the scheduler: no scoring, no cross-claim bookkeeping beyond `taken`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from driver.devices.model import Device, Inventory
from driver.sim.cel import matches


class Unsatisfiable(Exception):
    pass


@dataclass(frozen=True)
class Choice:
    request: str  # "gpu" or "gpu/h100" for a firstAvailable subrequest
    devices: tuple[Device, ...]


def _candidates(inventory: Inventory, classes: dict[str, list[str]], exactly: dict, driver: str,
                taken: set[str]) -> list[Device]:
    expressions = list(classes.get(exactly["deviceClassName"], [])) if exactly.get("deviceClassName") in classes else None
    if expressions is None:
        raise Unsatisfiable(f"unknown DeviceClass {exactly.get('deviceClassName')!r}")
    expressions += [s["cel"]["expression"] for s in exactly.get("selectors", [])]
    return [d for d in inventory.devices
            if d.name not in taken and all(matches(e, d, driver) for e in expressions)]


def allocate(claim_spec: dict, inventory: Inventory, classes: dict[str, list[str]], driver: str,
             taken: set[str] | None = None) -> list[Choice]:
    taken = set(taken or ())
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
        options_per_request.append([(name, _candidates(inventory, classes, spec, driver, taken), count)
                                    for name, spec, count in alternatives])
    constraints = devices_spec.get("constraints", [])

    def satisfied(choices: list[Choice]) -> bool:
        for constraint in constraints:
            names = set(constraint.get("requests") or [c.request.split("/")[0] for c in choices])
            attribute = constraint["matchAttribute"]
            key = attribute.removeprefix(f"{driver}/")  # ours are stored unqualified
            values = {d.attributes.get(key) for c in choices if c.request.split("/")[0] in names
                      for d in c.devices}
            if len(values) != 1 or None in values:
                return False
        return True

    def search(index: int, chosen: list[Choice], used: set[str]) -> list[Choice] | None:
        if index == len(options_per_request):
            return chosen if satisfied(chosen) else None
        for name, candidates, count in options_per_request[index]:  # first alternative first
            free = [d for d in candidates if d.name not in used]
            for combo in itertools.islice(itertools.combinations(free, count), 2000):
                found = search(index + 1, chosen + [Choice(name, combo)], used | {d.name for d in combo})
                if found is not None:
                    return found
        return None

    result = search(0, [], set())
    if result is None:
        raise Unsatisfiable("no combination of devices satisfies the claim")
    return result


def allocation_results(choices: list[Choice], driver: str, pool: str) -> list[dict]:
    return [{"request": c.request, "driver": driver, "pool": pool, "device": d.name}
            for c in choices for d in c.devices]


def allocation_config(claim_spec: dict, driver: str) -> list[dict]:
    return [{"source": "FromClaim", "requests": c.get("requests", []), "opaque": c["opaque"]}
            for c in claim_spec.get("devices", {}).get("config", [])
            if c.get("opaque", {}).get("driver") == driver]
