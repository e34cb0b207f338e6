"""CEL's runtime values as cel-go and the Kubernetes libraries define them: `uint`, `quantity`,
`semver` (no `<`, only compareTo), optionals, `format`, the IP and CIDR library's values, type
values, the device's attribute/capacity domains, and the type names (`_type_name`) that every
error message spells."""

from __future__ import annotations

import ipaddress
from decimal import Decimal, localcontext
from typing import Any

from celpy import celtypes

from driver.kube import names
from driver.kube import quantity as quantities
from driver.scheduling.cel.errors import _EvalError

INT_MIN, INT_MAX, UINT_MAX = -(2**63), 2**63 - 1, 2**64 - 1


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
