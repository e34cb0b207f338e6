"""`dra-driver capacity` output: a table for people, JSON or YAML for tools (the same fields)."""

from __future__ import annotations

import json

import yaml

from driver.explain.capacity import Capacity


def as_data(result: Capacity) -> dict:
    return {
        "nodes": [{"node": node.node, "findings": [{
            "kind": f.kind, "request": f.label, "deviceClass": f.device_class,
            "largest": f.largest, "next": f.next_size, "unit": f.unit, "devices": f.devices,
            "claims": f.request, "nextClaims": f.next_request,
            **({"perDevice": f.parts} if f.parts else {})} for f in node.findings]}
            for node in result.nodes],
        "cluster": [{"kind": line.kind, "request": line.label, "largest": line.largest, "unit": line.unit,
                     "nodes": line.nodes, "free": line.free, "unusable": line.unusable}
                    for line in result.cluster],
        "notes": result.notes,
    }


def as_json(result: Capacity) -> str:
    return json.dumps(as_data(result), indent=2) + "\n"


def as_yaml(result: Capacity) -> str:
    return yaml.safe_dump(as_data(result), sort_keys=False)


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _where(nodes: list[str]) -> str:
    if not nodes:
        return "nowhere"
    return ", ".join(nodes[:3]) + (f" (+{len(nodes) - 3})" if len(nodes) > 3 else "")


def table(result: Capacity) -> str:
    """Per node, each kind with the largest request that fits and the next size up, which
    does not; then the cluster: the largest anywhere and the free capacity it cannot use."""
    rows = [["NODE", "KIND", "REQUEST", "LARGEST", "NEXT (does not fit)"]]
    for node in result.nodes:
        for f in node.findings:
            rows.append([node.node, f.kind, f.label, f.text(), f.text(f.next_size) if f.next_size is not None
                         else "(none larger)"])
    lines = _columns(rows) if len(rows) > 1 else ["no node publishes devices of the chart's classes"]
    if result.cluster:
        lines += ["", "CLUSTER"]
        rows = [["KIND", "REQUEST", "LARGEST", "WHERE", "FREE", "FREE BUT NOT IN IT"]]
        for line in result.cluster:
            largest = "-" if line.largest is None else f"{line.largest}{line.unit}"
            rows.append([line.kind, line.label, largest, _where(line.nodes), line.free, line.unusable])
        lines += _columns(rows)
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
