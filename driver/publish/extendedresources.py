"""Extended resources served by this driver (KEP-5004): a node must not serve one twice.

A DeviceClass with `spec.extendedResourceName: nvidia.com/gpu` makes the scheduler serve
pods that ask for `nvidia.com/gpu: 1` from this driver's devices, but only on nodes whose
`status.allocatable` does not have the name (kube-scheduler 1.37 gives such a request to
the device plugin wherever the node advertises it). If a device plugin on the node still
advertises it, the same GPUs are handed out twice: by the device plugin to those pods, and
by the scheduler, as our published devices, to ResourceClaims. During a move from the
device plugin that is a transition state an operator must see, so the driver looks at
start (and `dra-driver status` shows what it found, from `<state>/extended-resources.json`)
and says which names are served twice.

The names come from the chart (`--extended-resource-names`, the values the chart put on
the DeviceClasses); the implicit `deviceclass.resource.kubernetes.io/<class>` names need
no setting and no device plugin advertises them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from driver.state import atomic

from driver.kube import quantity
STATE_FILE = "extended-resources.json"


@dataclass(frozen=True)
class ServedTwice:
    name: str  # the extended resource name
    allocatable: str  # what the node advertises for it besides our devices

    def message(self, node: str) -> str:
        return (f"node {node} also advertises {self.name} (allocatable {self.allocatable}), "
                "most likely from a device plugin: pods asking for it get the plugin's devices "
                "here while ResourceClaims can be given the same devices through this driver; "
                "remove the device plugin from this node (docs/migrating-from-device-plugin.md)")


def served_twice(node: dict, names: Iterable[str]) -> list[ServedTwice]:
    """Our extended resource names that the node's status also advertises (non-zero)."""
    allocatable = ((node.get("status") or {}).get("allocatable") or {})
    found = []
    for name in sorted(set(names)):
        value = allocatable.get(name)
        if value is None:
            continue
        try:
            if quantity.value(str(value)) <= 0:
                continue
        except quantity.QuantityError:
            pass  # not a quantity: the name is there, which is what matters
        found.append(ServedTwice(name, str(value)))
    return found


def record(state_dir: Path, owner: str, found: list[ServedTwice]) -> None:
    atomic.write(state_dir / STATE_FILE, json.dumps([asdict(f) for f in found]).encode(),
                 owner=owner, durable=False)


def recorded(state_dir: Path) -> list[ServedTwice]:
    """What the running driver found at its start; nothing when it never looked."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
        return [ServedTwice(str(d["name"]), str(d["allocatable"])) for d in data]
    except (OSError, ValueError, KeyError, TypeError):
        return []
