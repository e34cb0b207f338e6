"""What a container gets for one prepared device: device nodes, env, network devices.

Edits are always derived from the device as discovered now, never replayed from an old
record: after a reboot a GPU's minor number or an RDMA device's uverbs index can change.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from driver.devices.bitstreams import canonical_uuid
from driver.prepare.cdi import ContainerEdits, DeviceNode, Mount, NetDevice
from driver.devices.model import PCI_BUS_ID, Device, DeviceKind
from driver.devices.nvml import CONTROL_NODES
from driver.prepare.opaque import DeviceConfig, FpgaConfig, NicConfig


class EditsError(ValueError):
    pass


# NVIDIA's container runtime and hook select GPUs by this variable (see build()).
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# A DFL port with no AFU loaded shows an all-zero afu_id (and a cleared region the same).
ZERO_UUID = "00000000-0000-0000-0000-000000000000"


def env_prefix(device_name: str) -> str:
    """`gpu-0000-17-00-0` -> `DRA_GPU_0000_17_00_0`: unique per node, so two devices in one
    container never overwrite each other's variables."""
    return "DRA_" + device_name.upper().replace("-", "_")


def host_path(dev_root: Path, container_path: str) -> str:
    path = PurePosixPath(container_path)
    if not path.is_absolute() or path.parts[:2] != ("/", "dev") or ".." in path.parts:
        raise EditsError(f"device node {container_path!r} is not below /dev")
    return str(dev_root.joinpath(*path.parts[2:]))


def build(
    device: Device,
    config: DeviceConfig,
    *,
    claim: str,  # "namespace/name"
    request: str,
    dev_root: Path,
    driver_mounts: tuple[Mount, ...] = (),
    admin_access: bool = False,
    cdi_net_devices: bool = True,
) -> ContainerEdits:
    """`cdi_net_devices=False`: a moved NIC is not written as CDI netDevices, because the
    driver's NRI plugin moves it (driver/nri/); the runtime must not try as well."""
    prefix = env_prefix(device.name)
    env = [f"{prefix}_CLAIM={claim}", f"{prefix}_REQUEST={request}"]
    if admin_access:
        # The device may be in use by another claim's pod at the same time: say so, so
        # that monitoring tools do not reset or reconfigure it.
        env.append(f"{prefix}_ADMIN_ACCESS=true")
    if device.pci is not None:
        env.append(f"{prefix}_PCI_BUS_ID={device.attributes.get(PCI_BUS_ID, device.pci.bus_id)}")
    nodes = list(device.device_nodes)
    net: list[NetDevice] = []
    mounts: tuple[Mount, ...] = ()

    if device.kind in (DeviceKind.GPU, DeviceKind.MIG):
        env.append(f"{prefix}_UUID={device.attributes.get('uuid', '')}")
        # Where nvidia-container-runtime is the node's runtime (the GPU operator's setup),
        # it reads NVIDIA_VISIBLE_DEVICES from the spec the CDI edits produced and injects
        # those GPUs on top; every CUDA image sets it to `all`, which would hand the
        # container every GPU of the node. `void` (CDI's env edit replaces the image's
        # value) makes it inject nothing, as NVIDIA's own DRA driver does
        # (docs/migrating-from-device-plugin.md; tests/test_nvidia_ctk.py).
        env.append(f"{VISIBLE_DEVICES}=void")
        # Control nodes are node-wide; nvidia-uvm exists only once the module is loaded.
        nodes += [n for n in CONTROL_NODES if Path(host_path(dev_root, n)).exists()]
        mounts = driver_mounts
    elif device.kind is DeviceKind.FPGA:
        if "interfaceID" in device.attributes:
            env.append(f"{prefix}_INTERFACE_ID={device.attributes['interfaceID']}")
        # The function the region holds as prepare left it (read from sysfs after any
        # programming, driver/prepare/fpgaprogram.py), in the form FpgaConfig.function
        # names it: a workload checks it is the one it was built for before it enqueues
        # work, without reading the host's sysfs, which a container may not see.
        loaded = canonical_uuid(str(device.attributes.get("logicUUID") or device.attributes.get("afuID") or ""))
        if loaded is not None and loaded != ZERO_UUID:
            env.append(f"{prefix}_FUNCTION_ID={loaded}")
        if isinstance(config, FpgaConfig) and config.managementAccess:
            if not device.management_nodes:
                raise EditsError(f"FPGA {device.name} has no management node to grant")
            nodes += device.management_nodes
    elif device.kind is DeviceKind.NIC:
        nic = config if isinstance(config, NicConfig) else NicConfig()
        if not nic.rdma:
            nodes = []
        if device.attributes.get("rdmaDevice") and nic.rdma:
            env.append(f"{prefix}_RDMA_DEVICE={device.attributes['rdmaDevice']}")
        ifname = device.net_interface or ""
        inside = nic.interfaceName or ifname
        env.append(f"{prefix}_IFNAME={inside if nic.moveInterface else ifname}")
        if nic.moveInterface:
            if admin_access:
                raise EditsError(f"NIC {device.name} is allocated with admin access and may be "
                                 "in use by another claim: moveInterface would take it away")
            if not ifname:
                raise EditsError(f"NIC {device.name} has no network interface to move")
            if cdi_net_devices:
                if nic.addresses or nic.mtu is not None or nic.routes:
                    # CDI netDevices carry a name only: the settings would be dropped.
                    raise EditsError(f"NIC {device.name}: addresses, mtu and routes are set by "
                                     "the driver's NRI plugin, which is off on this node "
                                     "(--nri-socket; chart value nri.enabled)")
                net.append(NetDevice(ifname, inside))

    env += [f"{key}={value}" for key, value in sorted(config.env.items())]
    seen: set[str] = set()
    device_nodes = []
    for node in nodes:
        if node not in seen:
            seen.add(node)
            device_nodes.append(DeviceNode(node, host_path(dev_root, node)))
    return ContainerEdits(env=tuple(env), device_nodes=tuple(device_nodes), net_devices=tuple(net),
                          mounts=mounts)
