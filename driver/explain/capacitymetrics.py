"""Fragmentation gauges from the driver's side (issue 41, item 4): per node, from the
devices the node publishes and the claims the driver has prepared on them, what the
largest request of each kind that still fits is (driver/explain/capacity.py, explain's
allocation model):

- `dra_driver_capacity_free_devices{kind, request}`: the largest count that fits, per
  kind (`gpu`, `gpu-aligned`, `gpu-nic`, `mig` per profile, `fpga` per shell);
- `dra_driver_capacity_largest_mig_slices`: the compute slices of the largest MIG profile
  that can be placed (7 for a 7g; 0: none);
- `dra_driver_capacity_largest_share{model, capacity}`: the largest share of one GPU of
  that model (consumable capacity), in the capacity's unit (bytes for memory).

The answer is computed at a scrape when what the node publishes or holds changed since
the last one, else the last answer is served. Devices the node publishes with a health
taint are not free: the scheduler allocates them to no claim that does not tolerate it.

The collector lives in explain (it runs explain's model) and the service only registers it:
the CLI, which may import both, hands the service this class as a factory (`dra-driver
run`, driver/cli.py), so that imports keep running down the layers (tests/test_layers.py).
The model evaluates CEL with cel-python, a runtime dependency (requirements.lock): where it
cannot be imported, the driver says so once in its log and exports no series.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from driver import logs
from driver.kube import quantity as quantities

Taints = Mapping[str, Sequence[dict]]  # device name -> the taints its slice entry carries

PREFIX = "dra_driver_capacity"
COUNT_KINDS = ("gpu", "gpu-aligned", "gpu-nic", "mig", "fpga")


def claim_objects(records: Iterable, driver: str) -> list[dict]:
    """The prepared claims as allocated ResourceClaims (what they hold on this node's pools)."""
    out = []
    for record in records:
        results = []
        for device in record.devices:
            if device.admin_access:
                continue  # an admin-access result blocks no other claim
            result = {"request": device.request, "driver": driver, "pool": device.pool, "device": device.device}
            if device.share_id:
                result["shareID"] = device.share_id
                result["consumedCapacity"] = dict(device.consumed)
            results.append(result)
        if results:
            out.append({"kind": "ResourceClaim",
                        "metadata": {"name": record.name, "namespace": record.namespace, "uid": record.uid},
                        "spec": {"devices": {"requests": []}},
                        "status": {"allocation": {"devices": {"results": results}}}})
    return out


class CapacityCollector(Collector):
    """`objects(taints)`: the node's ResourceSlices, its devices carrying these taints, and
    the chart's DeviceClasses; `records()`: the prepared claims (checkpoint records);
    `published()`: the object the slices are built from (the inventory), a new one when they
    change; `taints()`: the device taints the node publishes now. A scrape compares that
    object, the taints and the records with the last ones: building the slices to compare
    them costs ~0.2 s on a node of 2,048 VFs, ten times a whole scrape."""

    def __init__(self, driver: str, objects: Callable[[Taints], list[dict]], records: Callable[[], Iterable],
                 published: Callable[[], object] | None = None,
                 taints: Callable[[], Taints] = lambda: {}) -> None:
        self.driver = driver
        self.objects = objects
        self.records = records
        self.published = published
        self.taints = taints
        self.log = logs.get("capacity-gauges")
        self._last: tuple[object, dict, tuple, list] | None = None  # (published, taints, records, findings)
        self._warned = False  # the missing dependency is logged once, not at every scrape

    def findings(self) -> list:
        try:
            from driver.explain import capacity, capacity_inputs
        except ImportError as error:
            # cel-python is a runtime dependency: only a broken install gets here, and its
            # gauges would be absent without a word (the image once lacked cel-python).
            if not self._warned:
                self._warned = True
                self.log.warning("capacity_gauges_unavailable", missing=error.name, error=str(error),
                                 hint="the fragmentation gauges need cel-python: pip install 'cel-python>=0.5'")
            return []
        published = self.published() if self.published is not None else None
        taints = {name: [dict(t) for t in found] for name, found in self.taints().items() if found}
        current = list(self.records())
        records = tuple((r.uid, r.devices) for r in current)
        if (self._last is not None and published is not None and self._last[0] is published
                and self._last[1] == taints and self._last[2] == records):
            return self._last[3]
        held = claim_objects(current, self.driver)
        split = capacity_inputs.per_node(self.objects(taints) + held)
        findings = capacity.node_capacity(split[0].world, split[0].node, self.driver).findings if split else []
        self._last = (published, taints, records, findings)
        return findings

    def collect(self) -> Iterable[GaugeMetricFamily]:
        found = self.findings()
        free = GaugeMetricFamily(f"{PREFIX}_free_devices", "The largest count of devices of this kind one "
                                 "claim can still get on this node (explain's allocation model)",
                                 labels=["kind", "request"])
        mig = GaugeMetricFamily(f"{PREFIX}_largest_mig_slices", "Compute slices of the largest MIG profile "
                                "that can still be placed on this node (0: none)")
        share = GaugeMetricFamily(f"{PREFIX}_largest_share", "The largest share of one GPU of this model "
                                  "that still fits (consumable capacity; memory in bytes)",
                                  labels=["model", "capacity"])
        largest_slices = 0
        for f in found:
            if f.kind in COUNT_KINDS:
                free.add_metric([f.kind, f.label], f.largest or 0)
            if f.kind in ("mig", "mig-largest") and f.largest is not None:
                profile = f.label if f.kind == "mig" else f.largest
                largest_slices = max(largest_slices, _slices(str(profile)))
            if f.kind.startswith("share-"):
                value = float(quantities.value(str(f.largest))) if f.largest is not None else 0.0
                share.add_metric([f.label, f.kind.removeprefix("share-")], value)
        if any(f.kind in ("mig", "mig-largest") for f in found):
            mig.add_metric([], largest_slices)
        yield free
        yield mig
        yield share


def _slices(profile: str) -> int:
    match = re.match(r"^(\d+)g\.", profile)
    return int(match.group(1)) if match else 0
