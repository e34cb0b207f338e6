"""Device taints and request tolerations (KEP-5055), as the scheduler matches them."""

from __future__ import annotations

from typing import Iterable

# `None` is informational: it keeps no claim away.
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def tolerated(taint: dict, tolerations: Iterable[dict]) -> bool:
    """A toleration matches on effect (empty: every effect), and on key and value by its
    operator: `Exists` (an empty key: every key) or `Equal` (the default)."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator", "Equal") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def blocking(taints: Iterable[dict], tolerations: Iterable[dict]) -> dict | None:
    """The first taint that keeps a request with these tolerations off the device."""
    tolerations = list(tolerations)
    for taint in taints:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerated(taint, tolerations):
            return taint
    return None


def text(taint: dict) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key')}{value}:{taint.get('effect')}"
