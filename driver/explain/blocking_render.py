"""`explain --blocking` output: per node, the claims to remove (with their devices and
pods) for people; the same as data for `-o json` / `-o yaml`."""

from __future__ import annotations

import dataclasses
import json

import yaml

from driver.explain.blocking import Blocking, NodeBlocking
from driver.explain.render import Style


def as_data(answers: list[Blocking]) -> dict:
    out = []
    for answer in answers:
        body = dataclasses.asdict(answer)
        body["fits"] = answer.fits
        for node, raw in zip(answer.nodes, body["nodes"]):
            raw["size"] = node.size
        out.append(body)
    return {"blocking": out}


def as_json(answers: list[Blocking]) -> str:
    return json.dumps(as_data(answers), indent=2) + "\n"


def as_yaml(answers: list[Blocking]) -> str:
    return yaml.safe_dump(as_data(answers), sort_keys=False, width=1000)


def table(answers: list[Blocking], style: Style = Style()) -> str:
    lines: list[str] = []
    for answer in answers:
        lines += _answer(answer, style)
        lines.append("")
    return "\n".join(lines)


def _answer(answer: Blocking, style: Style) -> list[str]:
    fitting = [n.node for n in answer.nodes if n.fits]
    helped = [n for n in answer.nodes if n.helps and not n.fits]
    if fitting:
        verdict = style(f"fits already on {len(fitting)} of {len(answer.nodes)} node(s): nothing blocks it", "green")
    elif helped:
        verdict = style(f"fits on none of {len(answer.nodes)} node(s); removing claims lets it fit on "
                        f"{len(helped)} of them", "yellow")
    else:
        verdict = style(f"fits on none of {len(answer.nodes)} node(s), and no removal can help", "red")
    lines = [style(f"Request {answer.request}", "bold") + (f" ({answer.source})" if answer.source else "")
             + f": {verdict}"]
    if not answer.nodes:
        lines.append("  no node publishes devices (no ResourceSlices with a nodeName)")
    for node in answer.nodes:
        lines += _node(node, style)
    if answer.notes:
        lines.append("")
        lines += [f"Note: {n}" for n in answer.notes]
    return lines


def _node(node: NodeBlocking, style: Style) -> list[str]:
    name = style(node.node, "bold")
    if node.fits:
        return ["", f"Node {name}: {style('fits as it is', 'green')}: " + _gets(node)]
    if not node.helps:
        return ["", f"Node {name}: {style('no removal can help', 'red')}: {node.why}"]
    exact = "the smallest set" if node.smallest else "a minimal set"
    lines = ["", f"Node {name}: remove {node.size} claim(s) ({exact}; {node.searched})",
             f"  now: {node.why}"]
    width = max(len(h.claim) for h in node.claims)
    for held in node.claims:
        pods = f"; pods {', '.join(held.pods)}" if held.pods else "; no pod reserves it"
        lines.append(f"  {style('remove', 'yellow')} {held.claim.ljust(width)}  holds {', '.join(held.devices)}{pods}")
    lines.append("  then it gets: " + _gets(node))
    return lines


def _gets(node: NodeBlocking) -> str:
    """"gpu: gpu-0, gpu-1; nic: nic-0": the devices per request (per claim of a pod)."""
    by_request: dict[str, list[str]] = {}
    for a in node.allocation:
        label = (f"{a['claim']} " if "claim" in a else "") + a["request"]
        by_request.setdefault(label, []).append(
            a["device"] + (f" ({', '.join(f'{k} {v}' for k, v in a['consumedCapacity'].items())})"
                           if a.get("consumedCapacity") else ""))
    return "; ".join(f"{label}: {', '.join(devices)}" for label, devices in by_request.items())
