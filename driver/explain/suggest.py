"""The obvious fixes, where a selector rules out every device that reaches it:

- a quantity in the wrong units: `quantity("80Gi")` where the devices have 79.6 GiB and
  `80G` would select them (and the reverse), checked by evaluating the changed selector;
- an attribute or capacity name that no such device has, when a close one exists
  (`productname` for `productName`), or a domain with a typo;
- a `semver("12.4")` that is not a semantic version (`12.4.0` is);
- a runtime error from an attribute only some devices have: guard it with `in`.
"""

from __future__ import annotations

import difflib
import re

from driver.kube import names
from driver.kube import quantity as quantities
from driver.explain import verdicts
from driver.explain import world as w
from driver.scheduling import cel
_QUANTITY_LITERAL = re.compile(r'quantity\("([^"]*)"\)')
_SEMVER_LITERAL = re.compile(r'semver\("([^"]*)"\)')
_UNIT_TWIN = {"k": "Ki", "M": "Mi", "G": "Gi", "T": "Ti", "P": "Pi", "E": "Ei"}
_UNIT_TWIN.update({v: k for k, v in list(_UNIT_TWIN.items())})
_NUMBER_UNIT = re.compile(r"^([0-9.]+)([A-Za-z]*)$")


def suggestions(spec: dict, reports: list[verdicts.NodeReport], world: w.World) -> list[str]:
    devices = {d.key: d for d in world.devices}
    # (request, selector) -> the devices that stopped at it; and those that got past it.
    stopped: dict[tuple[str, str, str], list[tuple[w.PoolDevice, verdicts.DeviceVerdict]]] = {}
    passed: set[tuple[str, str, str]] = set()
    for report in reports:
        for alt in report.alternatives:
            order = [s["expression"] for s in alt.selectors]
            for position, selector in enumerate(alt.selectors):
                where = "class selector" if selector["from"].startswith("class") else "selector"
                key = (alt.request, f"{where} #{selector['index']}", selector["expression"])
                for verdict in alt.devices:
                    device = devices.get(f"{verdict.driver}/{verdict.pool}/{verdict.device}")
                    if device is None:
                        continue
                    if verdict.expression == selector["expression"]:
                        stopped.setdefault(key, []).append((device, verdict))
                    elif verdict.expression is None or order.index(verdict.expression) > position:
                        passed.add(key)
    out: list[str] = []
    for (request, where, expression), hits in stopped.items():
        if (request, where, expression) in passed:
            continue  # the selector lets some device through: not the obvious culprit
        for text in (_units(expression, hits) + _names(expression, hits) + _semver(expression)
                     + _guards(expression, hits)):
            line = f"request {request}, {where}: {text}"
            if line not in out:
                out.append(line)
    return out


def _units(expression: str, hits) -> list[str]:
    out = []
    for literal in dict.fromkeys(_QUANTITY_LITERAL.findall(expression)):
        match = _NUMBER_UNIT.match(literal)
        if not match or match.group(2) not in _UNIT_TWIN:
            continue
        twin = match.group(1) + _UNIT_TWIN[match.group(2)]
        changed = expression.replace(f'quantity("{literal}")', f'quantity("{twin}")')
        selected = [d for d, _ in hits if _accepts(changed, d)]
        if selected:
            seen = sorted({v for _, verdict in hits for k, v in verdict.seen.items()
                           if k in _capacity_names(expression)})
            have = f" (the devices have {', '.join(seen)})" if seen else ""
            out.append(f'quantity("{literal}") is {_bytes(literal)}{have}; with quantity("{twin}") '
                       f"({_bytes(twin)}) it selects {len(selected)} device(s), e.g. {selected[0].name}")
    return out


def _bytes(literal: str) -> str:
    return format(quantities.value(literal).normalize(), "f")


def _capacity_names(expression: str) -> set[str]:
    return {name for kind, _, name in cel.references(expression) if kind == "capacity"}


def _accepts(expression: str, device: w.PoolDevice) -> bool:
    try:
        return cel.evaluate(expression, device.activation())
    except cel.CelError:
        return False


def _names(expression: str, hits) -> list[str]:
    out = []
    for kind, domain, name in cel.references(expression):
        if any(d.lookup(kind, domain, name) is not None for d, _ in hits):
            continue
        known = set().union(*(d.names(kind, domain) for d, _ in hits)) if hits else set()
        what = "attribute" if kind == "attributes" else "capacity"
        if known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
            if close:
                out.append(f'no device has {what} {name!r} in domain {domain}; did you mean {close[0]!r}?')
            else:
                out.append(f"no device has {what} {name!r} in domain {domain} (they have: "
                           f"{', '.join(sorted(known))})")
            continue
        domains = sorted({k.rpartition("/")[0] or d.driver for d, _ in hits
                          for k in (d.attributes if kind == "attributes" else d.capacity)})
        close = difflib.get_close_matches(domain, domains, n=1, cutoff=0.7)
        if close:
            out.append(f"no device has {what}s in domain {domain!r}; did you mean {close[0]!r}?")
    return out


def _semver(expression: str) -> list[str]:
    out = []
    for literal in dict.fromkeys(_SEMVER_LITERAL.findall(expression)):
        if names.is_semver(literal):
            continue
        fixed = names.normalize_semver(literal)
        fix = f'; write semver("{fixed}")' if fixed else ""
        out.append(f'semver("{literal}") is not a semantic version (MAJOR.MINOR.PATCH){fix}')
    return out


def _guards(expression: str, hits) -> list[str]:
    out = []
    for _, verdict in hits:
        if verdict.code != verdicts.CEL_ERROR:
            continue
        if "no such key" in verdict.reason:
            missing = verdict.reason.rsplit("no such key:", 1)[-1].strip()
            for kind, domain, name in cel.references(expression):
                if name == missing and any(d.lookup(kind, domain, name) is not None for d, _ in hits):
                    out.append(f'{missing!r} is absent on some devices ({verdict.device}); guard it: '
                               f'"{missing}" in device.{kind}["{domain}"] && …')
                    break
        elif "semver ==" in verdict.reason or "semver.compareTo(string" in verdict.reason:
            out.append("a version attribute is compared with a string; compare with semver(\"…\")")
        elif "quantity ==" in verdict.reason or "quantity.compareTo(string" in verdict.reason:
            out.append("a capacity is compared with a string; compare with quantity(\"…\")")
        if out:
            break
    return out
