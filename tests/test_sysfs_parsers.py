"""Discovery over broken or unusual sysfs/NVML input: the affected device is skipped or
published without the bad detail, with a problem that names it; the others are untouched."""

from __future__ import annotations

import os
import shutil
import tarfile

import pytest

from driver.devices import mock, pci
from driver.devices.discovery import Sources, discover
from driver.devices.mock import fakenvml
from driver.devices.mock.fakenvml import FakeGpu
from driver.devices.model import PCIE_ROOT, DeviceKind
from driver.devices.net import NicFilter, NicSelector
from tests.conftest import REPO, discover_profile

SNAPSHOT = REPO / "tests" / "data" / "sysfs" / "linux-amd64-accel-nvidia.tar.gz"


def rediscover(node, nic_filter=NicFilter()):
    return discover(node.sources(nic_filter))


def messages(result, device):
    return [p.message for p in result.problems if p.device == device]


def pci_dir(node, bdf):
    return (node.sysfs / "bus" / "pci" / "devices" / bdf).resolve()


@pytest.fixture
def snapshot_sys(tmp_path):
    with tarfile.open(SNAPSHOT) as tar:
        tar.extractall(tmp_path, filter="tar")
    return tmp_path / "sys"


def test_real_snapshot_topology(snapshot_sys):
    gpu = pci.read_function(snapshot_sys, "0000:06:00.0")
    assert gpu.pcie_root == "pci0000:00"  # the root complex, not the root port 0000:00:01.5
    assert gpu.numa_node is None  # -1 is "unknown", never node 0
    assert gpu.class_code >> 8 == 0x0302 and gpu.vendor == 0x10DE and gpu.device == 0x15F8
    nic = pci.read_function(snapshot_sys, "0000:05:00.0")
    assert nic.class_code >> 8 == 0x0200


def test_nvml_gpu_on_real_snapshot(snapshot_sys, tmp_path):
    gpu = FakeGpu(index=0, minor=0, uuid="GPU-11111111-2222-3333-4444-555555555555",
                  bus_id="0000:06:00.0", product="Tesla P100-PCIE-16GB", brand=2, architecture=4,
                  compute_capability=(6, 0), memory_bytes=16 << 30, mig_capable=False)
    nvml, _ = fakenvml.load([gpu], "470.57.02", 11040)
    result = discover(Sources(snapshot_sys, tmp_path, nvml))
    (device,) = result.inventory.devices
    assert device.name == "gpu-0000-06-00-0"
    assert device.attributes[PCIE_ROOT] == "pci0000:00"
    assert device.attributes["resource.kubernetes.io/pciBusID"] == "0000:06:00.0"
    assert "numaNode" not in device.attributes
    assert device.attributes["brand"] == "Tesla" and device.attributes["architecture"] == "Pascal"
    assert device.attributes["pciDeviceID"] == "0x15f8"


def test_missing_vendor_file_skips_that_nic_only(tmp_path):
    node, before = discover_profile("mixed", tmp_path / "m")
    os.remove(pci_dir(node, "0000:41:00.3") / "vendor")
    after = rediscover(node)
    assert after.inventory.get("nic-0000-41-00-3") is None
    assert any("0000:41:00.3" in m and "vendor" in m for m in messages(after, "enp65s0f0v1"))
    assert len(after.inventory.devices) == len(before.inventory.devices) - 1


@pytest.mark.parametrize("content", ["-1", "garbage", ""])
def test_bad_numa_node_is_unknown_not_zero(tmp_path, content):
    node, _ = discover_profile("mixed", tmp_path / "m")
    (pci_dir(node, "0000:12:00.0") / "numa_node").write_text(content)
    nic = rediscover(node).inventory.get("nic-0000-12-00-0")
    assert nic is not None and nic.pci.numa_node is None and "numaNode" not in nic.attributes


def test_unreadable_speed_and_mtu(tmp_path):
    node, _ = discover_profile("mixed", tmp_path / "m")
    net = node.sysfs / "class" / "net" / "enp18s0f0"
    speed = net.resolve() / "speed"
    speed.unlink()
    speed.mkdir()  # reading a directory fails like EINVAL on a down link
    (net.resolve() / "mtu").write_text("not-a-number")
    result = rediscover(node)
    nic = result.inventory.get("nic-0000-12-00-0")
    assert "speedMbps" not in nic.attributes and "mtu" not in nic.attributes
    assert nic.attributes["ifName"] == "enp18s0f0"
    assert messages(result, "nic-0000-12-00-0") == ["interface enp18s0f0: mtu unreadable"]


def test_dangling_symlinks(tmp_path):
    node, before = discover_profile("mixed", tmp_path / "m")
    # A netdev whose device link points nowhere, and a PCI entry pointing nowhere.
    ghost = node.sysfs / "devices" / "pci0000:50" / "0000:50:01.0" / "0000:51:00.0" / "net" / "ghost0"
    ghost.mkdir(parents=True)
    os.symlink("../../../0000:51:00.9", ghost / "device")
    os.symlink(os.path.relpath(ghost, node.sysfs / "class" / "net"), node.sysfs / "class" / "net" / "ghost0")
    os.symlink("../../../devices/pci0000:99/0000:99:00.0", node.sysfs / "bus" / "pci" / "devices" / "0000:99:00.0")
    after = rediscover(node)
    assert [d.name for d in after.inventory.devices] == [d.name for d in before.inventory.devices]
    assert any("dangling" in m for m in messages(after, "ghost0"))
    assert messages(after, "0000:99:00.0"), "the broken PCI entry is reported by address"


def test_lost_gpu_is_skipped_and_others_kept(tmp_path):
    profile = mock.parse("""
nvidia: {driverVersion: "550.54.15", cudaDriverVersion: 12040}
roots:
  - devices:
      - {type: gpu, model: l4}
      - {type: gpu, model: l4, lost: true}
      - {type: gpu, model: l4}
""", "lost.yaml")
    node, result = discover_profile(profile, tmp_path / "m")
    assert [d.name for d in result.inventory.devices] == ["gpu-0000-11-00-0", "gpu-0000-13-00-0"]
    assert "GPU is lost" in messages(result, "gpu index 1")[0]


def test_not_supported_fields_become_missing_attributes(tmp_path):
    node, _ = discover_profile("l4", tmp_path / "m")

    node.library.unsupported |= {"nvmlDeviceGetBrand", "nvmlDeviceGetArchitecture"}
    result = rediscover(node)
    gpus = result.inventory.by_kind(DeviceKind.GPU)
    assert len(gpus) == 4
    assert all("brand" not in g.attributes and "architecture" not in g.attributes for g in gpus)
    assert all(g.attributes["productName"] == "NVIDIA L4" for g in gpus)


def test_no_nvml_library_means_no_gpus_not_a_crash(tmp_path):
    node, _ = discover_profile("l4", tmp_path / "m")
    node.library.driver_version = None  # nvmlInit -> LibraryNotFound, as on a node without a driver
    result = rediscover(node)
    assert result.inventory.by_kind(DeviceKind.GPU) == ()
    assert result.inventory.get("nic-0000-31-00-0") is not None
    assert "Not Found" in result.nvml_unavailable
    assert not result.problems.items
    assert discover(Sources(node.sysfs, node.proc, None)).nvml_unavailable


def test_gpu_without_sysfs_entry_is_published_without_topology(tmp_path):
    node, _ = discover_profile("l4", tmp_path / "m")
    os.remove(node.sysfs / "bus" / "pci" / "devices" / "0000:11:00.0")
    result = rediscover(node)
    gpu = result.inventory.get("gpu-0000-11-00-0")
    assert PCIE_ROOT not in gpu.attributes and gpu.attributes["resource.kubernetes.io/pciBusID"] == "0000:11:00.0"
    assert "pcieRoot and NUMA unknown" in messages(result, "gpu-0000-11-00-0")[0]


def test_mig_with_missing_capability_file_skips_that_mig(tmp_path):
    node, before = discover_profile("a100-mig", tmp_path / "m")
    shutil.rmtree(node.proc / "driver" / "nvidia" / "capabilities" / "gpu1" / "mig" / "gi2")
    after = rediscover(node)
    assert after.inventory.get("mig-0000-12-00-0-gi2-ci0") is None
    assert after.inventory.get("mig-0000-12-00-0-gi1-ci0") is not None
    assert any("gi2" in m for p in after.problems for m in [p.message])
    assert len(after.inventory.devices) == len(before.inventory.devices) - 1


def test_overlong_and_garbage_fpga_identity(tmp_path):
    node, _ = discover_profile("alveo", tmp_path / "m")
    mgmt = pci_dir(node, "0000:11:00.0")
    (mgmt / "rom.0" / "VBNV").write_text("x" * 80)
    (mgmt / "instance").write_text("??")
    result = rediscover(node)
    card = result.inventory.get("fpga-0000-11-00-1")
    assert "shell" not in card.attributes and card.management_nodes == ()
    assert any("shell" in m for m in messages(result, "fpga-0000-11-00-1"))
    assert any("instance" in m for m in messages(result, "fpga-0000-11-00-1"))


def test_alveo_without_render_node_or_user_function(tmp_path):
    node, _ = discover_profile("alveo", tmp_path / "m")
    shutil.rmtree(pci_dir(node, "0000:11:00.1") / "drm")
    os.remove(pci_dir(node, "0000:12:00.1") / "driver")
    result = rediscover(node)
    assert [d.name for d in result.inventory.devices] == ["fpga-0000-21-00-1"]
    assert "no DRM render node" in messages(result, "fpga 0000:11:00")[0]
    assert "no user function bound to xocl" in messages(result, "fpga 0000:12:00")[0]


def test_dfl_without_compat_id_is_published_and_noted(tmp_path):
    node, _ = discover_profile("dfl", tmp_path / "m")
    (compat,) = pci_dir(node, "0000:11:00.0").rglob("compat_id")
    compat.unlink()
    result = rediscover(node)
    assert len(result.inventory.devices) == 3
    first = result.inventory.devices[0]
    assert "interfaceID" not in first.attributes
    assert messages(result, first.name) == ["no compat_id: bitstream compatibility unknown"]


def test_nic_filters(tmp_path):
    node, _ = discover_profile("mixed", tmp_path / "m")
    only_cx6 = rediscover(node, NicFilter(include=(NicSelector.parse("pci=0000:41:*"),)))
    assert {d.net_interface for d in only_cx6.inventory.by_kind(DeviceKind.NIC)} == \
        {"enp65s0f0", "enp65s0f0v0", "enp65s0f0v1", "enp65s0f0v2", "enp65s0f0v3"}
    no_vfs = rediscover(node, NicFilter(exclude=(NicSelector.parse("*v[0-9]*"),)))
    assert len(no_vfs.inventory.by_kind(DeviceKind.NIC)) == 3
    no_mellanox = rediscover(node, NicFilter(exclude=(NicSelector.parse("vendor=15B3"),)))
    assert no_mellanox.inventory.by_kind(DeviceKind.NIC) == ()
    with_mgmt = rediscover(node, NicFilter(exclude_default_route=False))
    assert "eno1" in {d.net_interface for d in with_mgmt.inventory.devices}
    # Exclusion wins over inclusion.
    both = rediscover(node, NicFilter(include=(NicSelector.parse("enp18s0f0"),),
                                      exclude=(NicSelector.parse("enp18*"),)))
    assert both.inventory.by_kind(DeviceKind.NIC) == ()


@pytest.mark.parametrize("bad", ["vendor=xyz", "color=red", "pci="])
def test_bad_nic_selector(bad):
    with pytest.raises(ValueError, match="NIC selector"):
        NicSelector.parse(bad)


def test_unreadable_routes_fail_closed(tmp_path):
    """Without a routing table any NIC might carry the default route: none is published
    (one error event, a metric) unless the operator allows it."""
    from prometheus_client import generate_latest

    from driver.devices.discovery import log_result
    from driver.metrics import Metrics

    node, before = discover_profile("mixed", tmp_path / "m")
    assert any(d.kind is DeviceKind.NIC for d in before.inventory.devices)
    for table in (node.proc / "1" / "net" / "route", node.proc / "net" / "route"):
        table.unlink()
    result = rediscover(node)
    assert not any(d.kind is DeviceKind.NIC for d in result.inventory.devices)
    assert result.nics_withheld_routing_unknown == 8
    assert all("routing table cannot be read" in reason for _, reason in result.excluded)
    assert any(d.kind is DeviceKind.GPU for d in result.inventory.devices), "other kinds unaffected"

    events = []

    class Log:
        def __getattr__(self, level):
            return lambda event, **fields: events.append((level, event, fields))

    log_result(result, Log())
    withheld = [e for e in events if e[1] == "nics_withheld"]
    assert len(withheld) == 1 and withheld[0][0] == "error" and withheld[0][2]["count"] == 8
    assert not [e for e in events if e[1] == "nic_excluded"], "said once, not per NIC"
    events.clear()
    log_result(result, Log(), previous=result)
    assert not [e for e in events if e[1] == "nics_withheld"], "not repeated every rediscovery"

    metrics = Metrics("accel.dra.io")
    metrics.watch_state(lambda: 0, lambda: {}, lambda: {}, lambda: result.nics_withheld_routing_unknown)
    assert b"dra_driver_nics_withheld_routing_unknown 8.0" in generate_latest(metrics.registry)

    allowed = rediscover(node, NicFilter(exclude_default_route=False))
    nics = {d.net_interface for d in allowed.inventory.devices if d.kind is DeviceKind.NIC}
    assert len(nics) == 8 and "eno1" in nics, "all of them, the management NIC too"
