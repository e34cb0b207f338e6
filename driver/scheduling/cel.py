"""DeviceClass and request CEL selectors evaluated as the scheduler evaluates them.

The DRA CEL environment (resource.k8s.io `CELDeviceSelector`, k8s.io/dynamic-resource-
allocation/cel at 1.37): the input is `device` with `driver`, `attributes` and `capacity`
(both grouped by domain; an unqualified name lives under the driver's own domain), and
`allowMultipleAllocations`. Looking up an unknown domain gives an empty map; looking up an
unknown name in a domain is a runtime error, and a runtime error aborts the allocation (it
does not just skip the device). Capacity values are quantities, `version` attributes
semantic versions, list-typed attributes (KEP-5491: ints, bools, strings, versions) lists.

The expression is parsed with cel-python's parser and evaluated here, with the semantics of
cel-go as Kubernetes configures it, because cel-python's own evaluator differs where it
matters for a verdict:

- equality is heterogeneous: `dyn(1) == 1.0` is true and `dyn(1) == "a"` false, while a
  comparison of two values whose types are known and differ (`1.0 == 1`,
  `quantity("1") == "1"`) is a type error, as the Kubernetes type checker rejects it;
  `<` and friends compare int, uint and double with each other;
- `&&` and `||` are commutative over errors (`error || true` is true);
- the macros (`all`, `exists`, `exists_one`, `map`, `filter`, two-variable forms) range over
  lists and maps only: a string is not iterable;
- a call that has no overload for its arguments is an error, never a Python exception;
- the libraries of the Kubernetes base environment that selectors use: `quantity`,
  `semver` (with the `normalize` argument), `format`, the strings extension (`split`,
  `lowerAscii`, ...), regex `find`/`findAll`, the lists libraries, `sets`, optionals,
  `cel.bind`, and `includes` (list-typed attributes);
- a runtime cost limit (resourceapi.CELSelectorExpressionMaxCost, 1,000,000): an expression
  that goes over it fails with the scheduler's error, `operation cancelled: actual cost
  limit exceeded`. The cost is counted per evaluation step and loop iteration, an
  approximation of cel-go's cost model that is never far below it.

Kubernetes reports type errors when the claim is created; here they are errors of the
evaluation. Either way the selector does not select, and explain says why.

The `Quantity` and `SemVer` types and `FUNCTIONS` also plug into cel-python (the tests'
ValidatingAdmissionPolicy check uses them).
"""

from __future__ import annotations

import base64
import datetime as _dt
import ipaddress
import math
import re
from decimal import Decimal, localcontext
from functools import lru_cache
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

import celpy
import lark
from celpy import celtypes

from driver.kube import names
from driver.kube import quantity as quantities
from driver.devices.model import Device, Version

STANDARD_DOMAIN = "resource.kubernetes.io"
COST_LIMIT = 1_000_000  # resourceapi.CELSelectorExpressionMaxCost
COST_LIMIT_MESSAGE = "operation cancelled: actual cost limit exceeded"
INT_MIN, INT_MAX, UINT_MAX = -(2**63), 2**63 - 1, 2**64 - 1
# device.attributes["d"].name / ["d"]["name"], device.capacity["d"].name: what a selector reads.
_REFERENCE = re.compile(r'device\.(attributes|capacity)\["([^"]+)"\](?:\.([A-Za-z_][A-Za-z0-9_]*)'
                        r'|\["([^"]+)"\])')


class CelError(Exception):
    """A selector that does not compile, fails at runtime, or does not return a bool."""

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(message)
        self.expression = expression
        self.message = message


class _EvalError(Exception):
    """A CEL runtime error (an error value in cel-go)."""


class _CompileError(Exception):
    """What the Kubernetes type checker or parser would reject."""


class _CostExceeded(Exception):
    pass


# -- value types ------------------------------------------------------------------------------------------
class UInt(int):
    """A CEL uint."""

    def __repr__(self) -> str:
        return f"{int(self)}u"


class _NoOrdering:
    """Kubernetes' quantity and semver types have no `<`: only compareTo and friends."""

    def _refuse(self, other, op: str):
        raise TypeError(f"found no matching overload for '_{op}_' applied to "
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
            with localcontext() as context:
                context.prec = 80
                self.value = quantities.value(str(text))
        except quantities.QuantityError as err:
            raise ValueError(f"quantity({str(text)!r}): {err}") from None
        self.text = str(text)

    @classmethod
    def of(cls, value: Decimal) -> "Quantity":
        return cls(format(value, "f"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            raise TypeError(f"found no matching overload for '_==_' applied to "
                            f"'(quantity, {_type_name(other)})'")
        return self.value == other.value

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.text!r})"

    def __str__(self) -> str:
        return self.text


def _pre_key(pre: str) -> tuple:
    """Semver 2.0 precedence of a pre-release: numeric identifiers numerically and below
    alphanumeric ones, a longer list above its prefix; no pre-release above any."""
    if not pre:
        return (1,)
    return (0, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")))


class SemVer(_NoOrdering):
    """A semantic version (semver 2.0, as Kubernetes' `semver()` parses it)."""

    __slots__ = ("text", "key")

    def __init__(self, text: str, normalize: bool = False) -> None:
        text = str(text)
        if normalize:
            text = _normalize_semver(text)
        if not names.is_semver(text):
            raise ValueError(f"semver({text!r}): not a semantic version (MAJOR.MINOR.PATCH)")
        self.text = text
        core, _, pre = text.split("+", 1)[0].partition("-")
        major, minor, patch = (int(p) for p in core.split("."))
        if max(major, minor, patch) > UINT_MAX:
            raise ValueError(f"semver({text!r}): a version number is out of range")
        self.key = (major, minor, patch, _pre_key(pre))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SemVer):
            raise TypeError(f"found no matching overload for '_==_' applied to "
                            f"'(semver, {_type_name(other)})'")
        return self.key == other.key

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"semver({self.text!r})"

    def __str__(self) -> str:
        return self.text


def _normalize_semver(text: str) -> str:
    """semver(s, true): a leading v dropped, leading zeros dropped, 1 and 1.2 filled up."""
    text = text.removeprefix("v")
    parts = text.split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            part = part.lstrip("0")
            if not part or not part[0].isdigit():
                part = "0" + part
            parts[i] = part
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise ValueError(f"semver({text!r}): short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


class Optional:
    __slots__ = ("value", "present")

    def __init__(self, value: Any = None, present: bool = False) -> None:
        self.value, self.present = value, present

    def __repr__(self) -> str:
        return f"optional.of({self.value!r})" if self.present else "optional.none()"


class Format:
    """A named format of the format library (`format.dns1123Label()`)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"format.{self.name}()"


class IP:
    """The IP library's net.IP: IPv4 or IPv6, no zone, no IPv4-mapped IPv6."""

    __slots__ = ("address",)

    def __init__(self, text: str) -> None:
        self.address = _parse_ip(text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IP) and other.address == self.address

    def __hash__(self) -> int:
        return hash(self.address)

    def __str__(self) -> str:
        return str(self.address)


class CIDR:
    """The CIDR library's net.CIDR: an address and a prefix length (host bits kept)."""

    __slots__ = ("interface",)

    def __init__(self, text: str) -> None:
        address, slash, prefix = str(text).partition("/")
        if not slash or not prefix.isdigit() or (len(prefix) > 1 and prefix[0] == "0"):
            raise ValueError(f"network address parse error during conversion from string: "
                             f"network address parse error: {text!r}")
        ip = _parse_ip(address, "network address")
        if int(prefix) > ip.max_prefixlen:
            raise ValueError(f"network address parse error during conversion from string: {text!r}")
        self.interface = ipaddress.ip_interface(f"{ip}/{prefix}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CIDR) and other.interface == self.interface

    def __hash__(self) -> int:
        return hash(self.interface)

    def __str__(self) -> str:
        return str(self.interface)


def _parse_ip(text: str, what: str = "IP Address"):
    text = str(text)
    try:
        if "%" in text:
            raise ValueError("zones are not allowed")
        address = ipaddress.ip_address(text)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            raise ValueError("IPv4-mapped IPv6 addresses are not allowed")
    except ValueError as err:
        raise ValueError(f"{what} {text!r} parse error during conversion from string: {err}") from None
    return address


class TypeValue:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TypeValue) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("type", self.name))

    def __repr__(self) -> str:
        return self.name


class Domains(dict):
    """device.attributes / device.capacity: an unknown domain is an empty map."""

    def __missing__(self, key):
        return {}


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, UInt):
        return "uint"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes):
        return "bytes"
    if value is None:
        return "null_type"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, Quantity):
        return "quantity"
    if isinstance(value, SemVer):
        return "semver"
    if isinstance(value, Optional):
        return "optional_type"
    if isinstance(value, Format):
        return "format"
    if isinstance(value, TypeValue):
        return "type"
    if isinstance(value, IP):
        return "net.IP"
    if isinstance(value, CIDR):
        return "net.CIDR"
    return {celtypes.StringType: "string", celtypes.IntType: "int",
            celtypes.BoolType: "bool"}.get(type(value), type(value).__name__)


def _no_overload(function: str, *args) -> _EvalError:
    return _EvalError(f"no such overload: {function}({', '.join(_type_name(a) for a in args)})")


# -- library functions (shared with cel-python) -----------------------------------------------------------
def _same(a, b, what: str):
    if type(a) is not type(b) or not isinstance(a, (Quantity, SemVer)):
        raise TypeError(f"no such overload: {_type_name(a)}.{what}({_type_name(b)})")
    return (a.value, b.value) if isinstance(a, Quantity) else (a.key, b.key)


def _compare(a, b) -> int:
    x, y = _same(a, b, "compareTo")
    return (x > y) - (x < y)


def _quantity_only(q, what: str) -> Quantity:
    if not isinstance(q, Quantity):
        raise TypeError(f"no such overload: {_type_name(q)}.{what}()")
    return q


def _q_is_integer(q) -> bool:
    value = _quantity_only(q, "isInteger").value
    return value == value.to_integral_value() and INT_MIN <= value <= INT_MAX


def _as_integer(q) -> int:
    if not _q_is_integer(q):
        raise ValueError("cannot convert value to integer")
    return int(q.value)


def _arith(a, b, sign: int) -> Quantity:
    a = _quantity_only(a, "add" if sign > 0 else "sub")
    if isinstance(b, Quantity):
        other = b.value
    elif isinstance(b, int) and not isinstance(b, bool):
        other = Decimal(int(b))
    else:
        raise TypeError(f"no such overload: quantity.{'add' if sign > 0 else 'sub'}({_type_name(b)})")
    with localcontext() as context:
        context.prec = 80
        return Quantity.of(a.value + sign * other)


def _semver_part(v, index: int) -> int:
    if not isinstance(v, SemVer):
        raise TypeError(f"no such overload: {_type_name(v)}.{('major', 'minor', 'patch')[index]}()")
    return v.key[index]


def _string_arg(text, function: str) -> str:
    if not isinstance(text, str) or isinstance(text, bool):
        raise TypeError(f"found no matching overload for '{function}' applied to '({_type_name(text)})'")
    return str(text)


def _is(kind, text, *extra) -> bool:
    text = _string_arg(text, "is" + kind.__name__)
    try:
        kind(text, *extra)
    except ValueError:
        return False
    return True


def _bool_arg(value, function: str) -> bool:
    if not isinstance(value, bool) and not isinstance(value, celtypes.BoolType):
        raise TypeError(f"found no matching overload for '{function}' applied to '({_type_name(value)})'")
    return bool(value)


_PY = {  # the library, on plain Python values
    "quantity": lambda text: Quantity(_string_arg(text, "quantity")),
    "isQuantity": lambda text: _is(Quantity, text),
    "semver": lambda text, normalize=False: SemVer(_string_arg(text, "semver"), _bool_arg(normalize, "semver")),
    "isSemver": lambda text, normalize=False: _is(SemVer, text, _bool_arg(normalize, "isSemver")),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: _compare(a, b) > 0,
    "isLessThan": lambda a, b: _compare(a, b) < 0,
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: float(_quantity_only(q, "asApproximateFloat").value),
    "isInteger": _q_is_integer,
    "sign": lambda q: (_quantity_only(q, "sign").value > 0) - (q.value < 0),
    "add": lambda a, b: _arith(a, b, 1),
    "sub": lambda a, b: _arith(a, b, -1),
    "major": lambda v: _semver_part(v, 0),
    "minor": lambda v: _semver_part(v, 1),
    "patch": lambda v: _semver_part(v, 2),
}


def _celpy_wrap(function: Callable) -> Callable:
    def call(*args):
        result = function(*args)
        if isinstance(result, bool):
            return celtypes.BoolType(result)
        if isinstance(result, int):
            return celtypes.IntType(result)
        if isinstance(result, float):
            return celtypes.DoubleType(result)
        return result
    return call


# For cel-python (the tests' admission policy check).
FUNCTIONS = {name: _celpy_wrap(function) for name, function in _PY.items()}


# -- the format library -----------------------------------------------------------------------------------
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
              "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
              "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
                  "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex "
                  "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
                "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
_QNAME_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
              "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used "
              "for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
                    "or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
                    "'my_value',  or '12345', regex used for validation is "
                    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_DNS1035_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_QNAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")


def _too_long(value: str, limit: int) -> list[str]:
    return [f"must be no more than {limit} characters"] if len(value) > limit else []


def _dns_label(value: str) -> list[str]:
    return _too_long(value, 63) + ([] if _LABEL_RE.match(value) else [_LABEL_MSG])


def _dns_subdomain(value: str) -> list[str]:
    return _too_long(value, 253) + ([] if _SUBDOMAIN_RE.match(value) else [_SUBDOMAIN_MSG])


def _dns1035(value: str) -> list[str]:
    return _too_long(value, 63) + ([] if _DNS1035_RE.match(value) else [_DNS1035_MSG])


def _qualified_name(value: str) -> list[str]:
    parts = value.split("/")
    if len(parts) == 1:
        prefix, name = "", parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            return ["prefix part must be non-empty"]
    else:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with "
                "an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    errors = ["prefix part " + e for e in _dns_subdomain(prefix)] if prefix else []
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if name and not _QNAME_RE.match(name):
        errors.append(_QNAME_MSG)
    return errors


def _prefix(check: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    # A prefix for generateName: valid once a suffix is appended, so a trailing "-" is
    # checked as if it were a letter.
    return lambda value: check(value[:-1] + "a" if len(value) > 1 and value.endswith("-") else value)


def _uri(value: str) -> list[str]:
    try:
        parsed = urlparse(value)
    except ValueError:
        return ["invalid URI"]
    return [] if parsed.scheme else ["invalid URI"]


def _uuid_check(value: str) -> list[str]:
    return [] if re.fullmatch(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}",
                              value) else ["does not match the UUID format"]


def _byte(value: str) -> list[str]:
    try:
        base64.b64decode(value, validate=True)
    except ValueError:
        return ["invalid base64"]
    return []


def _date(value: str) -> list[str]:
    try:
        _dt.date.fromisoformat(value) if re.fullmatch(r"\d{4}-\d{2}-\d{2}", value) else 1 / 0
    except (ValueError, ZeroDivisionError):
        return ["invalid date"]
    return []


def _datetime(value: str) -> list[str]:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:?\d{2})?", value):
        return ["invalid datetime"]
    try:
        _dt.datetime.fromisoformat(value.replace("z", "Z").replace("t", "T"))
    except ValueError:
        return ["invalid datetime"]
    return []


_FORMATS: dict[str, Callable[[str], list[str]]] = {
    "dns1123Label": _dns_label, "dns1123Subdomain": _dns_subdomain, "dns1035Label": _dns1035,
    "qualifiedName": _qualified_name, "dns1123LabelPrefix": _prefix(_dns_label),
    "dns1123SubdomainPrefix": _prefix(_dns_subdomain), "dns1035LabelPrefix": _prefix(_dns1035),
    "labelValue": lambda v: _too_long(v, 63) + ([] if _LABEL_VALUE_RE.match(v) else [_LABEL_VALUE_MSG]),
    "uri": _uri, "uuid": _uuid_check, "byte": _byte, "date": _date, "datetime": _datetime,
}


# -- static types -----------------------------------------------------------------------------------------
DYN = "dyn"
_NUMERIC = {"int", "uint", "double"}
_KNOWN_RESULT = {  # function -> result type, where it does not depend on the arguments
    "quantity": "quantity", "isQuantity": "bool", "semver": "semver", "isSemver": "bool",
    "compareTo": "int", "isGreaterThan": "bool", "isLessThan": "bool", "asInteger": "int",
    "asApproximateFloat": "double", "isInteger": "bool", "sign": "int", "add": "quantity", "sub": "quantity",
    "major": "int", "minor": "int", "patch": "int", "size": "int", "contains": "bool", "startsWith": "bool",
    "endsWith": "bool", "matches": "bool", "int": "int", "uint": "uint", "double": "double",
    "string": "string", "bool": "bool", "bytes": "bytes", "split": "list", "lowerAscii": "string",
    "upperAscii": "string", "trim": "string", "replace": "string", "substring": "string",
    "charAt": "string", "indexOf": "int", "lastIndexOf": "int", "join": "string", "find": "string",
    "findAll": "list", "includes": "bool", "isSorted": "bool", "validate": "optional_type",
    "hasValue": "bool", "type": "type", "reverse": DYN, "distinct": "list", "flatten": "list",
    "sort": "list", "slice": "list", "first": "optional_type", "last": "optional_type",
    "all": "bool", "exists": "bool", "exists_one": "bool", "map": "list", "filter": "list",
    "has": "bool", "quote": "string", "format": "string",
}
_TYPE_IDENTS = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type"}
_NAMESPACES = {"cel", "format", "sets", "optional", "lists", "strings", "math", "ip", "net"}


class _Node:
    """A compiled expression: its static type and how to evaluate it; `path` follows the
    declared `device` object (device, attributes, attribute-domain, capacity,
    capacity-domain), whose capacity values are quantities."""

    __slots__ = ("type", "run", "path")

    def __init__(self, type_: str, run: Callable[[dict, list], Any], path: str | None = None) -> None:
        self.type, self.run, self.path = type_, run, path


def _check_same(op: str, a: _Node, b: _Node) -> None:
    if DYN in (a.type, b.type) or a.type == b.type:
        return
    raise _CompileError(f"found no matching overload for '{op}' applied to '({a.type}, {b.type})'")


def _tick(cost: list, amount: int = 1) -> None:
    cost[0] += amount
    if cost[0] > COST_LIMIT:
        raise _CostExceeded()


# -- equality and ordering ------------------------------------------------------------------------------
def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def equal(a, b) -> bool:
    """cel-go's heterogeneous equality: numbers by value across int, uint and double,
    values of different types unequal."""
    if _is_num(a) and _is_num(b):
        if isinstance(a, float) or isinstance(b, float):
            return float(a) == float(b) if not (isinstance(a, float) and isinstance(b, float)) else a == b
        return int(a) == int(b)
    if _type_name(a) != _type_name(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        for key, value in a.items():
            other = _map_get(b, key)
            if other is _MISSING or not equal(value, other):
                return False
        return True
    if isinstance(a, Optional):
        return a.present == b.present and (not a.present or equal(a.value, b.value))
    if isinstance(a, Format):
        return a.name == b.name
    if isinstance(a, float):
        return a == b
    return a == b


_MISSING = object()


def _map_has(mapping: dict, key) -> bool:
    return _map_lookup(mapping, key) is not _MISSING


def _map_lookup(mapping: dict, key):
    """The value under key: CEL keys are bool, int, uint or string, and numbers are one key
    space (`m[1u]` finds the key 1); _MISSING when absent."""
    if isinstance(key, str):
        return dict.get(mapping, key, _MISSING)
    if isinstance(key, bool):
        for k, v in mapping.items():
            if isinstance(k, bool) and k == key:
                return v
        return _MISSING
    if _is_num(key):
        for k, v in mapping.items():
            if _is_num(k) and equal(k, key):
                return v
        return _MISSING
    if key is None or isinstance(key, (list, dict, bytes)):
        raise _EvalError(f"unsupported key type: {_type_name(key)}")
    return _MISSING


def _map_get(mapping: dict, key):
    """A lookup; in device.attributes and device.capacity an unknown domain is an empty map."""
    found = _map_lookup(mapping, key)
    if found is _MISSING and isinstance(mapping, Domains) and isinstance(key, str):
        return {}
    return found


def _order(a, b, op: str) -> int:
    if _is_num(a) and _is_num(b):
        if isinstance(a, float) or isinstance(b, float):
            x, y = float(a), float(b)
            if math.isnan(x) or math.isnan(y):
                return 2  # unordered
        else:
            x, y = int(a), int(b)
        return (x > y) - (x < y)
    if (isinstance(a, bool) and isinstance(b, bool)) or (isinstance(a, str) and isinstance(b, str)) or (
            isinstance(a, bytes) and isinstance(b, bytes)):
        return (a > b) - (a < b)
    raise _EvalError(f"no such overload: {_type_name(a)} {op} {_type_name(b)}")


# -- literals ---------------------------------------------------------------------------------------------
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            '"': '"', "'": "'", "\\": "\\", "?": "?", "`": "`"}


def _unquote(token: str) -> str | bytes:
    is_bytes = token[:1] in "bB"
    if is_bytes:
        token = token[1:]
    raw = token[:1] in "rR"
    if raw:
        token = token[1:]
    quote = token[:3] if token[:3] in ('"""', "'''") else token[:1]
    body = token[len(quote):-len(quote)]
    if raw:
        return body.encode() if is_bytes else body
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in _ESCAPES:
            out.append(_ESCAPES[n])
            i += 2
        elif n in "xX":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        elif n == "u":
            out.append(chr(int(body[i + 2:i + 6], 16)))
            i += 6
        elif n == "U":
            out.append(chr(int(body[i + 2:i + 10], 16)))
            i += 10
        elif n in "01234567":
            out.append(chr(int(body[i + 1:i + 4], 8)))
            i += 4
        else:
            raise _CompileError(f"invalid escape sequence \\{n}")
    text = "".join(out)
    return text.encode("latin-1" if any(ord(c) > 127 for c in text) and all(ord(c) < 256 for c in text)
                       else "utf-8") if is_bytes else text


def _literal(token: lark.Token) -> _Node:
    kind, text = token.type, token.value
    if kind == "INT_LIT":
        value = int(text, 16) if "x" in text.lower() else int(text)
        if text.startswith("-0x"):
            value = -int(text[3:], 16)
        if not INT_MIN <= value <= INT_MAX:
            raise _CompileError(f"integer literal out of range: {text}")
        return _const(value, "int")
    if kind == "UINT_LIT":
        body = text[:-1]
        value = int(body, 16) if "x" in body.lower() else int(body)
        if not 0 <= value <= UINT_MAX:
            raise _CompileError(f"uint literal out of range: {text}")
        return _const(UInt(value), "uint")
    if kind == "FLOAT_LIT":
        return _const(float(text), "double")
    if kind in ("STRING_LIT", "MLSTRING_LIT"):
        return _const(_unquote(text), "string")
    if kind == "BYTES_LIT":
        value = _unquote(text)
        return _const(value if isinstance(value, bytes) else value.encode(), "bytes")
    if kind == "BOOL_LIT":
        return _const(text == "true", "bool")
    if kind == "NULL_LIT":
        return _const(None, "null_type")
    raise _CompileError(f"unknown literal {text}")


def _const(value, type_: str) -> _Node:
    def run(env, cost):
        _tick(cost)
        return value
    return _Node(type_, run)


# -- the compiler -----------------------------------------------------------------------------------------
_BINARY_RULES = {"relation_lt": "<", "relation_le": "<=", "relation_gt": ">", "relation_ge": ">=",
                 "relation_eq": "==", "relation_ne": "!=", "relation_in": "in",
                 "addition_add": "+", "addition_sub": "-", "multiplication_mul": "*",
                 "multiplication_div": "/", "multiplication_mod": "%"}
_MACROS = {"all", "exists", "exists_one", "existsOne", "map", "filter", "transformList", "transformMap",
           "transformMapEntry"}


class _Compiler:
    def __init__(self, variables: Mapping[str, str]) -> None:
        self.scopes: list[dict[str, str]] = [dict(variables)]

    def lookup_type(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def compile(self, tree) -> _Node:
        if isinstance(tree, lark.Token):
            return _literal(tree)
        rule = tree.data
        handler = getattr(self, "c_" + rule, None)
        if handler is not None:
            return handler(tree)
        if len(tree.children) == 1:  # expr, conditionalor, ... with a single operand
            return self.compile(tree.children[0])
        raise _CompileError(f"unsupported syntax: {rule}")

    # -- operators
    def c_expr(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        cond, yes, no = (self.compile(c) for c in tree.children)
        if cond.type not in (DYN, "bool"):
            raise _CompileError(f"found no matching overload for '_?_:_' applied to '({cond.type}, ...)'")

        def run(env, cost):
            _tick(cost)
            c = cond.run(env, cost)
            if not isinstance(c, bool):
                raise _no_overload("_?_:_", c)
            return yes.run(env, cost) if c else no.run(env, cost)
        return _Node(yes.type if yes.type == no.type else DYN, run)

    def _logical(self, tree, is_or: bool) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        left, right = self.compile(tree.children[0]), self.compile(tree.children[1])
        for side in (left, right):
            if side.type not in (DYN, "bool"):
                raise _CompileError(f"found no matching overload for '{'_||_' if is_or else '_&&_'}' "
                                    f"applied to '({left.type}, {right.type})'")

        def run(env, cost):
            _tick(cost)
            error = None
            for side in (left, right):
                try:
                    value = side.run(env, cost)
                except _EvalError as err:
                    error = error or err
                    continue
                if not isinstance(value, bool):
                    error = error or _no_overload("_||_" if is_or else "_&&_", value)
                    continue
                if value is is_or:
                    return value  # true || x, false && x: decided, errors or not
            if error is not None:
                raise error
            return not is_or
        return _Node("bool", run)

    def c_conditionalor(self, tree) -> _Node:
        return self._logical(tree, True)

    def c_conditionaland(self, tree) -> _Node:
        return self._logical(tree, False)

    def _binary(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        op_tree, right_tree = tree.children
        op = _BINARY_RULES[op_tree.data]
        left, right = self.compile(op_tree.children[0]), self.compile(right_tree)
        return _binary_node(op, left, right)

    c_relation = c_addition = c_multiplication = _binary

    def c_unary(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        op, operand_tree = tree.children
        operand = self.compile(operand_tree)
        if op.data == "unary_not":
            if operand.type not in (DYN, "bool"):
                raise _CompileError(f"found no matching overload for '!_' applied to '({operand.type})'")

            def run_not(env, cost):
                _tick(cost)
                v = operand.run(env, cost)
                if not isinstance(v, bool):
                    raise _no_overload("!_", v)
                return not v
            return _Node("bool", run_not)
        if operand.type not in (DYN, "int", "double"):
            raise _CompileError(f"found no matching overload for '-_' applied to '({operand.type})'")

        def run_neg(env, cost):
            _tick(cost)
            v = operand.run(env, cost)
            if isinstance(v, bool) or isinstance(v, UInt) or not _is_num(v):
                raise _no_overload("-_", v)
            if isinstance(v, int) and v == INT_MIN:
                raise _EvalError("integer overflow")
            return -v
        return _Node(operand.type, run_neg)

    # -- members
    def c_member(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_primary(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_literal(self, tree) -> _Node:
        return _literal(tree.children[0])

    def c_paren_expr(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_ident(self, tree) -> _Node:
        name = tree.children[0].value
        type_ = self.lookup_type(name)
        if type_ is None:
            if name in _TYPE_IDENTS:
                return _const(TypeValue(name), "type")
            raise _CompileError(f"undeclared reference to '{name}'")

        def run(env, cost):
            _tick(cost)
            return env[name]
        return _Node(type_, run, "device" if name == "device" and len(self.scopes) == 1 or (
            name == "device" and all(name not in s for s in self.scopes[1:])) else None)

    def c_list_lit(self, tree) -> _Node:
        items = [self.compile(c) for c in tree.children[0].children] if tree.children and tree.children[0] else []
        known = {i.type for i in items if i.type != DYN}
        if len(known) > 1:
            raise _CompileError(f"expected type '{items[0].type}' but found another: {sorted(known)}")

        def run(env, cost):
            _tick(cost)
            return [i.run(env, cost) for i in items]
        return _Node("list", run)

    def c_map_lit(self, tree) -> _Node:
        inits = tree.children[0].children if tree.children and tree.children[0] else []
        pairs = [(self.compile(inits[i]), self.compile(inits[i + 1])) for i in range(0, len(inits), 2)]

        def run(env, cost):
            _tick(cost)
            out: dict = {}
            for k, v in pairs:
                key = k.run(env, cost)
                if not isinstance(key, (str, int)):
                    raise _EvalError(f"unsupported key type: {_type_name(key)}")
                if _map_get(out, key) is not _MISSING:
                    raise _EvalError(f"Failed with repeated key: {key!r}")
                out[key] = v.run(env, cost)
            return out
        return _Node("map", run)

    def c_member_dot(self, tree) -> _Node:
        target_tree, field = tree.children
        field = field.value
        namespace = self._namespace(target_tree)
        if namespace == "net" and field in ("IP", "CIDR"):
            return _const(TypeValue(f"net.{field}"), "type")
        if namespace is not None:
            raise _CompileError(f"undeclared reference to '{namespace}.{field}'")
        target = self.compile(target_tree)
        if target.type not in (DYN, "map"):
            raise _CompileError(f"type '{target.type}' does not support field selection")
        if target.path == "device" and field not in _DEVICE_FIELDS:
            raise _CompileError(f"undefined field '{field}'")

        def run(env, cost):
            _tick(cost)
            value = target.run(env, cost)
            if not isinstance(value, dict):
                raise _EvalError(f"no such overload: {_type_name(value)}.{field}")
            found = _map_get(value, field)
            if found is _MISSING:
                raise _EvalError(f"no such key: {field}")
            return found
        return _typed(target, field, run)

    def c_member_index(self, tree) -> _Node:
        target, index = self.compile(tree.children[0]), self.compile(tree.children[1])
        if target.type not in (DYN, "map", "list"):
            raise _CompileError(f"found no matching overload for '_[_]' applied to '({target.type}, {index.type})'")

        def run(env, cost):
            _tick(cost)
            value, key = target.run(env, cost), index.run(env, cost)
            if isinstance(value, dict):
                found = _map_get(value, key)
                if found is _MISSING:
                    raise _EvalError(f"no such key: {key}")
                return found
            if isinstance(value, list):
                if isinstance(key, float) and key == int(key):
                    key = int(key)
                if not _is_num(key) or isinstance(key, float):
                    raise _no_overload("_[_]", value, key)
                if not 0 <= key < len(value):
                    raise _EvalError(f"index out of bounds: {key}")
                return value[int(key)]
            raise _no_overload("_[_]", value, key)
        return _typed(target, None, run)

    def c_member_object(self, tree) -> _Node:
        raise _CompileError("message construction is not supported by this environment")

    def c_dot_ident(self, tree) -> _Node:
        return self.c_ident(lark.Tree("ident", [tree.children[0]]))

    def c_dot_ident_arg(self, tree) -> _Node:
        return self.c_ident_arg(tree)

    def _namespace(self, tree) -> str | None:
        """`format` in `format.dns1123Label()`: a function namespace, not a variable."""
        while isinstance(tree, lark.Tree) and tree.data in ("member", "primary") and len(tree.children) == 1:
            tree = tree.children[0]
        if isinstance(tree, lark.Tree) and tree.data == "ident":
            name = tree.children[0].value
            if name in _NAMESPACES and self.lookup_type(name) is None:
                return name
        return None

    def _args(self, tree) -> list:
        exprlist = tree.children[-1] if tree.children else None
        return list(exprlist.children) if isinstance(exprlist, lark.Tree) and exprlist.data == "exprlist" else []

    def c_ident_arg(self, tree) -> _Node:
        name = tree.children[0].value
        args = self._args(tree)
        if name == "has":
            return self._has(args)
        if name == "dyn":
            if len(args) != 1:
                raise _CompileError("found no matching overload for 'dyn'")
            inner = self.compile(args[0])
            return _Node(DYN, inner.run)
        return self._call(name, None, [self.compile(a) for a in args])

    def c_member_dot_arg(self, tree) -> _Node:
        target_tree, method = tree.children[0], tree.children[1].value
        args = self._args(tree)
        namespace = self._namespace(target_tree)
        if namespace == "cel" and method == "bind":
            return self._bind(args)
        if namespace is not None:
            return self._call(f"{namespace}.{method}", None, [self.compile(a) for a in args])
        if method in _MACROS and len(args) in (2, 3, 4) and _is_ident(args[0]):
            return self._macro(method, self.compile(target_tree), args)
        target = self.compile(target_tree)
        return self._call(method, target, [self.compile(a) for a in args])

    # -- macros
    def _has(self, args) -> _Node:
        if len(args) != 1:
            raise _CompileError("invalid argument to has() macro")
        node = args[0]
        while isinstance(node, lark.Tree) and len(node.children) == 1 and node.data != "ident":
            node = node.children[0]
        if not (isinstance(node, lark.Tree) and node.data == "member_dot"):
            raise _CompileError("invalid argument to has() macro")
        target, field = self.compile(node.children[0]), node.children[1].value

        def run(env, cost):
            _tick(cost)
            value = target.run(env, cost)
            if isinstance(value, dict):
                return _map_has(value, field)
            raise _no_overload("has", value)
        return _Node("bool", run)

    def _bind(self, args) -> _Node:
        if len(args) != 3 or not _is_ident(args[0]):
            raise _CompileError("cel.bind() variable name must be a simple identifier")
        name = _ident_name(args[0])
        init = self.compile(args[1])
        self.scopes.append({name: init.type})
        try:
            body = self.compile(args[2])
        finally:
            self.scopes.pop()

        def run(env, cost):
            _tick(cost)
            return body.run({**env, name: init.run(env, cost)}, cost)
        return _Node(body.type, run)

    def _macro(self, method: str, target: _Node, args) -> _Node:
        if target.type not in (DYN, "list", "map"):
            raise _CompileError(f"expression of type '{target.type}' cannot be range of a comprehension "
                                "(must be list, map, or dynamic)")
        if method.startswith("transform"):  # transformList(i, v, [filter,] transform)
            if len(args) not in (3, 4) or not _is_ident(args[1]):
                raise _CompileError(f"{method}() takes two variables, an optional filter and a transform")
            names_ = [_ident_name(args[0]), _ident_name(args[1])]
            filter_tree, body_tree = (args[2], args[3]) if len(args) == 4 else (None, args[2])
        elif len(args) == 4:
            raise _CompileError(f"{method}() takes at most three arguments")
        elif method == "map" and len(args) == 3:  # map(x, filter, transform)
            names_ = [_ident_name(args[0])]
            filter_tree, body_tree = args[1], args[2]
        elif len(args) == 3:  # all(i, v, predicate) and the other two-variable forms
            if not _is_ident(args[1]):
                raise _CompileError(f"{method}() variable names must be simple identifiers")
            names_ = [_ident_name(args[0]), _ident_name(args[1])]
            filter_tree, body_tree = None, args[2]
        else:
            names_ = [_ident_name(args[0])]
            filter_tree, body_tree = None, args[1]
        self.scopes.append({n: DYN for n in names_})
        try:
            body = self.compile(body_tree)
            condition = self.compile(filter_tree) if filter_tree is not None else None
        finally:
            self.scopes.pop()
        if method == "existsOne":
            method = "exists_one"
        if method in ("all", "exists", "exists_one", "filter") and body.type not in (DYN, "bool"):
            raise _CompileError(f"found no matching overload for '{method}' predicate of type {body.type}")

        def items(env, cost):
            value = target.run(env, cost)
            if isinstance(value, list):
                pairs = list(enumerate(value)) if len(names_) == 2 else [(v, None) for v in value]
            elif isinstance(value, dict):
                pairs = list(value.items()) if len(names_) == 2 else [(k, None) for k in value]
            else:
                raise _EvalError(f"got '{_go_type(value)}', expected iterable type")
            for first, second in pairs:
                _tick(cost, 2)
                scope = {**env, names_[0]: first}
                if len(names_) == 2:
                    scope[names_[1]] = second
                yield first if len(names_) == 1 else second, scope

        def truth(v):
            if not isinstance(v, bool):
                raise _no_overload(method, v)
            return v

        if method in ("all", "exists"):
            want = method == "exists"

            def run(env, cost):
                _tick(cost)
                error = None
                for _, scope in items(env, cost):
                    try:
                        if truth(body.run(scope, cost)) is want:
                            return want
                    except _EvalError as err:
                        error = error or err
                if error is not None:
                    raise error
                return not want
            return _Node("bool", run)
        if method == "exists_one":
            def run_one(env, cost):
                _tick(cost)
                return sum(truth(body.run(scope, cost)) for _, scope in items(env, cost)) == 1
            return _Node("bool", run_one)
        if method == "filter":
            def run_filter(env, cost):
                _tick(cost)
                out = []
                for value, scope in items(env, cost):
                    _tick(cost, 4)  # cel-go's step: a conditional and a list concatenation
                    if truth(body.run(scope, cost)):
                        out.append(value)
                return out
            return _Node("list", run_filter)

        def run_map(env, cost):
            _tick(cost)
            out = [] if method in ("map", "transformList") else {}
            for _, scope in items(env, cost):
                _tick(cost, 4)  # cel-go's step: a conditional and a list concatenation
                if condition is not None and not truth(condition.run(scope, cost)):
                    continue
                value = body.run(scope, cost)
                if method == "transformMap":
                    out[scope[names_[0]]] = value
                elif method == "transformMapEntry":
                    if not isinstance(value, dict):
                        raise _no_overload(method, value)
                    for key, entry in value.items():
                        if _map_has(out, key):
                            raise _EvalError(f"insert failed: key {key} already exists")
                        out[key] = entry
                else:
                    out.append(value)
            return out
        return _Node("list" if method in ("map", "transformList") else "map", run_map)

    # -- calls
    def _call(self, name: str, target: _Node | None, args: list[_Node]) -> _Node:
        function = _LIBRARY.get(name)
        if function is None:
            raise _CompileError(f"undeclared reference to '{name}'")
        static = _static_check(name, target, args)
        result_type = static or _KNOWN_RESULT.get(name.rsplit(".", 1)[-1], DYN)
        if name == "optional.of" or name == "optional.none" or name == "optional.ofNonZeroValue":
            result_type = "optional_type"
        if name.startswith("format."):
            result_type = "format" if name != "format.named" else "optional_type"
        receiver = target is not None

        def run(env, cost):
            _tick(cost)
            values = ([target.run(env, cost)] if receiver else []) + [a.run(env, cost) for a in args]
            try:
                return function(receiver, cost, *values)
            except (_EvalError, _CostExceeded):
                raise
            except _NoOverload:
                raise _EvalError(f"found no matching overload for '{name}' applied to "
                                 f"'({', '.join(_type_name(v) for v in values)})'") from None
            except RecursionError:
                raise _EvalError("expression too deeply nested") from None
            except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError,
                    OverflowError, re.error, UnicodeError) as err:
                raise _EvalError(str(err) or type(err).__name__) from None
        return _Node(result_type, run)


def _is_ident(tree) -> bool:
    return _ident_name(tree) is not None


def _ident_name(tree) -> str | None:
    while isinstance(tree, lark.Tree) and len(tree.children) == 1 and tree.data != "ident":
        tree = tree.children[0]
    if isinstance(tree, lark.Tree) and tree.data == "ident":
        return tree.children[0].value
    return None


def _go_type(value) -> str:
    return {"bool": "types.Bool", "int": "types.Int", "uint": "types.Uint", "double": "types.Double",
            "string": "types.String", "bytes": "types.Bytes", "semver": "cel.Semver",
            "quantity": "cel.Quantity", "null_type": "types.Null"}.get(_type_name(value), _type_name(value))


_DEVICE_FIELDS = {"driver": ("string", None), "allowMultipleAllocations": ("bool", None),
                  "attributes": ("map", "attributes"), "capacity": ("map", "capacity")}


def _typed(target: _Node, field: str | None, run) -> _Node:
    """The static type of a field or index of `target`."""
    if target.path == "device" and field is not None:
        type_, path = _DEVICE_FIELDS[field]
        return _Node(type_, run, path)
    if target.path == "device":  # device["driver"]: not on a declared object
        return _Node(DYN, run)
    if target.path == "attributes":
        return _Node("map", run, "attribute-domain")
    if target.path == "capacity":
        return _Node("map", run, "capacity-domain")
    if target.path == "capacity-domain":
        return _Node("quantity", run)
    return _Node(DYN, run)


def _static_check(name: str, target: _Node | None, args: list[_Node]) -> str | None:
    """The type errors that the Kubernetes type checker reports for calls whose argument
    types are known here; the result type where it depends on them."""
    types_ = ([target.type] if target else []) + [a.type for a in args]
    if name in ("compareTo", "isGreaterThan", "isLessThan") and target is not None:
        kinds = {t for t in types_ if t != DYN}
        if len(kinds) > 1 or kinds - {"quantity", "semver"}:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("isQuantity", "quantity", "isSemver", "semver") and args and args[0].type not in (DYN, "string"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("asInteger", "asApproximateFloat", "isInteger", "sign") and target is not None and \
            target.type not in (DYN, "quantity"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("add", "sub") and target is not None and target.type not in (DYN, "quantity"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name == "size" and types_ and types_[0] not in (DYN, "string", "bytes", "list", "map"):
        raise _CompileError(f"found no matching overload for 'size' applied to '({', '.join(types_)})'")
    if name in ("sum", "min", "max") and target is not None:
        return DYN
    return None


def _binary_node(op: str, left: _Node, right: _Node) -> _Node:
    name = {"==": "_==_", "!=": "_!=_", "<": "_<_", "<=": "_<=_", ">": "_>_", ">=": "_>=_", "in": "@in",
            "+": "_+_", "-": "_-_", "*": "_*_", "/": "_/_", "%": "_%_"}[op]
    lt, rt = left.type, right.type
    if op in ("==", "!="):
        if not (lt in _NUMERIC and rt in _NUMERIC and lt == rt):
            _check_same(name, left, right)
    elif op in ("<", "<=", ">", ">="):
        if {"quantity", "semver"} & {lt, rt} or (
                DYN not in (lt, rt) and lt != rt and not (lt in _NUMERIC and rt in _NUMERIC)) or \
                {lt, rt} & {"list", "map", "null_type", "type", "optional_type", "format"}:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    elif op == "in":
        if rt not in (DYN, "list", "map"):
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    else:
        if DYN not in (lt, rt) and lt != rt:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
        allowed = {"+": {"int", "uint", "double", "string", "bytes", "list"},
                   "-": _NUMERIC, "*": _NUMERIC, "/": _NUMERIC, "%": {"int", "uint"}}[op]
        for t in (lt, rt):
            if t != DYN and t not in allowed:
                raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    result = "bool" if op in ("==", "!=", "<", "<=", ">", ">=", "in") else (lt if lt == rt else DYN)

    def run(env, cost):
        _tick(cost)
        a, b = left.run(env, cost), right.run(env, cost)
        return _apply(op, a, b, cost)
    return _Node(result, run)


def _apply(op: str, a, b, cost: list):
    if op == "==":
        return equal(a, b)
    if op == "!=":
        return not equal(a, b)
    if op in ("<", "<=", ">", ">="):
        if isinstance(a, (Quantity, SemVer)) or isinstance(b, (Quantity, SemVer)):
            raise _EvalError(f"found no matching overload for '_{op}_' applied to "
                             f"'({_type_name(a)}, {_type_name(b)})'")
        c = _order(a, b, op)
        if c == 2:
            return False
        return {"<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0}[op]
    if op == "in":
        if isinstance(b, list):
            _tick(cost, len(b))
            return any(equal(a, x) for x in b)
        if isinstance(b, dict):
            return _map_has(b, a)
        raise _no_overload("@in", a, b)
    return _arith_op(op, a, b)


def _arith_op(op: str, a, b):
    ta, tb = _type_name(a), _type_name(b)
    if ta != tb:
        raise _EvalError(f"no such overload: {ta} {op} {tb}")
    if ta in ("int", "uint"):
        a, b = int(a), int(b)
        if op == "+":
            r = a + b
        elif op == "-":
            r = a - b
        elif op == "*":
            r = a * b
        elif op == "/":
            if b == 0:
                raise _EvalError("division by zero")
            r = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
        else:
            if b == 0:
                raise _EvalError("modulus by zero")
            r = abs(a) % abs(b) * (1 if a >= 0 else -1)
        low, high = (INT_MIN, INT_MAX) if ta == "int" else (0, UINT_MAX)
        if not low <= r <= high:
            raise _EvalError(f"{ta} overflow" if ta == "uint" else "integer overflow")
        return r if ta == "int" else UInt(r)
    if ta == "double":
        if op == "%":
            raise _EvalError("no such overload: double % double")
        if op == "/":
            if b == 0:
                return math.copysign(math.inf, a) * (math.copysign(1, b)) if a != 0 else math.nan
            return a / b
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    if op == "+" and ta in ("string", "bytes"):
        return a + b
    if op == "+" and ta == "list":
        return list(a) + list(b)
    raise _EvalError(f"no such overload: {ta} {op} {tb}")


# -- library: the functions, dispatched on their runtime arguments -------------------------------------
class _NoOverload(Exception):
    pass


def _need(condition: bool) -> None:
    if not condition:
        raise _NoOverload()


def _s(v) -> bool:
    return isinstance(v, str)


def _i(v) -> bool:
    return isinstance(v, int) and not isinstance(v, (bool, UInt))


def _fn(py: Callable, *checks: Callable[[Any], bool], receiver: bool | None = None):
    def call(is_receiver, cost, *args):
        _need(receiver is None or receiver == is_receiver)
        _need(len(args) == len(checks) and all(c(a) for c, a in zip(checks, args)))
        return py(*args)
    return call


def _overloads(*candidates):
    def call(is_receiver, cost, *args):
        for candidate in candidates:
            try:
                return candidate(is_receiver, cost, *args)
            except _NoOverload:
                continue
        raise _NoOverload()
    return call


def _any(_v) -> bool:
    return True


def _size(is_receiver, cost, *args):
    _need(len(args) == 1)
    v = args[0]
    if isinstance(v, (str, bytes, list, dict)):
        return len(v)
    raise _NoOverload()


def _to_int(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bool):
        raise _NoOverload()
    if isinstance(v, int):
        if not INT_MIN <= v <= INT_MAX:
            raise _EvalError("integer overflow")
        return int(v)
    if isinstance(v, float):
        if math.isnan(v) or not -9.223372036854776e18 <= v < 9.223372036854776e18:
            raise _EvalError("integer overflow")
        return int(v)
    if isinstance(v, str):
        try:
            r = int(v, 10) if re.fullmatch(r"[+-]?\d+", v) else None
        except ValueError:
            r = None
        if r is None or not INT_MIN <= r <= INT_MAX:
            raise _EvalError(f"type conversion error from 'string' to 'int'")
        return r
    raise _NoOverload()


def _to_uint(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bool):
        raise _NoOverload()
    if isinstance(v, int):
        if not 0 <= v <= UINT_MAX:
            raise _EvalError("unsigned integer overflow")
        return UInt(v)
    if isinstance(v, float):
        if math.isnan(v) or not 0 <= v < 1.8446744073709552e19:
            raise _EvalError("unsigned integer overflow")
        return UInt(int(v))
    if isinstance(v, str):
        if not re.fullmatch(r"\+?\d+", v) or int(v) > UINT_MAX:
            raise _EvalError("type conversion error from 'string' to 'uint'")
        return UInt(int(v))
    raise _NoOverload()


def _to_double(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bool):
        raise _NoOverload()
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise _EvalError("type conversion error from 'string' to 'double'") from None
    raise _NoOverload()


def _format_double(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    text = repr(v)
    if text.endswith(".0"):
        text = text[:-2]
    if "e" in text:  # Go's strconv 'g'-like formatting for large/small exponents
        mantissa, exp = text.split("e")
        sign = "-" if exp.startswith("-") else "+"
        text = f"{mantissa}e{sign}{int(exp.lstrip('+-')):02d}"
    return text


def _to_string(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return _format_double(v)
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise _EvalError("invalid UTF-8 in bytes, cannot convert to string") from None
    if isinstance(v, (IP, CIDR)):
        return str(v)
    raise _NoOverload()


def _to_bool(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        if v in ("1", "t", "true", "TRUE", "True"):
            return True
        if v in ("0", "f", "false", "FALSE", "False"):
            return False
        raise _EvalError(f"type conversion error from 'string' to 'bool'")
    raise _NoOverload()


def _to_bytes(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    v = args[0]
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    raise _NoOverload()


def _type_of(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1)
    name = _type_name(args[0])
    return TypeValue({"quantity": "kubernetes.Quantity", "semver": "kubernetes.Semver"}.get(name, name))


def _re(pattern: str):
    try:
        return _compiled_re(pattern)
    except re.error as err:
        raise _EvalError(f"error parsing regexp: {err}") from None


@lru_cache(maxsize=256)
def _compiled_re(pattern: str):
    return re.compile(pattern)


def _matches(is_receiver, cost, *args):
    _need(len(args) == 2 and _s(args[0]) and _s(args[1]))
    _tick(cost, len(args[0]) // 10)
    return _re(args[1]).search(args[0]) is not None


def _find(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 2 and _s(args[0]) and _s(args[1]))
    m = _re(args[1]).search(args[0])
    return m.group(0) if m else ""


def _find_all(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (2, 3) and _s(args[0]) and _s(args[1]))
    limit = args[2] if len(args) == 3 else -1
    _need(_i(limit))
    found = [m.group(0) for m in _re(args[1]).finditer(args[0])]
    return found if limit < 0 else found[:limit]


def _split(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (2, 3) and _s(args[0]) and _s(args[1]))
    text, sep = args[0], args[1]
    limit = args[2] if len(args) == 3 else -1
    _need(_i(limit))
    _tick(cost, len(text) // 10)
    if limit == 0:
        return []
    if sep == "":
        chars = list(text)
        if limit > 0 and len(chars) > limit:
            chars = chars[:limit - 1] + ["".join(chars[limit - 1:])]
        return chars
    if limit == 1:
        return [text]
    return text.split(sep, limit - 1) if limit > 0 else text.split(sep)


def _char_at(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 2 and _s(args[0]) and _i(args[1]))
    text, i = args
    if not 0 <= i <= len(text):
        raise _EvalError(f"index out of range: {i}")
    return text[i:i + 1]


def _index_of(last: bool):
    def call(is_receiver, cost, *args):
        _need(is_receiver and len(args) in (2, 3))
        if isinstance(args[0], list):  # the lists library
            _need(len(args) == 2)
            indexes = [i for i, v in enumerate(args[0]) if equal(v, args[1])]
            return (indexes[-1] if last else indexes[0]) if indexes else -1
        _need(_s(args[0]) and _s(args[1]))
        text, sub = args[0], args[1]
        if len(args) == 3:
            _need(_i(args[2]))
            start = args[2]
            if not 0 <= start <= len(text):
                raise _EvalError(f"index out of range: {start}")
            return text.rfind(sub, 0, start + len(sub)) if last else text.find(sub, start)
        return text.rfind(sub) if last else text.find(sub)
    return call


def _substring(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (2, 3) and _s(args[0]) and all(_i(a) for a in args[1:]))
    text, start = args[0], args[1]
    end = args[2] if len(args) == 3 else len(text)
    if not 0 <= start <= len(text):
        raise _EvalError(f"index out of range: {start}")
    if not 0 <= end <= len(text):
        raise _EvalError(f"index out of range: {end}")
    if start > end:
        raise _EvalError(f"invalid substring range. start: {start}, end: {end}")
    return text[start:end]


def _replace(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (3, 4) and all(_s(a) for a in args[:3]))
    limit = args[3] if len(args) == 4 else -1
    _need(_i(limit))
    return args[0].replace(args[1], args[2], limit if limit >= 0 else -1)


def _join(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (1, 2) and isinstance(args[0], list))
    sep = args[1] if len(args) == 2 else ""
    _need(_s(sep))
    for item in args[0]:
        if not _s(item):
            raise _EvalError(f"join: list contains a non-string: {_type_name(item)}")
    return sep.join(args[0])


def _ascii_case(upper: bool):
    def call(is_receiver, cost, *args):
        _need(is_receiver and len(args) == 1 and _s(args[0]))
        return "".join((c.upper() if upper else c.lower()) if c.isascii() else c for c in args[0])
    return call


def _trim(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and _s(args[0]))
    return args[0].strip(" \t\n\v\f\r\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                         "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def _ip_call(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    return IP(args[0])


def _is_ip(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    try:
        IP(args[0])
    except ValueError:
        return False
    return True


def _ip_is_canonical(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    return str(IP(args[0])) == args[0]


def _ip_method(method: str):
    def call(is_receiver, cost, *args):
        _need(is_receiver and len(args) == 1 and isinstance(args[0], IP))
        a = args[0].address
        v4 = a.version == 4
        if method == "family":
            return a.version
        if method == "isUnspecified":
            return a.is_unspecified
        if method == "isLoopback":
            return a.is_loopback
        if method == "isLinkLocalMulticast":
            return a in (ipaddress.ip_network("224.0.0.0/24") if v4 else ipaddress.ip_network("ff02::/16"))
        if method == "isLinkLocalUnicast":
            return a in (ipaddress.ip_network("169.254.0.0/16") if v4 else ipaddress.ip_network("fe80::/10"))
        # isGlobalUnicast, as Go's net.IP: anything but the special addresses above
        return not (a.is_unspecified or a.is_loopback or a.is_multicast or
                    a in (ipaddress.ip_network("169.254.0.0/16") if v4 else ipaddress.ip_network("fe80::/10")) or
                    (v4 and a == ipaddress.ip_address("255.255.255.255")))
    return call


def _cidr_call(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    return CIDR(args[0])


def _is_cidr(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    try:
        CIDR(args[0])
    except ValueError:
        return False
    return True


def _cidr_method(method: str):
    def call(is_receiver, cost, *args):
        _need(is_receiver and isinstance(args[0], CIDR))
        network = args[0].interface.network
        if method in ("ip", "masked", "prefixLength"):
            _need(len(args) == 1)
            if method == "ip":
                return IP(str(args[0].interface.ip))
            if method == "prefixLength":
                return network.prefixlen
            return CIDR(str(network))
        _need(len(args) == 2)
        other = args[1]
        if method == "containsIP":
            _need(isinstance(other, (IP, str)))
            address = other.address if isinstance(other, IP) else IP(other).address
            return address.version == network.version and address in network
        _need(isinstance(other, (CIDR, str)))
        inner = (other if isinstance(other, CIDR) else CIDR(other)).interface.network
        return inner.version == network.version and inner.subnet_of(network)
    return call


def _quote(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    escapes = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
               "\v": "\\v", "\\": "\\\\", '"': '\\"'}
    return '"' + "".join(escapes.get(c, c) for c in args[0]) + '"'


def _reverse(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and isinstance(args[0], (str, list)))
    return args[0][::-1]


def _includes(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 2)
    container, value = args
    if isinstance(container, list):
        _tick(cost, len(container))
        return any(equal(v, value) for v in container)
    return equal(container, value)


def _comparable_list(values: list) -> list:
    for v in values:
        if isinstance(v, (Quantity, SemVer)):
            continue
        if not (_is_num(v) or _s(v) or isinstance(v, (bool, bytes))):
            raise _NoOverload()
    return values


def _key(v):
    if isinstance(v, Quantity):
        return v.value
    if isinstance(v, SemVer):
        return v.key
    return v


def _is_sorted(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and isinstance(args[0], list))
    values = _comparable_list(args[0])
    for a, b in zip(values, values[1:]):
        if _cmp_any(a, b) > 0:
            return False
    return True


def _cmp_any(a, b) -> int:
    if isinstance(a, (Quantity, SemVer)) or isinstance(b, (Quantity, SemVer)):
        return _compare(a, b)
    return _order(a, b, "<")


def _min_max(want: int):
    def call(is_receiver, cost, *args):
        _need(len(args) >= 1)
        values = args[0] if is_receiver and len(args) == 1 and isinstance(args[0], list) else list(args)
        _need(is_receiver or not isinstance(args[0], list))
        if not values:
            raise _EvalError(f"{'min' if want < 0 else 'max'}() requires at least one argument")
        _comparable_list(values)
        best = values[0]
        for v in values[1:]:
            if _cmp_any(v, best) == want:
                best = v
        return best
    return call


def _sum(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and isinstance(args[0], list))
    values = args[0]
    if not values:
        return 0
    total = values[0]
    for v in values[1:]:
        if isinstance(total, Quantity):
            total = _arith(total, v, 1)
        else:
            total = _arith_op("+", total, v)
    return total


def _slice(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 3 and isinstance(args[0], list) and _i(args[1]) and _i(args[2]))
    values, start, end = args
    if start < 0 or end < 0:
        raise _EvalError(f"cannot slice({start}, {end}), negative indexes not supported")
    if start > end:
        raise _EvalError(f"cannot slice({start}, {end}), start index must be less than or equal to end index")
    if end > len(values):
        raise _EvalError(f"cannot slice({start}, {end}), list is length {len(values)}")
    return values[start:end]


def _flatten(is_receiver, cost, *args):
    _need(is_receiver and len(args) in (1, 2) and isinstance(args[0], list))
    depth = args[1] if len(args) == 2 else 1
    _need(_i(depth))
    if depth < 0:
        raise _EvalError("level must be non-negative")

    def flat(values, level):
        out = []
        for v in values:
            if isinstance(v, list) and level > 0:
                out += flat(v, level - 1)
            else:
                out.append(v)
        return out
    return flat(args[0], depth)


def _distinct(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and isinstance(args[0], list))
    out: list = []
    for v in args[0]:
        if not any(equal(v, o) for o in out):
            out.append(v)
    return out


def _sort(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 1 and isinstance(args[0], list))
    values = _comparable_list(list(args[0]))
    kinds = {_type_name(v) for v in values}
    if len(kinds) > 1:
        raise _EvalError("list elements must have the same type")
    import functools
    return sorted(values, key=functools.cmp_to_key(_cmp_any))


def _first_last(index: int):
    def call(is_receiver, cost, *args):
        _need(is_receiver and len(args) == 1 and isinstance(args[0], list))
        return Optional(args[0][index], True) if args[0] else Optional()
    return call


def _lists_range(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _i(args[0]))
    _tick(cost, max(args[0], 0))
    return list(range(args[0]))


def _sets(kind: str):
    def call(is_receiver, cost, *args):
        _need(not is_receiver and len(args) == 2 and all(isinstance(a, list) for a in args))
        a, b = args
        _tick(cost, len(a) * max(len(b), 1))
        if kind == "contains":
            return all(any(equal(x, y) for y in a) for x in b)
        if kind == "intersects":
            return any(any(equal(x, y) for y in a) for x in b)
        return all(any(equal(x, y) for y in a) for x in b) and all(any(equal(x, y) for y in b) for x in a)
    return call


def _optional_value(method: str):
    def call(is_receiver, cost, *args):
        _need(is_receiver and isinstance(args[0], Optional))
        opt = args[0]
        if method == "hasValue":
            _need(len(args) == 1)
            return opt.present
        if method == "value":
            _need(len(args) == 1)
            if not opt.present:
                raise _EvalError("optional.none() dereference")
            return opt.value
        if method == "orValue":
            _need(len(args) == 2)
            return opt.value if opt.present else args[1]
        _need(len(args) == 2 and isinstance(args[1], Optional))  # or
        return opt if opt.present else args[1]
    return call


def _zero(v) -> bool:
    return v in (0, "", b"") and not isinstance(v, bool) or v is False or v is None or v == [] or v == {}


def _format_call(name: str):
    def call(is_receiver, cost, *args):
        _need(not is_receiver and not args)
        return Format(name)
    return call


def _format_named(is_receiver, cost, *args):
    _need(not is_receiver and len(args) == 1 and _s(args[0]))
    return Optional(Format(args[0]), True) if args[0] in _FORMATS else Optional()


def _validate(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 2 and isinstance(args[0], Format) and _s(args[1]))
    errors = _FORMATS[args[0].name](args[1])
    return Optional(errors, True) if errors else Optional()


def _py(name: str, arity: int, receiver: bool | None = None):
    """A quantity/semver function of _PY: TypeError for a wrong argument is no overload."""
    function = _PY[name]

    def call(is_receiver, cost, *args):
        _need(receiver is None or receiver == is_receiver)
        _need(len(args) in ((arity,) if isinstance(arity, int) else arity))
        try:
            return function(*args)
        except TypeError:
            raise _NoOverload() from None
    return call


def _string_method(py: Callable[[str, str], bool]):
    def call(is_receiver, cost, *args):
        _need(is_receiver and len(args) == 2 and _s(args[0]) and _s(args[1]))
        return py(args[0], args[1])
    return call


def _contains(is_receiver, cost, *args):
    _need(is_receiver and len(args) == 2 and _s(args[0]) and _s(args[1]))
    return args[1] in args[0]


_LIBRARY: dict[str, Callable] = {
    "size": _size, "int": _to_int, "uint": _to_uint, "double": _to_double, "string": _to_string,
    "bool": _to_bool, "bytes": _to_bytes, "type": _type_of,
    "contains": _contains,
    "startsWith": _string_method(str.startswith), "endsWith": _string_method(str.endswith),
    "matches": _matches, "find": _find, "findAll": _find_all,
    "split": _split, "charAt": _char_at, "indexOf": _index_of(False), "lastIndexOf": _index_of(True),
    "substring": _substring, "replace": _replace, "join": _join, "lowerAscii": _ascii_case(False),
    "upperAscii": _ascii_case(True), "trim": _trim, "reverse": _reverse, "strings.quote": _quote,
    "includes": _includes, "isSorted": _is_sorted, "min": _min_max(-1), "max": _min_max(1), "sum": _sum,
    "slice": _slice, "flatten": _flatten, "distinct": _distinct, "sort": _sort,
    "first": _first_last(0), "last": _first_last(-1), "lists.range": _lists_range,
    "sets.contains": _sets("contains"), "sets.intersects": _sets("intersects"),
    "sets.equivalent": _sets("equivalent"),
    "optional.of": lambda r, c, *a: (_need(not r and len(a) == 1), Optional(a[0], True))[1],
    "optional.none": lambda r, c, *a: (_need(not r and not a), Optional())[1],
    "optional.ofNonZeroValue": lambda r, c, *a: (_need(not r and len(a) == 1),
                                                 Optional() if _zero(a[0]) else Optional(a[0], True))[1],
    "hasValue": _optional_value("hasValue"), "value": _optional_value("value"),
    "orValue": _optional_value("orValue"), "or": _optional_value("or"),
    "format.named": _format_named, "validate": _validate,
    "quantity": _py("quantity", 1, False), "isQuantity": _py("isQuantity", 1, False),
    "semver": _py("semver", (1, 2), False), "isSemver": _py("isSemver", (1, 2), False),
    "compareTo": _py("compareTo", 2, True), "isGreaterThan": _py("isGreaterThan", 2, True),
    "isLessThan": _py("isLessThan", 2, True), "asInteger": _py("asInteger", 1, True),
    "asApproximateFloat": _py("asApproximateFloat", 1, True), "isInteger": _py("isInteger", 1, True),
    "sign": _py("sign", 1, True), "add": _py("add", 2, True), "sub": _py("sub", 2, True),
    "major": _py("major", 1, True), "minor": _py("minor", 1, True), "patch": _py("patch", 1, True),
}
_LIBRARY.update({f"format.{name}": _format_call(name) for name in _FORMATS})
_LIBRARY.update({"ip": _overloads(_ip_call, _cidr_method("ip")), "isIP": _is_ip, "ip.isCanonical": _ip_is_canonical, "cidr": _cidr_call,
                 "isCIDR": _is_cidr})
_LIBRARY.update({m: _ip_method(m) for m in ("family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
                                           "isLinkLocalUnicast", "isGlobalUnicast")})
_LIBRARY.update({m: _cidr_method(m) for m in ("containsIP", "containsCIDR", "masked", "prefixLength")})


# -- entry points -----------------------------------------------------------------------------------------
_PARSER = None


def _parse(expression: str):
    global _PARSER
    if _PARSER is None:
        _PARSER = celpy.Environment()
    return _PARSER.compile(expression)


@lru_cache(maxsize=1024)
def _program(expression: str, variables: tuple[tuple[str, str], ...] = (("device", "map"),)) -> _Node:
    try:
        tree = _parse(expression)
    except celpy.CELParseError as err:
        raise CelError(expression, _syntax_error(expression, err)) from None
    except Exception as err:  # noqa: BLE001 - a parser bug must not crash explain
        raise CelError(expression, f"does not compile: {err}") from None
    try:
        return _Compiler(dict(variables)).compile(tree)
    except _CompileError as err:
        raise CelError(expression, f"compilation failed: {err}") from None
    except RecursionError:
        raise CelError(expression, "compilation failed: expression too deeply nested") from None


def _syntax_error(expression: str, err) -> str:
    """cel-go's layout (what the API server prints): the position, then the line with a
    caret under it, so that a user sees where; celpy knows the position, not the words
    ANTLR would have used for what it expected."""
    line, column = getattr(err, "line", None), getattr(err, "column", None)
    if not isinstance(line, int) or not isinstance(column, int):
        return f"compilation failed: ERROR: <input>: Syntax error: {' '.join(str(err).split())}"
    lines = expression.split("\n")
    text = lines[line - 1] if 0 < line <= len(lines) else expression
    return (f"compilation failed: ERROR: <input>:{line}:{column + 1}: Syntax error: unexpected input\n"
            f" | {text}\n | {'.' * column}^")


def check_selector(expression: str) -> None:
    """What the API server checks of a selector when a claim or class is written: that it
    compiles and returns a bool; CelError otherwise. Devices are not looked at."""
    program = _program(expression)
    if program.type not in (DYN, "bool"):
        raise CelError(expression, f"must return a bool (compilation failed: must evaluate to bool or "
                                   f"the unknown type, not {program.type})")


def evaluate_value(expression: str, variables: dict | None = None, cost_limit: int | None = None):
    """The expression's value (for tests and conformance checks); CelError on any error."""
    variables = variables or {}
    program = _program(expression, tuple(sorted((k, "map" if k == "device" else DYN) for k in variables)))
    cost = [0 if cost_limit is None else COST_LIMIT - cost_limit]
    try:
        return program.run(variables, cost)
    except _EvalError as err:
        raise CelError(expression, str(err)) from None
    except _CostExceeded:
        raise CelError(expression, COST_LIMIT_MESSAGE) from None
    except RecursionError:
        raise CelError(expression, "expression too deeply nested") from None
    except Exception as err:  # noqa: BLE001 - never crash the caller: report it as CEL would
        raise CelError(expression, f"{type(err).__name__}: {err}") from None


def evaluate(expression: str, variables: dict) -> bool:
    """The selector's verdict; CelError when Kubernetes would report a CEL error."""
    check_selector(expression)
    result = evaluate_value(expression, variables)
    if not isinstance(result, bool):
        raise CelError(expression, f"must return a bool, returned {_type_name(result)} "
                                   f"(CEL result of type {_type_name(result)} could not be converted to bool)")
    return result


def _cel_value(value: Any):
    if isinstance(value, (SemVer, Quantity)):
        return value
    if isinstance(value, Version):
        return SemVer(value.value)
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_cel_value(v) for v in value]
    return str(value)


def activation(driver: str, attributes: Mapping[str, Mapping[str, Any]],
               capacity: Mapping[str, Mapping[str, str]], allow_multiple: bool = False) -> dict:
    """The `device` variable: attributes and capacity by domain (values: str, int, bool,
    Version or SemVer, or lists of them; capacity quantities as strings)."""
    return {"device": {
        "driver": str(driver),
        "allowMultipleAllocations": bool(allow_multiple),
        "attributes": Domains({str(d): {str(k): _cel_value(v) for k, v in attrs.items()}
                               for d, attrs in attributes.items()}),
        "capacity": Domains({str(d): {str(k): Quantity(v) for k, v in caps.items()}
                             for d, caps in capacity.items()}),
    }}


def by_domain(items: Mapping[str, Any], driver: str) -> dict[str, dict[str, Any]]:
    """`name` -> driver's domain, `domain/name` -> that domain."""
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in items.items():
        domain, _, name = key.rpartition("/")
        grouped.setdefault(domain or driver, {})[name] = value
    return grouped


def references(expression: str) -> list[tuple[str, str, str]]:
    """(attributes|capacity, domain, name) that the expression reads, in order, once each."""
    seen: list[tuple[str, str, str]] = []
    for kind, domain, dotted, indexed in _REFERENCE.findall(expression):
        ref = (kind, domain, dotted or indexed)
        if ref not in seen:
            seen.append(ref)
    return seen


def device_activation(device: Device, driver: str, allow_multiple: bool = False) -> dict:
    return activation(driver, by_domain(device.attributes, driver), {driver: dict(device.capacity)},
                      allow_multiple)


def matches(expression: str, device: Device, driver: str, allow_multiple: bool = False) -> bool:
    """True when the selector accepts the device; CelError as the scheduler would fail."""
    return evaluate(expression, device_activation(device, driver, allow_multiple))
