"""Name and value rules of the Kubernetes API and CDI, checked in one place.

The API server rejects a whole ResourceSlice write when one name or value breaks a rule, so
every name we generate goes through these checks before it leaves the process.
"""

from __future__ import annotations

import re

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
ATTRIBUTE_VALUE_MAX = 64
ATTRIBUTE_ID_MAX = 32

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver 2.0.0, as the API server checks version attributes: no leading "v", no leading
# zeros in numeric identifiers.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_CDI_VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CDI_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def is_dns_label(value: str) -> bool:
    return len(value) <= DNS_LABEL_MAX and bool(_DNS_LABEL.match(value))


def is_dns_subdomain(value: str) -> bool:
    if not value or len(value) > DNS_SUBDOMAIN_MAX:
        return False
    return all(is_dns_label(part) for part in value.split("."))


def is_qualified_name(value: str) -> bool:
    """An attribute or capacity name: C identifier ≤ 32 chars, optionally `<domain>/`."""
    domain, sep, ident = value.rpartition("/")
    if sep and not (is_dns_subdomain(domain) and len(domain) <= DNS_LABEL_MAX):
        return False
    return len(ident) <= ATTRIBUTE_ID_MAX and bool(_C_IDENTIFIER.match(ident))


def is_semver(value: str) -> bool:
    return bool(_SEMVER.match(value))


def is_cdi_vendor_or_class(value: str) -> bool:
    return bool(_CDI_VENDOR_CLASS.match(value))


def is_cdi_device_name(value: str) -> bool:
    return bool(_CDI_DEVICE.match(value))


def label_from_pci(prefix: str, bdf: str) -> str:
    """`gpu`, `0000:17:00.0` -> `gpu-0000-17-00-0`: stable across reboots and enumeration
    order because the PCI address is where the card sits, not when it was found."""
    name = f"{prefix}-{bdf.lower().replace(':', '-').replace('.', '-')}"
    if not is_dns_label(name):
        raise ValueError(f"cannot build a DNS label from {prefix!r} and PCI address {bdf!r}")
    return name


def normalize_semver(raw: str) -> str | None:
    """Turn a vendor version string into semver, or None when it cannot be done honestly.

    NVIDIA driver versions such as `535.104.05` carry leading zeros that semver forbids; a
    two-part version such as `12.4` gets a `.0` patch.  Anything else is refused rather than
    guessed at.
    """
    parts = raw.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    while len(parts) < 3:
        parts.append("0")
    value = ".".join(str(int(p)) for p in parts)
    return value if is_semver(value) else None
