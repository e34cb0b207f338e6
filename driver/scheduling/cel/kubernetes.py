"""The Kubernetes CEL libraries on plain Python values: quantity and semver functions (`_PY`,
also wrapped for cel-python as `FUNCTIONS`, which the tests' admission policy check uses) and
the format library's named formats with the API server's validation messages."""

from __future__ import annotations

import base64
import datetime as _dt
import re
from decimal import Decimal, localcontext
from typing import Callable
from urllib.parse import urlparse

from celpy import celtypes

from driver.scheduling.cel.values import _type_name, INT_MAX, INT_MIN, Quantity, SemVer

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
