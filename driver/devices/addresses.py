"""The IP addresses of a host interface, in CIDR form, from /proc (no netlink library):

- IPv4: the kernel lists every local address in net/fib_trie (`|-- 10.1.2.3` followed by
  `/32 host LOCAL`); the interface and prefix length come from the net/route entry of the
  subnet that contains it.
- IPv6: net/if_inet6 has address, prefix length, scope and interface per line; only
  global-scope addresses are reported (link-local ones are not reachable across nodes).

Read from the host's network namespace (PID 1's), like the routing table.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from pathlib import Path

from driver.devices import pci
from driver.devices.net import route_table


def _route_ipv4(hex_le: str) -> int:
    return struct.unpack(">I", socket.inet_aton(socket.inet_ntoa(struct.pack("<I", int(hex_le, 16)))))[0]


def _local_ipv4(text: str) -> list[int]:
    found: list[int] = []
    last: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|-- "):
            last = stripped[4:].strip()
        elif last is not None and stripped.startswith("/32 host LOCAL"):
            value = int(ipaddress.IPv4Address(last))
            if value not in found:
                found.append(value)
    return found


def interface_addresses(proc: Path, ifname: str) -> list[str]:
    """`["10.100.0.2/24", "fd00::2/64"]`; empty when the interface has none or /proc
    does not say."""
    out: list[str] = []
    routes = []
    for line in (pci.read_text(route_table(proc, "route")) or "").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[0] == ifname and fields[7] != "00000000":
            try:
                routes.append((_route_ipv4(fields[1]), _route_ipv4(fields[7])))
            except (ValueError, struct.error, OSError):
                continue
    for address in _local_ipv4(pci.read_text(route_table(proc, "fib_trie")) or ""):
        matching = [mask for dest, mask in routes if address & mask == dest]
        if matching:
            prefix = bin(max(matching)).count("1")  # the most specific subnet
            out.append(f"{ipaddress.IPv4Address(address)}/{prefix}")
    for line in (pci.read_text(route_table(proc, "if_inet6")) or "").splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == ifname and int(fields[3], 16) == 0:
            try:
                address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            except ValueError:
                continue
            out.append(f"{address}/{int(fields[2], 16)}")
    return out
