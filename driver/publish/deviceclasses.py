"""The DeviceClass selectors the Helm chart installs, for code that needs them without a
cluster (the demo). tests/test_chart.py checks that the chart renders the same ones."""

from __future__ import annotations

from driver.devices.model import DeviceKind


def class_name(kind: DeviceKind, driver: str) -> str:
    return f"{kind.value}.{driver}"


def selector(kind: DeviceKind, driver: str) -> str:
    return f'device.driver == "{driver}" && device.attributes["{driver}"].type == "{kind.value}"'


def all_classes(driver: str) -> dict[str, list[str]]:
    return {class_name(kind, driver): [selector(kind, driver)] for kind in DeviceKind}
