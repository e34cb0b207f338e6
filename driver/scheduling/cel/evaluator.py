"""How a compiled program's operators behave at runtime, with cel-go's semantics rather than
cel-python's: heterogeneous equality, ordering across int, uint and double, map lookups in one
numeric key space (an unknown device domain is an empty map), and arithmetic with its overflow
and division errors."""

from __future__ import annotations

import math

from driver.scheduling.cel.cost import _tick
from driver.scheduling.cel.errors import _EvalError
from driver.scheduling.cel.values import (
    _no_overload, _type_name, Domains, Format, INT_MAX, INT_MIN, Optional, Quantity, SemVer, UInt,
    UINT_MAX)

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
