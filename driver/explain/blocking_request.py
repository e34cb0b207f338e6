"""`explain --request SPEC`: a request given as a size instead of a claim file.

    SPEC = CLASS[=COUNT][,NAME=VALUE...]

CLASS is a DeviceClass, by its name or by the part before its first dot (`gpu` for
`gpu.accel.dra.io`, where only one class starts so); COUNT is the number of devices
(default 1). NAME=VALUE narrows each device: a capacity the class's devices publish is a
capacity request (`gpu=1,memory=40Gi`: a share of one GPU), anything else is an attribute
that must equal VALUE (`mig=1,profile=3g.40gb`). Each --request is one request of one
claim; several are allocated together, as the requests of one claim are.
"""

from __future__ import annotations

import json

from driver.explain import world as w
from driver.kube import quantity as quantities


class RequestError(ValueError):
    """A --request that cannot be read; the message names it."""


def claim_spec(texts: list[str], world: w.World) -> dict:
    """The claim spec (resource.k8s.io/v1) of these --request options."""
    requests = [_request(text, world) for text in texts]
    # Each request is named after its class as written (gpu, gpu-2 for a second one): the
    # name the answer shows beside each device.
    seen: dict[str, int] = {}
    for request in requests:
        seen[request["name"]] = seen.get(request["name"], 0) + 1
        if seen[request["name"]] > 1:
            request["name"] = f"{request['name']}-{seen[request['name']]}"
    return {"devices": {"requests": requests}}


def _request(text: str, world: w.World) -> dict:
    where = f"--request {text}"
    head, *rest = [part.strip() for part in text.split(",")]
    name, _, count_text = head.partition("=")
    device_class = _class(name.strip(), world, where)
    try:
        count = int(count_text) if count_text else 1
    except ValueError:
        raise RequestError(f"{where}: the count {count_text!r} is not a whole number") from None
    if count < 1:
        raise RequestError(f"{where}: the count must be 1 or more, not {count}")
    exactly: dict = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    # (the class's devices, looked at only as far as a NAME=VALUE needs)
    devices = _Lazy(d for d in world.devices if _in_class(d, world.classes[device_class]))
    capacity: dict[str, str] = {}
    selectors: list[str] = []
    for item in rest:
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not key or not value:
            raise RequestError(f"{where}: {item!r} is not NAME=VALUE")
        if any(key in d.capacity or key in _short_names(d.capacity, d.driver) for d in devices):
            try:
                quantities.value(value)
            except quantities.QuantityError as err:
                raise RequestError(f"{where}: capacity {key}: {err}") from None
            capacity[key] = value
        elif any(d.attribute(key) is not None for d in devices):
            selectors.append(_equals(key, value, devices))
        else:
            known = sorted({n for d in devices for n in _short_names(d.capacity, d.driver) | _short_names(d.attributes, d.driver)})
            raise RequestError(f"{where}: no device of class {device_class} has a capacity or attribute {key!r}"
                               + (f" (they have: {', '.join(known)})" if known else ""))
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    label = "".join(c if c.isalnum() or c == "-" else "-" for c in name.strip().split(".", 1)[0].lower()).strip("-")
    return {"name": label or "request", "exactly": exactly}


class _Lazy:
    """An iterable that computes its items once, as far as they are asked for."""

    def __init__(self, items) -> None:
        self._items, self._seen = iter(items), []

    def __iter__(self):
        yield from self._seen
        for item in self._items:
            self._seen.append(item)
            yield item


def _class(name: str, world: w.World, where: str) -> str:
    if name in world.classes:
        return name
    matches = sorted(c for c in world.classes if c.split(".", 1)[0] == name)
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(sorted(world.classes)) or "none"
    if matches:
        raise RequestError(f"{where}: {name!r} names several DeviceClasses ({', '.join(matches)}); give the full name")
    raise RequestError(f"{where}: no DeviceClass {name!r} (classes: {known})")


def _in_class(device: w.PoolDevice, device_class: w.DeviceClass) -> bool:
    from driver.scheduling import cel
    try:
        return all(cel.evaluate(e, device.activation()) for e in device_class.selectors)
    except cel.CelError:
        return False


def _short_names(table: dict, driver: str) -> set[str]:
    """Names as a selector writes them: the driver's own domain left off."""
    return {k.rpartition("/")[2] if k.rpartition("/")[0] in ("", driver) else k for k in table}


def _equals(key: str, value: str, devices: list[w.PoolDevice]) -> str:
    """A selector for attribute `key` == value, typed as the devices publish it."""
    device = next(d for d in devices if d.attribute(key) is not None)
    domain, _, short = key.rpartition("/")
    domain = domain or device.driver
    have = device.attribute(key)
    if isinstance(have, bool):
        literal = "true" if value.lower() == "true" else "false"
    elif isinstance(have, int):
        literal = value if value.lstrip("-").isdigit() else json.dumps(value)
    elif isinstance(have, w.VersionText):
        return f'device.attributes["{domain}"].{short}.compareTo(semver({json.dumps(value)})) == 0'
    else:
        literal = json.dumps(value)
    return f'device.attributes["{domain}"].{short} == {literal}'
