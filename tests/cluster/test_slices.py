"""ResourceSlices of every publishing mode, written by the driver with the chart's RBAC and
a token of its ServiceAccount, as the real kube-apiserver stores them; and a steady driver
writes nothing."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import lc
from tests.cluster.driverhost import DRIVER, HostDriver, install

served = lc.served

MODES = {
    # mode: (mock profile, driver environment)
    "exclusive": ("mixed", {"GPU_SHARING": "exclusive"}),
    "consumable": ("mixed", {"GPU_SHARING": "consumable"}),
    "dynamic-mig": ("h100x8", {"MIG_MODE": "dynamic"}),  # 1.35+ layout: a counters slice
    "sriov-large": ("sriov-large", {}),
}
# What a user sees of each mode in the stored slices (a driver that falls back, e.g. to
# exclusive GPUs when the API server drops allowMultipleAllocations, fails here).
def _devices(slices):
    return [d for s in slices.values() for d in s["spec"].get("devices", [])]


MODE_SHOWS = {
    "exclusive": lambda sl: not any(d.get("allowMultipleAllocations") for d in _devices(sl)),
    "consumable": lambda sl: any(d.get("allowMultipleAllocations") and d.get("capacity", {}).get("memory", {}).get("requestPolicy")
                                 for d in _devices(sl)),
    "dynamic-mig": lambda sl: any(s["spec"].get("sharedCounters") for s in sl.values())
                              and any(d.get("consumesCounters") for d in _devices(sl)),
    "sriov-large": lambda sl: sum(1 for d in _devices(sl) if d["name"].startswith("nic-")) >= 100,
}
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture(scope="module")
def chart(cluster):
    return install(cluster, {"deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
                             "mock": {"enabled": True}})


def sent_slices(cluster, node: str, since: int) -> tuple[dict[str, dict], list[str]]:
    """The last body the driver sent for each of the node's slices it still has (create or
    update, less the ones it deleted after), from the API server's audit log, events after
    the first `since`; and the names it deleted, for the failure message."""
    out: dict[str, dict] = {}
    deleted: list[str] = []
    for ev in cluster.audit()[since:]:
        if ev.get("objectRef", {}).get("resource") != "resourceslices" \
                or ev.get("responseStatus", {}).get("code", 0) >= 300:
            continue
        # what the driver wrote, in the version it chose (v1beta1 on 1.32), read as v1 as
        # the stored slices are (served.py keeps every field, so a dropped one still shows)
        body = served.up(ev.get("requestObject"))
        if ev["verb"] in ("create", "update") and body and body.get("spec", {}).get("nodeName") == node:
            out[body["metadata"]["name"]] = body
        elif ev["verb"] == "delete" and ev["objectRef"].get("name") in out:
            deleted.append(ev["objectRef"]["name"])
            del out[ev["objectRef"]["name"]]
    return out, deleted


QUANTITY_KEYS = {"value", "default", "min", "max", "step"}


def diff(sent, got, path: str = "spec") -> str:
    """The first paths where two slice specs differ, for the failure message."""
    if isinstance(sent, dict) and isinstance(got, dict):
        out = [diff(sent.get(k), got.get(k), f"{path}.{k}") for k in sorted(set(sent) | set(got))
               if sent.get(k) != got.get(k)]
        return "; ".join(o for o in out if o)[:2000]
    if isinstance(sent, list) and isinstance(got, list) and len(sent) == len(got):
        return "; ".join(diff(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(sent, got)) if a != b)
    return f"{path}: sent {sent!r}, stored {got!r}"


def canon(obj, in_quantities: bool = False):
    """obj with every resource.Quantity in its canonical form, as the API server stores it
    ("40960Mi" is stored as "40Gi"): quantities are the capacity and counter values."""
    from driver.kube.quantity import canonical

    if isinstance(obj, dict):
        return {k: (canonical(v) if in_quantities and k in QUANTITY_KEYS and isinstance(v, str)
                    else canon(v, in_quantities or k in ("capacity", "counters")))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [canon(x, in_quantities) for x in obj]
    return obj


def stored_slices(cluster, node: str) -> dict[str, dict]:
    code, body = cluster.api(
        "GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={node},spec.driver={DRIVER}")
    assert code == 200, body
    return {s["metadata"]["name"]: s for s in body["items"]}


def driver_writes(cluster) -> list[tuple[str, str, int]]:
    return [(e["verb"], e["requestURI"], e.get("responseStatus", {}).get("code"))
            for e in cluster.audit() if e["verb"] in WRITE_VERBS]


# a mode whose API fields a release lacks: the driver falls back (and says so), so on
# that release there is nothing of the mode to see
MODE_RELEASES = {"consumable": (34, "consumable capacity (allowMultipleAllocations, DRAConsumableCapacity)"),
                 "dynamic-mig": (34, "the driver's shared counters for dynamic MIG (DRAPartitionableDevices)")}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.release(*MODE_RELEASES[m]))
                                  if m in MODE_RELEASES else m for m in MODES])
def test_slices_accepted_as_published_and_steady_driver_writes_nothing(cluster, chart, mode, tmp_path):
    profile, env = MODES[mode]
    node = lc_node(cluster)
    # rediscovery every 2 s, so "steady" covers several passes
    # a new node: no slices of it yet, so that the driver writes all of them
    code, body = cluster.api("DELETE", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={node}")
    assert code == 200, body
    since = len(cluster.audit())
    drv = HostDriver(cluster, chart, tmp_path, node, fresh_node=True,
                     extra_env={"MOCK_PROFILE": profile, "REDISCOVER_INTERVAL": "2", **env}).start()
    try:
        drv.wait_log("slices_in_sync", 90)
        want, deleted = sent_slices(cluster, node, since)
        assert want, "the driver (a new node's) wrote its slices"
        have = stored_slices(cluster, node)
        assert set(have) == set(want), (
            f"the node's slices are the ones the driver wrote: stored {sorted(have)}, written and not "
            f"deleted {sorted(want)}, deleted {deleted}; driver log:\n{drv.log()[-3000:]}")
        for name, s in want.items():
            got = have[name]["spec"]
            sent = dict(s["spec"], pool=dict(s["spec"]["pool"], generation=got["pool"]["generation"]))
            assert got == canon(sent), (f"{mode}: slice {name} as stored differs from what the driver "
                                 f"sent (a dropped field means a feature gate or API version we rely on "
                                 f"is off): {diff(canon(sent), got)}")
        assert MODE_SHOWS[mode](have), f"{mode}: the stored slices do not show the mode; driver log:\n" + "\n".join(
            line for line in drv.log().splitlines() if '"warning"' in line)[-3000:]
        # steady: several rediscovery passes, no write, no new resourceVersion
        versions = {n: s["metadata"]["resourceVersion"] for n, s in have.items()}
        writes = driver_writes(cluster)
        time.sleep(8)
        assert driver_writes(cluster) == writes, "a steady driver wrote to the API server"
        assert {n: s["metadata"]["resourceVersion"] for n, s in stored_slices(cluster, node).items()} == versions
        assert drv.proc.poll() is None, drv.log()[-3000:]
        # this driver's requests only (the session-wide check is test_rbac_grants')
        denied = [(e["verb"], e["requestURI"], e["responseStatus"]) for e in cluster.audit()[since:]
                  if e.get("responseStatus", {}).get("code") in (401, 403)]
        assert not denied, f"the API server refused the driver (chart RBAC or admission): {denied}"
    finally:
        assert drv.stop() == 0, drv.log()[-3000:]


def lc_node(cluster) -> str:
    import local_cluster

    return local_cluster.NODE
