"""The claim's opaque configs for our driver, judged as the cluster would judge them.

A config our decoder (driver/prepare/opaque.py) rejects is rejected by the chart's admission
policy when the claim is applied (tests/test_config_policy.py keeps the two in step), and
fails the claim's prepare on any node where the policy is not installed: the claim fits
nowhere, whatever its devices. A config aimed at a request (`requests: [...]`) whose
allocated device is of a kind it cannot configure (a NicConfig for a GPU) fails prepare
on that node. Configs for other drivers are theirs to judge.
"""

from __future__ import annotations

from driver.prepare import opaque
from driver.explain import engine
from driver.explain import world as w

POLICY = ("the chart's admission policy rejects the claim when it is applied, and prepare "
          "fails where the policy is not installed")


def problems(spec: dict, driver: str) -> list[str]:
    """What is wrong with the claim's configs for `driver`, one line each."""
    devices = spec.get("devices") if isinstance(spec, dict) else None
    configs = devices.get("config") if isinstance(devices, dict) else None
    found = []
    for index, entry in enumerate(configs if isinstance(configs, list) else []):
        source = (entry or {}).get("opaque") if isinstance(entry, dict) else None
        if not isinstance(source, dict) or source.get("driver") != driver:
            continue
        try:
            opaque.decode(source.get("parameters"))
        except opaque.ConfigDecodeError as err:
            found.append(f"config #{index} for {driver}{_for(entry)}: {err}")
    return found


def check(result: engine.Explanation, spec: dict, driver: str, world: w.World) -> None:
    """Mark the explanation as prepare and the admission policy would see it."""
    bad = problems(spec, driver)
    if bad:
        why = f"invalid opaque config: {'; '.join(bad)} ({POLICY})"
        for node in result.nodes:
            node.fits, node.why, node.allocation = False, why, []
        result.suggestions.insert(0, f"fix the opaque config: {'; '.join(bad)}")
        if not result.nodes:
            result.notes.insert(0, why)
        return
    kinds = {(d.driver, d.pool, d.name): _kind(d) for d in world.devices}
    for node in result.nodes:
        if not node.fits:
            continue
        for allocated in node.allocation:
            if allocated.get("driver") != driver:
                continue
            kind = kinds.get((driver, allocated.get("pool"), allocated.get("device")))
            mismatch = _aimed_elsewhere(spec, driver, allocated.get("request", ""), kind)
            if mismatch:
                node.fits = False
                node.why = (f"prepare would fail: {mismatch} cannot configure {kind} device "
                            f"{allocated['device']} (request {allocated['request']})")
                node.allocation = []
                break


def _for(entry: dict) -> str:
    requests = entry.get("requests")
    return f" (requests {', '.join(map(str, requests))})" if requests else ""


def _kind(device: w.PoolDevice) -> str | None:
    value = (device.attributes.get("type") or {}).get("string")
    return value if isinstance(value, str) else None


def _aimed_elsewhere(spec: dict, driver: str, request: str, kind: str | None) -> str | None:
    """The config kind aimed at this request explicitly that cannot configure `kind`."""
    if kind is None:
        return None
    base = request.split("/", 1)[0]
    for entry in (spec.get("devices") or {}).get("config") or []:
        source = entry.get("opaque") or {}
        requests = entry.get("requests") or []
        if source.get("driver") != driver or not requests or not {request, base} & set(requests):
            continue
        config = opaque.decode(source.get("parameters"))
        if kind not in {k.value for k in opaque.APPLIES_TO[type(config)]}:
            return type(config).__name__
    return None
