"""Fragmentation gauges from the driver's side (issue 41, item 4): computed from the node's
published devices and its prepared claims by the capacity model, exported by the
driver's registry."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from driver.metrics import Metrics
from driver.explain.capacitymetrics import CapacityCollector
from driver.publish import mocknode
from driver.state.checkpoint import ClaimRecord, PreparedDevice, State

DRIVER = "accel.dra.io"
NODE = mocknode.MOCK_NODE


def record(name: str, devices: list[str], consumed: dict | None = None, admin: bool = False) -> ClaimRecord:
    prepared = tuple(PreparedDevice("r", NODE, d, (), share_id=f"share-{name}-{i}" if consumed else None,
                                    admin_access=admin, consumed=consumed or {}) for i, d in enumerate(devices))
    return ClaimRecord(f"uid-{name}", "default", name, State.PREPARE_COMPLETED, "boot", prepared)


def scrape(profile: str, records: list[ClaimRecord], sharing: str = "exclusive", mig: str = "static") -> dict:
    objects = mocknode.mock_objects(profile, DRIVER, sharing, mig)
    metrics = Metrics(DRIVER)
    metrics.registry.register(CapacityCollector(DRIVER, lambda taints: objects, lambda: records))
    samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name.startswith("dra_driver_capacity"):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_free_whole_devices_follow_the_prepared_claims():
    free = scrape("h100x8", [])
    assert free[("dra_driver_capacity_free_devices", (("kind", "gpu"), ("request", "whole GPUs")))] == 8
    held = scrape("h100x8", [record("a", [f"gpu-0000-{i}1-00-0" for i in range(1, 6)])])
    assert held[("dra_driver_capacity_free_devices", (("kind", "gpu"), ("request", "whole GPUs")))] == 3
    assert held[("dra_driver_capacity_free_devices", (("kind", "gpu-nic"),
                                                      ("request", "GPU+NIC pairs, each on one PCIe root")))] == 3
    # admin access holds nothing for others
    admin = scrape("h100x8", [record("b", ["gpu-0000-11-00-0"], admin=True)])
    assert admin[("dra_driver_capacity_free_devices", (("kind", "gpu"), ("request", "whole GPUs")))] == 8


def test_largest_mig_profile_in_compute_slices():
    assert scrape("mixed", [], mig="dynamic")[("dra_driver_capacity_largest_mig_slices", ())] == 7
    small = [record("m", ["gpu-0000-11-00-0-mig-1g-10gb-0"]), record("n", ["gpu-0000-21-00-0-mig-1g-10gb-0"])]
    assert scrape("mixed", small, mig="dynamic")[("dra_driver_capacity_largest_mig_slices", ())] == 3


def test_largest_share_per_model_in_bytes():
    labels = (("capacity", "memory"), ("model", "NVIDIA H100 80GB HBM3"))
    shares = [record("s", ["gpu-0000-11-00-0"], {"memory": "10Gi", "compute": "0"}),
              record("t", ["gpu-0000-21-00-0"], {"memory": "40Gi", "compute": "0"})]
    assert scrape("mixed", shares, sharing="consumable")[("dra_driver_capacity_largest_share", labels)] == 69 * 2**30
    assert scrape("mixed", [], sharing="consumable")[("dra_driver_capacity_largest_share", labels)] == 79 * 2**30


def test_the_answer_is_kept_until_the_node_changes():
    objects = mocknode.mock_objects("l4", DRIVER, "exclusive", "static")
    records: list = []
    built = []
    inventory = [object()]

    def slices(taints):
        built.append(1)
        return objects
    collector = CapacityCollector(DRIVER, slices, lambda: records, lambda: inventory[0])
    first = collector.findings()
    assert collector.findings() is first and len(built) == 1  # nothing built again at a scrape
    records.append(record("x", ["gpu-0000-11-00-0"]))
    assert collector.findings() is not first
    assert next(f.largest for f in collector.findings() if f.kind == "gpu") == 3
    inventory[0] = object()  # rediscovery: a new inventory
    collector.findings()
    assert len(built) == 3



def mock_inventory(profile: str, mig: str = "static"):
    """What the driver discovers on a mock node (as driver/publish/mocknode.py does)."""
    import tempfile
    from pathlib import Path

    from driver.devices import mock
    from driver.devices.discovery import discover

    with tempfile.TemporaryDirectory(prefix="dra-gauges-") as scratch:
        sources = mock.build(mock.load(profile), Path(scratch) / "mock").sources()
        return discover(type(sources)(sources.sysfs, sources.proc, sources.nvml, sources.nic_filter,
                                      sources.pci_ids, mig)).inventory


def test_a_health_tainted_device_is_not_free():
    """The gauges read the slices with the taints the node publishes (the service's wiring,
    driver/service/assembly.py): an XID-tainted GPU is allocated to no claim that does not
    tolerate it, so it is not free; the inventory is the same object, the answer changes."""
    import argparse

    from driver.monitoring.health import HealthState
    from driver.publish.publisher import Publisher
    from driver.service.assembly import published_objects, published_taints
    from driver.service.config import add_arguments, build

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build(parser.parse_args(["--node-name", NODE, "--driver-name", DRIVER]), {})
    inventory = mock_inventory("h100x8")
    health = HealthState(DRIVER, lambda: inventory)
    publisher = Publisher(None, DRIVER, NODE, lambda: inventory, taints=health.taints)
    collector = CapacityCollector(DRIVER, lambda taints: published_objects(config, inventory, taints), list,
                                  lambda: inventory, lambda: published_taints(publisher, health))

    def free() -> int:
        return next(f.largest for f in collector.findings() if f.kind == "gpu")

    assert free() == 8
    health.set("gpu-0000-11-00-0", "gpu-xid", "79", "XID 79")
    assert free() == 7
    health.set("gpu-0000-21-00-0", "gpu-unreachable", "true", "gone")
    assert free() == 6
    health.clear("gpu-0000-11-00-0", "gpu-xid")
    assert free() == 7
    # where the server drops device taints the scheduler allocates the device: it is free
    publisher.taints_supported = False
    assert free() == 8


# -- the driver's /metrics (the mixed mock node, in process) -------------------------------------------------
from test_health_metrics import GPU0, claim_allocated, running  # noqa: E402,F401  (a fixture)
from test_health_metrics import scrape as scrape_driver  # noqa: E402
from driver.sim.kubelet import Claim  # noqa: E402


def test_the_driver_exports_them_and_a_prepared_claim_moves_them(running):
    import uuid

    api, plugin, kubelet, _ = running
    key = 'dra_driver_capacity_free_devices{kind="gpu",request="whole GPUs"}'
    assert scrape_driver(plugin.metrics_port)[key] == 2
    uid = str(uuid.uuid4())
    api.put_claim(claim_allocated("default", "c", uid, [
        {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": GPU0}]))
    assert kubelet.prepare([Claim("default", "c", uid)]).claims[uid].error == ""
    after = scrape_driver(plugin.metrics_port)
    assert after[key] == 1
    assert after['dra_driver_capacity_free_devices{kind="gpu-nic",request="GPU+NIC pairs, each on one PCIe root"}'] == 1


def test_dra_driver_run_exports_them():
    """`dra-driver run` itself: the CLI hands the service the collector (driver/cli.py), so
    the gauges are on the /metrics of the process the DaemonSet starts."""
    import time
    import urllib.error

    from driver.sim.apiserver import ApiServer
    from tests.driverproc import DriverDirs, DriverProcess
    from tests.inprocess import free_port

    key = 'dra_driver_capacity_free_devices{kind="gpu",request="whole GPUs"}'
    dirs = DriverDirs.make()
    port = free_port()
    try:
        with ApiServer() as api:
            api.add_node("node-a")
            driver = DriverProcess(api, dirs, "l4", extra=["--metrics-port", str(port)]).start()
            try:
                deadline, seen = time.monotonic() + 60, {}
                while key not in seen:
                    assert driver.proc.poll() is None, driver.log()[-3000:]
                    assert time.monotonic() < deadline, f"{sorted(seen)}\n{driver.log()[-3000:]}"
                    time.sleep(0.2)
                    try:
                        seen = scrape_driver(port)
                    except (urllib.error.URLError, ConnectionError):
                        continue  # not listening yet
                assert seen[key] == 4
            finally:
                assert driver.terminate() == 0, driver.log()[-3000:]
    finally:
        dirs.cleanup()
