"""Quantities as the Kubernetes API server stores them (resource.Quantity's canonical form).

The server parses every quantity and writes it back canonically: `40960Mi` -> `40Gi`,
`1000` -> `1k`, `0.5Gi` -> `512Mi`, `1.5k` -> `1500`, `100m` stays. A client that sent the
other spelling and compares strings sees a difference on every read. The emulator stores
canonical strings so that tests catch such clients.

Rules (k8s.io/apimachinery/pkg/api/resource): the format follows the suffix that was
parsed (binary Ki..Ei, decimal n..E or none, or an exponent e<N>); a binary quantity that
is below 1024 in magnitude or not a whole number is written in decimal form. Values are
rounded up to nano units.

The driver uses the same parser for sizes in user config and allocation results
(`value()`), so that `20Gi`, `20480Mi` and `21474836480` are one size everywhere.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_SUFFIX_BY_EXPONENT = {e: s for s, e in _DECIMAL.items()}
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE])?$")


class QuantityError(ValueError):
    pass


def parse(text: str) -> tuple[Decimal, str]:
    """(value, format) with format one of "BinarySI", "DecimalSI", "DecimalExponent"."""
    match = _QUANTITY.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise QuantityError(f"quantities must match the regular expression "
                            f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {text!r}")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
    except InvalidOperation as err:
        raise QuantityError(f"invalid quantity {text!r}") from err
    if suffix in _BINARY:
        return value * (1 << _BINARY[suffix]), "BinarySI"
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return value.scaleb(int(suffix[1:])), "DecimalExponent"
    return value.scaleb(_DECIMAL[suffix]), "DecimalSI"


def canonical(text: str) -> str:
    with localcontext() as context:
        context.prec = 80  # exact for every quantity the server accepts
        return _canonical(text)


def _canonical(text: str) -> str:
    value, fmt = parse(text)
    # Round up to nano units, as the server does.
    value = value.quantize(Decimal("1e-9"), rounding=ROUND_CEILING)
    if fmt == "BinarySI" and (abs(value) < 1024 or value != value.to_integral_value()):
        fmt = "DecimalSI"
    if value == 0:
        return "0"
    if fmt == "BinarySI":
        number = int(value)
        shift = 0
        while shift < 60 and number % (1 << (shift + 10)) == 0:
            shift += 10
        suffix = next((s for s, e in _BINARY.items() if e == shift), "")
        return f"{number >> shift}{suffix}"
    # Decimal: the largest exponent (a multiple of 3, -9..18) that leaves a whole mantissa.
    exponent = -9
    while exponent < 18 and (value.scaleb(-(exponent + 3))) == value.scaleb(-(exponent + 3)).to_integral_value():
        exponent += 3
    mantissa = int(value.scaleb(-exponent))
    if fmt == "DecimalExponent":
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{_SUFFIX_BY_EXPONENT[exponent]}"


def value(text: str) -> Decimal:
    """The number a quantity stands for (`1Gi` -> 1073741824, `100m` -> 0.1)."""
    return parse(text)[0]
