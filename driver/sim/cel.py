"""Evaluates DeviceClass and request CEL selectors against our devices, as the scheduler
does: `device.driver`, `device.attributes[domain].name`, `device.capacity[domain].name`,
with the Kubernetes CEL extensions the examples use (`quantity()`, `compareTo`,
`semver()`, `isGreaterThan`, `isLessThan`). Built on cel-python."""

from __future__ import annotations

import re
from decimal import Decimal
from functools import lru_cache

import celpy
from celpy import celtypes

from driver.devices.model import Device, Version

_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$")
STANDARD_DOMAIN = "resource.kubernetes.io"


class Quantity(celtypes.IntType):
    """A resource.Quantity, compared by value (bytes for memory)."""


class SemVer(celtypes.StringType):
    def key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in str(self).split("-", 1)[0].split("."))


def quantity(text) -> Quantity:
    match = _QUANTITY.match(str(text))
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return Quantity(int(Decimal(match.group(1)) * _SUFFIX[match.group(2)]))


def _compare(a, b) -> celtypes.IntType:
    if isinstance(a, SemVer) and isinstance(b, SemVer):
        a, b = a.key(), b.key()
    return celtypes.IntType((a > b) - (a < b))


FUNCTIONS = {
    "quantity": quantity,
    "semver": lambda text: SemVer(str(text)),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
}


@lru_cache(maxsize=256)
def _program(expression: str):
    env = celpy.Environment()
    return env.program(env.compile(expression), functions=FUNCTIONS)


def device_activation(device: Device, driver: str) -> dict:
    attributes: dict[str, dict] = {driver: {}, STANDARD_DOMAIN: {}}
    for key, value in device.attributes.items():
        domain, _, name = key.rpartition("/")
        domain = domain or driver
        if isinstance(value, Version):
            cel_value = SemVer(value.value)
        elif isinstance(value, bool):
            cel_value = celtypes.BoolType(value)
        elif isinstance(value, int):
            cel_value = celtypes.IntType(value)
        else:
            cel_value = celtypes.StringType(value)
        attributes.setdefault(domain, {})[name] = cel_value
    capacity = {driver: {k: quantity(v) for k, v in device.capacity.items()}}
    return {"device": celtypes.MapType({
        celtypes.StringType("driver"): celtypes.StringType(driver),
        celtypes.StringType("attributes"): celpy.json_to_cel({})
        if not attributes else celtypes.MapType({
            celtypes.StringType(d): celtypes.MapType({celtypes.StringType(k): v for k, v in attrs.items()})
            for d, attrs in attributes.items()}),
        celtypes.StringType("capacity"): celtypes.MapType({
            celtypes.StringType(d): celtypes.MapType({celtypes.StringType(k): v for k, v in caps.items()})
            for d, caps in capacity.items()}),
    })}


def matches(expression: str, device: Device, driver: str) -> bool:
    """True when the selector accepts the device. A missing attribute is a non-match, as
    the scheduler treats a runtime error for one device."""
    try:
        result = _program(expression).evaluate(device_activation(device, driver))
    except celpy.CELEvalError:
        return False
    if isinstance(result, celpy.CELEvalError):
        return False
    return bool(result)
