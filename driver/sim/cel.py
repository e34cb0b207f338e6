"""DeviceClass and request CEL selectors evaluated as the scheduler evaluates them, on
cel-python.

The DRA CEL environment (resource.k8s.io `CELDeviceSelector`): the input is `device`
with `driver`, `attributes` and `capacity` (both grouped by domain; an unqualified name
lives under the driver's own domain), and `allowMultipleAllocations`. Looking up an
unknown domain gives an empty map; looking up an unknown name in a domain is a runtime
error, and a runtime error aborts the allocation (it does not just skip the device). Capacity
values are quantities, `version` attributes semantic versions.

Where cel-python differs from the Kubernetes CEL library this module adds what is missing:
the `quantity` and `semver` types and functions of the Kubernetes extension libraries
(`quantity()`, `isQuantity()`, `compareTo`, `isGreaterThan`, `isLessThan`, `asInteger`,
`asApproximateFloat`, `isInteger`, `sign`, `add`, `sub`; `semver()` with strict semver 2.0
parsing, `isSemver()`, `major`, `minor`, `patch`), map lookups with the default for an
unknown domain, and type errors where Kubernetes has no overload (`<` on two quantities,
`==` between a quantity and a string): Kubernetes rejects those when the claim is created,
here they are errors when evaluated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Mapping

import celpy
from celpy import celtypes

from driver import names
from driver import quantity as quantities
from driver.devices.model import Device, Version

STANDARD_DOMAIN = "resource.kubernetes.io"
# device.attributes["d"].name / ["d"]["name"], device.capacity["d"].name: what a selector reads.
_REFERENCE = re.compile(r'device\.(attributes|capacity)\["([^"]+)"\](?:\.([A-Za-z_][A-Za-z0-9_]*)'
                        r'|\["([^"]+)"\])')


class CelError(Exception):
    """A selector that does not compile, fails at runtime, or does not return a bool."""

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(message)
        self.expression = expression
        self.message = message


class _NoOrdering:
    """Kubernetes' quantity and semver types have no `<`: only compareTo and friends."""

    def _refuse(self, other, op: str):
        raise TypeError(f"no matching overload for '_{op}_' applied to "
                        f"'({_type_name(self)}, {_type_name(other)})'; use compareTo")

    def __lt__(self, other):
        self._refuse(other, "<")

    def __le__(self, other):
        self._refuse(other, "<=")

    def __gt__(self, other):
        self._refuse(other, ">")

    def __ge__(self, other):
        self._refuse(other, ">=")


class Quantity(_NoOrdering):
    """A resource.Quantity, compared by value; keeps the spelling for messages."""

    __slots__ = ("value", "text")

    def __init__(self, text: str) -> None:
        try:
            self.value = quantities.value(str(text))
        except quantities.QuantityError as err:
            raise ValueError(f"quantity({str(text)!r}): {err}") from None
        self.text = str(text)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            raise TypeError(f"no such overload: quantity == {_type_name(other)}")
        return self.value == other.value

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.text!r})"

    def __str__(self) -> str:
        return self.text


class SemVer(_NoOrdering):
    """A semantic version (semver 2.0, as Kubernetes' `semver()` parses it)."""

    __slots__ = ("text", "key")

    def __init__(self, text: str) -> None:
        text = str(text)
        if not names.is_semver(text):
            raise ValueError(f"semver({text!r}): not a semantic version (MAJOR.MINOR.PATCH)")
        self.text = text
        core, _, pre = text.split("+", 1)[0].partition("-")
        # A pre-release sorts before its release: (1,2,3,0,pre) < (1,2,3,1,"").
        self.key = (*(int(p) for p in core.split(".")), 0 if pre else 1, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SemVer):
            raise TypeError(f"no such overload: semver == {_type_name(other)}")
        return self.key == other.key

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"semver({self.text!r})"

    def __str__(self) -> str:
        return self.text


def _type_name(value: object) -> str:
    return {Quantity: "quantity", SemVer: "semver", celtypes.StringType: "string",
            celtypes.IntType: "int", celtypes.BoolType: "bool"}.get(type(value), type(value).__name__)


def _same(a, b, what: str):
    if type(a) is not type(b) or not isinstance(a, (Quantity, SemVer)):
        raise TypeError(f"no such overload: {_type_name(a)}.{what}({_type_name(b)})")
    return (a.value, b.value) if isinstance(a, Quantity) else (a.key, b.key)


def _compare(a, b) -> celtypes.IntType:
    x, y = _same(a, b, "compareTo")
    return celtypes.IntType((x > y) - (x < y))


def _quantity_only(q, what: str) -> Quantity:
    if not isinstance(q, Quantity):
        raise TypeError(f"no such overload: {_type_name(q)}.{what}()")
    return q


def _as_integer(q) -> celtypes.IntType:
    value = _quantity_only(q, "asInteger").value
    if value != value.to_integral_value() or abs(value) >= 2**63:
        raise ValueError(f"{q!r}.asInteger(): not representable as an int64")
    return celtypes.IntType(int(value))


def _arith(a, b, sign: int) -> Quantity:
    a = _quantity_only(a, "add" if sign > 0 else "sub")
    other = b.value if isinstance(b, Quantity) else Decimal(int(b))
    return Quantity(format(a.value + sign * other, "f"))


def _semver_part(v, index: int) -> celtypes.IntType:
    if not isinstance(v, SemVer):
        raise TypeError(f"no such overload: {_type_name(v)}.{('major', 'minor', 'patch')[index]}()")
    return celtypes.IntType(v.key[index])


def _is(kind, text) -> celtypes.BoolType:
    try:
        kind(str(text))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


FUNCTIONS = {
    "quantity": lambda text: Quantity(str(text)),
    "isQuantity": lambda text: _is(Quantity, text),
    "semver": lambda text: SemVer(str(text)),
    "isSemver": lambda text: _is(SemVer, text),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(_quantity_only(q, "asApproximateFloat").value)),
    "isInteger": lambda q: celtypes.BoolType(
        _quantity_only(q, "isInteger").value == _quantity_only(q, "isInteger").value.to_integral_value()),
    "sign": lambda q: celtypes.IntType((_quantity_only(q, "sign").value > 0) - (q.value < 0)),
    "add": lambda a, b: _arith(a, b, 1),
    "sub": lambda a, b: _arith(a, b, -1),
    "major": lambda v: _semver_part(v, 0),
    "minor": lambda v: _semver_part(v, 1),
    "patch": lambda v: _semver_part(v, 2),
}


class _Domains(celtypes.MapType):
    """device.attributes / device.capacity: an unknown domain is an empty map."""

    def __getitem__(self, key):
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType({})


@lru_cache(maxsize=1024)
def _program(expression: str):
    env = celpy.Environment()
    try:
        ast = env.compile(expression)
    except celpy.CELParseError as err:
        raise CelError(expression, f"does not compile: {' '.join(str(err).split())}") from None
    return env.program(ast, functions=FUNCTIONS)


def _cel_value(value: Any):
    if isinstance(value, SemVer):
        return value
    if isinstance(value, Version):
        return SemVer(value.value)
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    return celtypes.StringType(value)


def activation(driver: str, attributes: Mapping[str, Mapping[str, Any]],
               capacity: Mapping[str, Mapping[str, str]], allow_multiple: bool = False) -> dict:
    """The `device` variable: attributes and capacity by domain (values: str, int, bool,
    Version; capacity quantities as strings)."""
    s = celtypes.StringType
    return {"device": celtypes.MapType({
        s("driver"): s(driver),
        s("allowMultipleAllocations"): celtypes.BoolType(allow_multiple),
        s("attributes"): _Domains({s(d): celtypes.MapType({s(k): _cel_value(v) for k, v in attrs.items()})
                                   for d, attrs in attributes.items()}),
        s("capacity"): _Domains({s(d): celtypes.MapType({s(k): Quantity(v) for k, v in caps.items()})
                                 for d, caps in capacity.items()}),
    })}


def by_domain(items: Mapping[str, Any], driver: str) -> dict[str, dict[str, Any]]:
    """`name` -> driver's domain, `domain/name` -> that domain."""
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in items.items():
        domain, _, name = key.rpartition("/")
        grouped.setdefault(domain or driver, {})[name] = value
    return grouped


def evaluate(expression: str, variables: dict) -> bool:
    """The selector's verdict; CelError when Kubernetes would report a CEL error."""
    program = _program(expression)
    try:
        result = program.evaluate(variables)
    except celpy.CELEvalError as err:
        raise CelError(expression, _eval_message(err)) from None
    if isinstance(result, celpy.CELEvalError):
        raise CelError(expression, _eval_message(result))
    if not isinstance(result, celtypes.BoolType):
        raise CelError(expression, f"must return a bool, returned {_type_name(result)}")
    return bool(result)


def _eval_message(err: celpy.CELEvalError) -> str:
    message, cause, detail = (tuple(err.args) + (None, None, None))[:3]
    if cause is KeyError and detail:
        return f"no such key: {detail[0]}"
    if cause is KeyError and "no such member" in str(message):
        return "no such key: " + str(message).rsplit(":", 1)[-1].strip(" '")
    if cause in (TypeError, ValueError) and detail:
        return str(detail[0])
    return str(message)


def references(expression: str) -> list[tuple[str, str, str]]:
    """(attributes|capacity, domain, name) that the expression reads, in order, once each."""
    seen: list[tuple[str, str, str]] = []
    for kind, domain, dotted, indexed in _REFERENCE.findall(expression):
        ref = (kind, domain, dotted or indexed)
        if ref not in seen:
            seen.append(ref)
    return seen


def device_activation(device: Device, driver: str) -> dict:
    return activation(driver, by_domain(device.attributes, driver), {driver: dict(device.capacity)})


def matches(expression: str, device: Device, driver: str) -> bool:
    """True when the selector accepts the device; CelError as the scheduler would fail."""
    return evaluate(expression, device_activation(device, driver))
