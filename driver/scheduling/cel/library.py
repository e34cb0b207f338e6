"""The function library a selector can call, dispatched on its runtime arguments as cel-go
dispatches overloads (no overload is an error value, never a Python exception): conversions,
the strings extension, regex, the Kubernetes lists, sets, optional, IP/CIDR, format and
quantity/semver functions, `includes` and `isSorted`. `_LIBRARY` maps a name to its overloads."""

from __future__ import annotations

import ipaddress
import math
import re
from functools import lru_cache
from typing import Any, Callable

from driver.scheduling.cel.cost import _tick
from driver.scheduling.cel.errors import _EvalError
from driver.scheduling.cel.evaluator import _arith_op, _is_num, _order, equal
from driver.scheduling.cel.kubernetes import _arith, _compare, _FORMATS, _PY
from driver.scheduling.cel.values import (
    _type_name, CIDR, Format, INT_MAX, INT_MIN, IP, Optional, Quantity, SemVer, TypeValue, UInt, UINT_MAX)

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
