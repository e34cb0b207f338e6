"""Every built-in mock profile discovers into valid ResourceSlices, with stable names and
the PCIe topology the profile describes."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import kubernetes_validate
import pytest

from driver import cli

from driver.publish import slices
from driver.devices import mock
from driver.devices.discovery import Sources, discover
from driver.devices.model import PCIE_ROOT, DeviceKind, Version
from tests.conftest import discover_profile
from driver.scheduling.k8s_limits import slice_errors

K8S_VERSIONS = ("1.34.0", "1.37.0")  # first and newest with resource.k8s.io/v1


@pytest.mark.parametrize("profile", mock.builtin_profiles())
def test_discover_json_is_valid_v1_for_every_profile(profile, capsys, built):
    assert cli.main(["discover", "--mock", profile, "-o", "json", "--node-name", "node-a"]) == 0
    listing = json.loads(capsys.readouterr().out)
    items = listing["items"]
    _, result = built(profile)
    published = sorted(d["name"] for s in items for d in s["spec"]["devices"])
    assert published == [d.name for d in result.inventory.devices]
    assert published, f"{profile}: no devices"
    for obj in items:
        assert obj["apiVersion"] == "resource.k8s.io/v1"
        assert obj["spec"]["pool"]["resourceSliceCount"] == len(items)
        assert slice_errors(obj) == [], obj["metadata"]["name"]
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_discover_yaml_round_trips_to_the_same_slices(capsys):
    import yaml

    cli.main(["discover", "--mock", "mixed", "-o", "json", "--node-name", "n1"])
    as_json = json.loads(capsys.readouterr().out)["items"]
    cli.main(["discover", "--mock", "mixed", "-o", "yaml", "--node-name", "n1"])
    as_yaml = list(yaml.safe_load_all(capsys.readouterr().out))
    assert as_yaml == as_json


def test_console_script_runs_the_table(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "driver", "discover", "--mock", "mixed", "--log-format", "json"],
        capture_output=True, text=True, check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "MODEL", "MEMORY", "PCI", "PCIEROOT", "NUMA", "INTERFACE"]
    gpu = next(line for line in lines if line.startswith("gpu-0000-11-00-0"))
    assert "81559Mi" in gpu and "pci0000:10" in gpu
    assert "not published: interface eno1: carries the node's default route" in out


def test_sriov_large_splits_into_full_slices(built):
    _, result = built("sriov-large")
    objects = slices.build(result.inventory, slices.PoolIdentity("accel.dra.io", "n"), 1)
    counts = [len(s["spec"]["devices"]) for s in objects]
    assert sum(counts) == len(result.inventory.devices) == 16 * 128
    assert len(objects) == 16 and all(c == 128 for c in counts)


def _snapshot(result):
    return {d.name: (d.kind, dict(d.attributes), dict(d.capacity), d.device_nodes)
            for d in result.inventory.devices}


def test_names_are_stable_across_runs_and_enumeration_order(tmp_path):
    _, first = discover_profile("h100x8", tmp_path / "a")
    _, second = discover_profile("h100x8", tmp_path / "b")
    assert _snapshot(first) == _snapshot(second)

    # Same hardware enumerated in another order: NVML indices and minors change, names not.
    node = mock.build(mock.load("h100x8"), tmp_path / "c")
    random.Random(7).shuffle(node.library.gpus)
    for index, gpu in enumerate(node.library.gpus):
        gpu.index = index
    reordered = discover(node.sources())
    assert [d.name for d in reordered.inventory.devices] == [d.name for d in first.inventory.devices]
    for device in reordered.inventory.devices:
        original = first.inventory.get(device.name)
        assert device.attributes["uuid" if device.kind is DeviceKind.GPU else "type"] == \
            original.attributes["uuid" if device.kind is DeviceKind.GPU else "type"]
        if device.kind is DeviceKind.GPU:
            assert device.attributes[PCIE_ROOT] == original.attributes[PCIE_ROOT]


def test_h100_gpus_and_nics_pair_on_pcie_roots(built):
    _, result = built("h100x8")
    gpus = result.inventory.by_kind(DeviceKind.GPU)
    nics = result.inventory.by_kind(DeviceKind.NIC)
    assert len(gpus) == 8 and len(nics) == 8
    roots = {g.attributes[PCIE_ROOT] for g in gpus}
    assert len(roots) == 8, "each GPU has a root of its own"
    for gpu in gpus:
        partners = [n for n in nics if n.attributes[PCIE_ROOT] == gpu.attributes[PCIE_ROOT]]
        assert len(partners) == 1, gpu.name
        assert partners[0].pci.numa_node == gpu.pci.numa_node
        assert partners[0].attributes["rdma"] is True


def test_gpu_attributes(built):
    _, result = built("h100x8")
    gpu = result.inventory.get("gpu-0000-11-00-0")
    a = gpu.attributes
    assert a["type"] == "gpu" and a["productName"] == "NVIDIA H100 80GB HBM3"
    assert a["uuid"].startswith("GPU-") and a["brand"] == "Nvidia" and a["architecture"] == "Hopper"
    assert a["cudaComputeCapability"] == Version("9.0.0")
    assert a["driverVersion"] == Version("550.54.15")
    assert a["cudaDriverVersion"] == Version("12.4.0")
    assert a["resource.kubernetes.io/pciBusID"] == "0000:11:00.0"
    assert a[PCIE_ROOT] == "pci0000:10" and a["numaNode"] == 0
    assert a["index"] == 0 and a["minor"] == 0
    assert gpu.capacity == {"memory": "81559Mi"}
    assert gpu.device_nodes == ("/dev/nvidia0",)


def test_mig_gpus_publish_only_their_mig_devices(built):
    node, result = built("a100-mig")
    inv = result.inventory
    assert [d.name for d in inv.by_kind(DeviceKind.GPU)] == ["gpu-0000-21-00-0", "gpu-0000-22-00-0"]
    migs = inv.by_kind(DeviceKind.MIG)
    assert len(migs) == 10
    mig = inv.get("mig-0000-12-00-0-gi1-ci0")
    assert mig.attributes["profile"] == "3g.20gb"
    assert mig.attributes["parentUUID"] == node.library.gpus[1].uuid
    assert mig.capacity["memory"] == "19968Mi" and mig.capacity["multiprocessors"] == "42"
    # A100 driver 535.104.05 has a leading zero semver forbids: published normalized.
    assert mig.attributes["driverVersion"] == Version("535.104.5")
    parent_node, *caps = mig.device_nodes
    assert parent_node == "/dev/nvidia1" and len(caps) == 2
    for cap in caps:
        assert (node.dev / cap.removeprefix("/dev/")).exists(), cap


def test_sriov_profile_has_vfs_with_rdma(built):
    node, result = built("sriov")
    nics = result.inventory.by_kind(DeviceKind.NIC)
    vfs = [n for n in nics if n.attributes["sriovVF"]]
    assert len(vfs) >= 64
    pf = result.inventory.get("nic-0000-11-00-0")
    assert pf.attributes["sriovTotalVFs"] == 127 and pf.attributes["sriovNumVFs"] == 32
    vf = result.inventory.get("nic-0000-11-00-7")  # routing id 7 -> VF 5
    assert vf.attributes["pfPciBusID"] == "0000:11:00.0" and vf.attributes["vfIndex"] == 5
    assert vf.attributes["rdma"] is True and vf.attributes["rdmaDevice"].startswith("mlx5_")
    assert vf.device_nodes[1] == "/dev/infiniband/rdma_cm"
    assert (node.dev / vf.device_nodes[0].removeprefix("/dev/")).exists()
    e810 = [n for n in nics if n.attributes["pciVendorID"] == "0x8086"]
    assert len(e810) == 17 and all(n.attributes["linkState"] == "down" for n in e810)
    assert all("speedMbps" not in n.attributes for n in e810), "unknown speed is not published"


def test_fpga_profiles(tmp_path):
    _, alveo = discover_profile("alveo", tmp_path / "a")
    cards = alveo.inventory.by_kind(DeviceKind.FPGA)
    assert len(cards) == 3
    u250 = cards[0]
    assert u250.attributes["shell"] == "xilinx_u250_gen3x16_xdma_shell_4_1"
    assert u250.attributes["board"] == "u250" and u250.attributes["vendor"] == "xilinx"
    assert u250.attributes["interfaceID"] and u250.device_nodes[0].startswith("/dev/dri/renderD")
    assert u250.management_nodes == ("/dev/xclmgmt0",)

    _, dfl = discover_profile("dfl", tmp_path / "d")
    ports = dfl.inventory.by_kind(DeviceKind.FPGA)
    assert [p.device_nodes for p in ports] == [("/dev/dfl-port.0",), ("/dev/dfl-port.1",), ("/dev/dfl-port.2",)]
    assert ports[0].attributes["interfaceID"] == "f3c9941350f55b4a896ba05c1c5d6c42"
    assert ports[1].attributes["afuID"] == "850adcc2ceb4b25b9f4e7b2a0ec9e9a5"
    assert ports[0].management_nodes == ("/dev/dfl-fme.0",)
    assert not dfl.problems.items


def test_management_nic_and_virtual_interfaces_are_never_published(mixed):
    _, result = mixed
    interfaces = {d.net_interface for d in result.inventory.devices}
    assert "eno1" not in interfaces
    assert not interfaces & {"lo", "docker0", "veth1a2b3c"}
    assert ("eno1", "carries the node's default route (management NIC)") in result.excluded


def test_names_from_the_pci_id_database_and_vendor_ids_everywhere(built):
    _, result = built("mixed")
    by_name = {d.name: d for d in result.inventory.devices}
    assert by_name["nic-0000-12-00-0"].attributes["productName"] == "MT2910 Family [ConnectX-7]"
    assert by_name["nic-0000-41-00-2"].attributes["productName"] == "ConnectX Family mlx5Gen Virtual Function"
    assert by_name["fpga-0000-31-00-1"].attributes["productName"] == "Alveo U250"
    assert by_name["fpga-0000-32-00-0-port0"].attributes["productName"] == "FPGA Programmable Acceleration Card D5005"
    assert by_name["gpu-0000-11-00-0"].attributes["productName"] == "NVIDIA H100 80GB HBM3", "NVML's name"
    for device in result.inventory.devices:
        assert device.attributes["pciVendorID"] in ("0x10de", "0x10ee", "0x8086", "0x15b3"), device.name
    _, mig = built("a100-mig")
    assert all(d.attributes["pciVendorID"] == "0x10de" for d in mig.inventory.devices
               if d.kind in (DeviceKind.GPU, DeviceKind.MIG))


def test_without_a_pci_id_database_the_name_is_the_ids(tmp_path):
    from dataclasses import replace

    from driver.devices.pciids import PciIds

    node = mock.build(mock.load("sriov"), tmp_path / "m")
    result = discover(replace(node.sources(), pci_ids=PciIds((tmp_path / "no-such-file",))))
    assert {d.attributes["productName"] for d in result.inventory.devices} >= {"15b3:101d", "15b3:101e"}


def test_a_virtio_nic_reports_its_network_driver(tmp_path):
    profile = mock.parse("roots: [{devices: [{type: nic, model: virtio-net}]}]\n", "virtio")
    node = mock.build(profile, tmp_path / "m")
    (nic,) = discover(node.sources()).inventory.devices
    assert nic.attributes["netDriver"] == "virtio_net", "not virtio-pci, the PCI transport"
    assert nic.attributes["productName"] == "Virtio 1.0 network device"
    assert nic.attributes["resource.kubernetes.io/pciBusID"] == "0000:11:00.0"


def test_discover_footer_names_lost_devices_and_nvml_noise_only_matters_with_gpus(tmp_path):
    profile = tmp_path / "lost.yaml"
    profile.write_text("nvidia: {}\nroots: [{devices: [{type: gpu, model: l4}, {type: gpu, model: l4, lost: true}]}]\n")
    proc = subprocess.run([sys.executable, "-m", "driver", "discover", "--mock", str(profile), "--node-name", "n"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    footer = [line for line in proc.stdout.splitlines() if line.startswith("not published:")]
    assert len(footer) == 1 and "gpu" in footer[0].lower() and "lost" in footer[0].lower(), proc.stdout
    quiet = subprocess.run([sys.executable, "-m", "driver", "discover", "--mock", "alveo", "--node-name", "n"],
                           capture_output=True, text=True, timeout=60)
    assert "nvml" not in quiet.stderr.lower(), "a GPU-less node has nothing to say about NVML"


def test_nvml_missing_beside_nvidia_gpus_is_a_warning(tmp_path):
    from driver.devices.discovery import log_result

    node = mock.build(mock.load("l4"), tmp_path / "m")
    result = discover(Sources(node.sysfs, node.proc, None, pci_ids=node.pci_db))
    assert result.nvml_unavailable and result.nvidia_gpus_on_pci == 4
    events = []

    class Log:
        def __getattr__(self, level):
            return lambda event, **fields: events.append((level, event, fields))

    log_result(result, Log())
    assert ("warning", "nvml_unavailable") in [(lvl, ev) for lvl, ev, _ in events]


def test_an_empty_node_publishes_no_slice_and_removes_old_ones(tmp_path):
    from driver.devices.model import Inventory
    from driver.kube.client import Kube, api_client
    from driver.publish.publisher import Publisher
    from driver.sim.apiserver import ApiServer

    _, result = discover_profile("alveo", tmp_path / "m")
    with ApiServer() as api:
        api.add_node("n")
        holder = {"inventory": result.inventory}
        publisher = Publisher(Kube(api_client(api.kubeconfig(tmp_path))), "accel.dra.io", "n",
                              inventory=lambda: holder["inventory"])
        publisher.reconcile()
        assert len(api.slices()) == 1
        holder["inventory"] = Inventory()
        publisher.reconcile()
        assert api.slices() == [] and publisher.stats.published
        api.reset_writes()
        assert publisher.reconcile() == 0 and api.writes() == []
