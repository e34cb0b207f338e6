"""`explain` output: a report for people (colour on a terminal) and JSON for tools.

The table lists, per node and request, every device with the first reason it is out;
devices with the same verdict and the same values seen share a line. Devices ruled out by
the DeviceClass itself (another kind, another driver) are the bulk on most nodes and tell
nothing about the claim: the table counts them on one line. JSON lists every device.
"""

from __future__ import annotations

import dataclasses
import json

from driver.explain import engine

_COLOURS = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}


@dataclasses.dataclass(frozen=True)
class Style:
    colour: bool = False

    def __call__(self, text: str, colour: str) -> str:
        return f"\033[{_COLOURS[colour]}m{text}\033[0m" if self.colour else text


def as_json(explanations: list[engine.Explanation]) -> str:
    out = []
    for e in explanations:
        body = dataclasses.asdict(e)
        body["fits"] = e.fits
        out.append(body)
    return json.dumps({"claims": out}, indent=2) + "\n"


def table(explanations: list[engine.Explanation], style: Style = Style()) -> str:
    lines: list[str] = []
    for e in explanations:
        lines += _claim(e, style)
        lines.append("")
    return "\n".join(lines)


def _claim(e: engine.Explanation, style: Style) -> list[str]:
    fit_nodes = [n.node for n in e.nodes if n.fits]
    verdict = (style(f"fits on {len(fit_nodes)} of {len(e.nodes)} node(s)", "green") if fit_nodes
               else style(f"fits on none of {len(e.nodes)} node(s)", "red"))
    lines = [style(f"Claim {e.claim}", "bold") + (f" ({e.source})" if e.source else "") + f": {verdict}"]
    if e.release:
        lines.append("  " + style(e.release, "yellow"))
    if not e.nodes:
        lines.append("  no node publishes devices (no ResourceSlices with a nodeName)")
    if e.scheduled is not None:
        lines += _scheduled(e.scheduled)
    shown_requests: set[str] = set()
    for node in e.nodes:
        lines.append("")
        mark = style("fits", "green") if node.fits else style("does not fit", "red")
        lines.append(f"Node {style(node.node, 'bold')}: {mark}" + ("" if node.fits else f": {node.why}"))
        if node.fits:
            lines.append("  would get: " + ", ".join(
                f"{a['request']} -> {a['device']}" + _consumed(a) for a in node.allocation))
        for alt in node.alternatives:
            if alt.request not in shown_requests:
                shown_requests.add(alt.request)
                lines += _request_header(alt, style)
            lines += _devices(alt, style)
        for text in node.constraints:
            lines.append(f"  {style('constraint', 'yellow')}: {text}")
    if e.suggestions:
        lines.append("")
        lines.append(style("Suggestions:", "yellow"))
        lines += [f"  - {s}" for s in e.suggestions]
    if e.notes:
        lines.append("")
        lines += [f"Note: {n}" for n in e.notes]
    return lines


def _scheduled(scheduled: dict) -> list[str]:
    if not scheduled["requests"]:
        return ["  the scheduler makes no claim: no DeviceClass serves these resources"]
    lines = ["  the scheduler's requests:"]
    for r in scheduled["requests"]:
        users = ", ".join(f"container {m['containerName']} ({m['resourceName']})"
                          for m in scheduled["mappings"] if m["requestName"] == r["name"])
        lines.append(f"    {r['name']}: {r['exactly']['count']} x {r['exactly']['deviceClassName']}"
                     + (f" for {users}" if users else ""))
    return lines


def _consumed(allocation: dict) -> str:
    consumed = allocation.get("consumedCapacity")
    return f" ({', '.join(f'{k} {v}' for k, v in consumed.items())})" if consumed else ""


def _request_header(alt: engine.AlternativeReport, style: Style) -> list[str]:
    count = "all matching" if alt.count is None else str(alt.count)
    lines = [f"  request {style(alt.request, 'bold')}: {count} x DeviceClass {alt.device_class}"]
    for s in alt.selectors:
        where = "class" if s["from"].startswith("class") else "request"
        lines.append(f"    {where} selector #{s['index']}: {' '.join(s['expression'].split())}")
    return lines


def _devices(alt: engine.AlternativeReport, style: Style) -> list[str]:
    other = [d for d in alt.devices if d.code == engine.CLASS and d.expression is not None]
    rows = [d for d in alt.devices if d not in other]
    lines = [f"  {alt.request}: {len(alt.fitting)} of {len(rows)} device(s) of the class fit"]
    # Devices with the same verdict and the same values seen (eight identical GPUs) are one line.
    groups: dict[tuple, list[engine.DeviceVerdict]] = {}
    for d in rows:
        groups.setdefault((d.driver, d.code, d.reason, tuple(d.seen.items())), []).append(d)
    width = max((len(g[0].device) for g in groups.values()), default=0)
    for (driver, code, reason, seen), group in groups.items():
        colour = "green" if code == engine.FITS else "red"
        what = f"  [{', '.join(f'{k}={v}' for k, v in seen)}]" if seen else ""
        lines.append(f"    {group[0].device.ljust(width)}  {driver:<16} {style(reason, colour)}{what}")
        if len(group) > 1:
            more = ", ".join(d.device for d in group[1:4]) + (", …" if len(group) > 4 else "")
            lines.append(f"    {'':{width}}  {'':<16} {style(f'and {len(group) - 1} more alike: {more}', 'dim')}")
    if other:
        names = ", ".join(d.device for d in other[:4]) + (", …" if len(other) > 4 else "")
        lines.append(style(f"    {len(other)} other device(s) not in class {alt.device_class} ({names})", "dim"))
    return lines
