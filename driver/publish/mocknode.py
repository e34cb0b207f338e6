"""What a mock node publishes, as objects: its ResourceSlices (through discovery and the
publisher's own slice builder, as `dra-driver run --mock PROFILE` would publish them) and
the chart's DeviceClasses. explain reads them for `--mock`, the demo to say which profiles
could hold a claim that does not fit."""

from __future__ import annotations

import tempfile
from pathlib import Path

from driver.publish import deviceclasses, slices

MOCK_NODE = "mock-node"


class MockNodeError(ValueError):
    """A profile that cannot be loaded; the message names it."""


def class_objects(driver: str) -> list[dict]:
    """The chart's DeviceClasses (deviceclasses.py is what the chart renders)."""
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
             "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]}}
            for name, expressions in deviceclasses.all_classes(driver).items()]


def mock_objects(profile: str, driver: str, gpu_sharing: str, mig_mode: str) -> list[dict]:
    from driver.devices import mock
    from driver.devices.discovery import discover

    try:
        loaded = mock.load(profile)
    except (OSError, ValueError) as err:
        raise MockNodeError(f"--mock {profile}: {err}") from None
    with tempfile.TemporaryDirectory(prefix="dra-explain-") as scratch:
        node = mock.build(loaded, Path(scratch) / "mock")
        sources = node.sources()
        result = discover(type(sources)(sources.sysfs, sources.proc, sources.nvml, sources.nic_filter,
                                        sources.pci_ids, mig_mode))
    return inventory_objects(result.inventory, driver, gpu_sharing)


def inventory_objects(inventory, driver: str, gpu_sharing: str = slices.EXCLUSIVE) -> list[dict]:
    """What a node with this inventory publishes (as `dra-driver run` would, one pool on
    node mock-node), with the chart's DeviceClasses."""
    pool = slices.PoolIdentity(driver, MOCK_NODE)
    return slices.build(inventory, pool, generation=1, sharing=gpu_sharing) + class_objects(driver)
