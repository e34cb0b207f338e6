"""`dra-driver discover` output: a table for people, slices as YAML/JSON for machines."""

from __future__ import annotations

import json
from typing import Iterable

import yaml

from driver.devices.model import PCIE_ROOT, Device, Inventory


def table(inventory: Inventory, excluded: Iterable[tuple[str, str]] = (),
          skipped: Iterable[tuple[str, str]] = ()) -> str:
    """`excluded`: (interface, reason) left out on purpose; `skipped`: (device, reason) that
    could not be published (a GPU that fell off the bus, an unreadable card)."""
    header = ("NAME", "KIND", "MODEL", "MEMORY", "PCI", "PCIEROOT", "NUMA", "INTERFACE")
    rows = [header] + [_row(d) for d in inventory.devices]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if not inventory.devices:
        lines.append("(no devices found)")
    for ifname, reason in excluded:
        lines.append(f"not published: interface {ifname}: {reason}")
    for device, reason in skipped:
        lines.append(f"not published: {device}: {reason}")
    return "\n".join(lines) + "\n"


def _row(device: Device) -> tuple[str, ...]:
    pci = device.pci
    numa = pci.numa_node if pci and pci.numa_node is not None else None
    return (
        device.name,
        device.kind.value,
        device.model or "-",
        device.capacity.get("memory", "-"),
        pci.bus_id if pci else "-",
        str(device.attributes.get(PCIE_ROOT, "-")),
        "-" if numa is None else str(numa),
        device.net_interface or "-",
    )


def as_json(slices: Iterable[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(slices)}, indent=2) + "\n"


def as_yaml(slices: Iterable[dict]) -> str:
    # One document per slice, so that `kubectl apply -f` and `kubectl create -f` take it.
    return yaml.safe_dump_all(list(slices), sort_keys=False, explicit_start=True)
