"""A NIC whose netdev the driver moved into a pod (issue 38). The kernel's sysfs shows a
netdev only to the network namespace it is in (/sys/class/net/<if> and
/sys/bus/pci/devices/<bdf>/net/<if> are tagged with it), so from the host a moved VF is a
network function with no netdev. Discovery joins the move records to the PCI functions:
the NIC stays published as it was, and the health probe does not call its link missing.

The mock's sysfs tree follows its network namespace as the kernel's does
(driver/nri/mocknet.py `mirror`): the tests that move real netdevs check that too."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest
from pyroute2 import netns as pyroute2_netns

from driver.devices import fingerprint, mock
from driver.devices.discovery import Sources, discover
from driver.devices.model import Device, DeviceKind
from driver.monitoring.health import HealthState, Prober
from driver.nri.mocknet import ELSEWHERE, MockNetwork
from driver.nri.netdev import (AwayNetdevs, HostSettings, NetdevMover, Placement, Record,
                               record_name)
from tests.driverproc import DRIVER
from tests.test_nri_netdev import _REASON

PROFILE = """
managementNic: {model: i350, ifName: eno1}
roots:
  - numa: 0
    devices:
      - {type: nic, model: connectx-6dx, vfs: 2, rdma: true}
"""


@pytest.fixture
def node(tmp_path: Path):
    return mock.build(mock.parse(PROFILE, "in-pod.yaml"), tmp_path / "node")


def sources(node, away=tuple) -> Sources:
    return Sources(node.sysfs, node.proc, None, pci_ids=node.pci_db, away_netdevs=away)


def first_vf(devices) -> Device:
    return next(d for d in devices if d.kind is DeviceKind.NIC and d.attributes.get("sriovVF"))


def netdev_leaves(sysfs: Path, ifname: str, aside: Path) -> None:
    """What the kernel does to the host's sysfs when the netdev goes to another namespace:
    its class/net entry and its directory under the function are no longer listed."""
    entry = sysfs / "class" / "net" / ifname
    entry.resolve().rename(aside)
    entry.unlink()


def write_record(records: Path, device: Device, published: bool = True) -> None:
    attrs = device.attributes
    record = Record(claim_uid="claim-1", device=device.name, pod_uid="pod-1", pod="ml/trainer",
                    netns="/var/run/netns/x", pod_ifname="net1",
                    host=HostSettings(str(attrs["ifName"]), int(attrs["mtu"]), [], True,
                                      str(attrs["mac"])),
                    state="moved", published=dict(attrs) if published else None)
    records.mkdir(exist_ok=True)
    (records / record_name("pod-1", device.name)).write_text(json.dumps(asdict(record)))


def test_a_nic_in_a_pod_stays_published_as_it_was(node, tmp_path: Path) -> None:
    before = discover(sources(node))
    vf = first_vf(before.inventory.devices)
    records = tmp_path / "records"
    away = AwayNetdevs(records)
    write_record(records, vf)  # written before the move, as the mover does
    scan = fingerprint.fingerprint(node.sysfs)
    netdev_leaves(node.sysfs, vf.net_interface, tmp_path / "aside")
    assert (node.sysfs / "bus" / "pci" / "devices" / vf.pci.bus_id / "net").is_dir()

    changes = fingerprint.changes(scan, fingerprint.fingerprint(node.sysfs))
    assert changes.interfaces == {vf.net_interface}
    incremental = discover(sources(node, away), before, changes)
    full = discover(sources(node, away))
    assert incremental.inventory == before.inventory, "the slice would change"
    assert full.inventory == before.inventory, "a restart would publish it otherwise"
    assert incremental.inventory.get(vf.name) == vf

    # Without a record the host cannot tell it from a function someone else took: unpublished.
    assert discover(sources(node)).inventory.get(vf.name) is None


def test_a_record_without_the_published_attributes_keeps_name_mac_and_mtu(node, tmp_path):
    """Records of a driver that did not keep them: what the record itself says."""
    before = discover(sources(node))
    vf = first_vf(before.inventory.devices)
    records = tmp_path / "records"
    write_record(records, vf, published=False)
    netdev_leaves(node.sysfs, vf.net_interface, tmp_path / "aside")
    got = discover(sources(node, AwayNetdevs(records))).inventory.get(vf.name)
    assert got is not None and got.net_interface == vf.net_interface
    assert {k: got.attributes.get(k) for k in ("ifName", "mac", "mtu", "sriovVF", "pfPciBusID",
                                              "rdmaDevice")} == \
        {k: vf.attributes.get(k) for k in ("ifName", "mac", "mtu", "sriovVF", "pfPciBusID",
                                          "rdmaDevice")}
    assert "linkState" not in got.attributes  # nothing says what it is in the pod


def test_a_function_rebound_to_vfio_is_not_published_from_its_record(node, tmp_path):
    before = discover(sources(node))
    vf = first_vf(before.inventory.devices)
    records = tmp_path / "records"
    write_record(records, vf)
    netdev_leaves(node.sysfs, vf.net_interface, tmp_path / "aside")
    driver = node.sysfs / "bus" / "pci" / "devices" / vf.pci.bus_id / "driver"
    vfio = node.sysfs / "bus" / "pci" / "drivers" / "vfio-pci"
    vfio.mkdir()
    driver.unlink()
    driver.symlink_to(os.path.relpath(vfio, driver.parent))
    assert discover(sources(node, AwayNetdevs(records))).inventory.get(vf.name) is None


def test_the_probe_leaves_the_link_of_a_nic_in_a_pod_alone(node, tmp_path: Path) -> None:
    result = discover(sources(node))
    vf = first_vf(result.inventory.devices)
    records = tmp_path / "records"
    netdev_leaves(node.sysfs, vf.net_interface, tmp_path / "aside")
    state = HealthState(DRIVER, lambda: result.inventory)
    Prober(state, node.sysfs, node.dev, None).probe()
    assert "link-down" in state.conditions(vf.name), "an interface gone without a record is down"
    write_record(records, vf)
    prober = Prober(state, node.sysfs, node.dev, None, away=AwayNetdevs(records))
    prober.probe()
    assert state.conditions(vf.name) == {}


# -- with real netdevs: the mock's sysfs follows its namespace ----------------------------

needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
def network(node):
    made = MockNetwork(f"dra-test-mirror-{os.getpid()}-{uuid.uuid4().hex[:6]}", node.sysfs)
    made.create()
    made.populate(set())
    yield made
    made.destroy()


@pytest.fixture
def pod_netns():
    name = f"dra-test-pod-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pyroute2_netns.create(name)
    yield f"/var/run/netns/{name}"
    if os.path.exists(f"/var/run/netns/{name}"):
        pyroute2_netns.remove(name)


@needs_netns
def test_the_mock_sysfs_loses_a_moved_netdev_and_gets_it_back(node, network, pod_netns,
                                                              tmp_path: Path) -> None:
    before = discover(sources(node))
    vf = first_vf(before.inventory.devices)
    ifname, bdf = vf.net_interface, vf.pci.bus_id
    network.mirror()
    assert discover(sources(node)).inventory == before.inventory, "mirror at rest changes nothing"
    net_dir = (node.sysfs / "bus" / "pci" / "devices" / bdf).resolve() / "net"
    files = {p.name: p.read_bytes() for p in (net_dir / ifname).iterdir() if p.is_file()}
    records = tmp_path / "records"
    mover = NetdevMover(records, host_netns=network.path, recreate=network.recreate,
                        published_of=lambda name: dict(before.inventory.get(name).attributes),
                        host_changed=network.mirror)
    away = AwayNetdevs(records)

    mover.attach(Placement("claim-1", vf.name, ifname, "pod-1", "ml/trainer", pod_netns))
    assert ifname not in os.listdir(node.sysfs / "class" / "net")
    assert os.listdir(net_dir) == [], "<bdf>/net/ stays, empty, as the kernel shows it"
    assert "eno1" in os.listdir(node.sysfs / "class" / "net")
    assert [(a.device, a.ifname) for a in away()] == [(vf.name, ifname)]
    assert discover(sources(node, away)).inventory == before.inventory

    mover.detach("pod-1", vf.name)
    assert (node.sysfs / "class" / "net" / ifname).resolve() == net_dir / ifname
    assert {p.name: p.read_bytes() for p in (net_dir / ifname).iterdir() if p.is_file()} == files
    assert away() == ()
    assert discover(sources(node, away)).inventory == before.inventory
    assert not os.listdir(node.root / ELSEWHERE)


@needs_netns
def test_a_netdev_that_died_with_its_pod_is_back_in_sysfs_when_recreated(
        node, network, pod_netns, tmp_path: Path) -> None:
    before = discover(sources(node))
    vf = first_vf(before.inventory.devices)
    records = tmp_path / "records"
    mover = NetdevMover(records, host_netns=network.path, recreate=network.recreate,
                        host_changed=network.mirror)
    mover.attach(Placement("claim-1", vf.name, vf.net_interface, "pod-1", "ml/trainer",
                           pod_netns))
    pyroute2_netns.remove(Path(pod_netns).name)  # the mock's dummy dies with it
    network.mirror()
    assert vf.net_interface not in os.listdir(node.sysfs / "class" / "net")
    assert [r.device for r in mover.reconcile()] == [vf.name]
    assert discover(sources(node)).inventory == before.inventory

