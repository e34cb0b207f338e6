"""The `device` variable a selector sees: attributes and capacity grouped by domain (an
unqualified name lives under the driver's own domain), `matches` for a model Device, and
`references`, the attributes and capacities an expression reads (for explain's messages)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from driver.devices.model import Device, Version
from driver.scheduling.cel.program import evaluate
from driver.scheduling.cel.values import Domains, Quantity, SemVer

STANDARD_DOMAIN = "resource.kubernetes.io"


# device.attributes["d"].name / ["d"]["name"], device.capacity["d"].name: what a selector reads.
_REFERENCE = re.compile(r'device\.(attributes|capacity)\["([^"]+)"\](?:\.([A-Za-z_][A-Za-z0-9_]*)'
                        r'|\["([^"]+)"\])')


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
