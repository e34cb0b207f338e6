"""Writes the fake /sys, /dev and /proc trees a mock profile describes.

The layout copies the kernel's: devices under /sys/devices/pci<dom>:<bus>/<root port>/<bdf>,
/sys/bus/pci/devices and /sys/class/* as relative symlinks into it, netdevs under
<bdf>/net/, SR-IOV virtfnN/physfn links, RDMA under <bdf>/infiniband and
/sys/class/infiniband_verbs, DFL regions under <bdf>/fpga_region. Discovery reads it exactly
as it reads a real node.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import struct
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from driver.devices.discovery import Sources
from driver.devices.mock import catalog
from driver.devices.net import NicFilter
from driver.devices.pciids import PciIds
from driver.devices.mock import fakenvml, fpgatools, tools
from driver.devices.mock.fakenvml import FakeGpu, FakeMig, FakeNvmlLibrary
from driver.devices.mock.profile import AlveoSpec, DflSpec, GpuSpec, NicSpec, Profile

_UUID_NS = uuid.UUID("6f1f6c2e-3c55-4c1e-9a59-0c0d1d7b4a10")
# Mock device nodes are character devices with /dev/null's numbers where the process may
# create them (root), so that a real container runtime can inject them; plain files else.
_NULL_DEV = (1, 3)


@dataclass
class MockNode:
    root: Path
    sysfs: Path
    dev: Path
    proc: Path
    nvml: ModuleType  # nvidia-ml-py (pynvml), bound to `library`
    driver_root: Path
    interfaces: list[str] = field(default_factory=list)
    pci_ids: Path | None = None
    library: FakeNvmlLibrary | None = None  # the fake libnvidia-ml.so.1: the GPUs' state

    def sources(self, nic_filter: NicFilter = NicFilter()) -> Sources:
        """Where discovery reads this mock node, as `dra-driver run --mock` does."""
        return Sources(self.sysfs, self.proc, self.nvml, nic_filter, self.pci_db)

    @property
    def pci_db(self) -> PciIds:
        return PciIds((self.pci_ids,) if self.pci_ids else ())


def build(profile: Profile, root: Path) -> MockNode:
    """(Re)create the trees under `root`; anything there before is replaced, except what a
    driver restart does not change on a real node: the boot id (tests simulate a reboot by
    changing that file), the GPUs' settings (gpu-state/, which carry the boot id) and what
    they are doing (gpu-load/)."""
    root = root.absolute()
    boot_id_file = root / "proc" / "sys" / "kernel" / "random" / "boot_id"
    boot_id = boot_id_file.read_text().strip() if boot_id_file.is_file() else str(uuid.uuid4())
    kept = []
    for name in KEPT:
        if (root / name).is_dir():
            aside = root.with_name(f".{root.name}-{name}-{os.getpid()}")
            shutil.rmtree(aside, ignore_errors=True)
            (root / name).rename(aside)
            kept.append((aside, name))
    numbered = _rdma_numbers(root / "sys")
    loaded = _fpga_loaded(root / "sys")
    if root.exists():
        shutil.rmtree(root)
    for aside, name in kept:
        root.mkdir(parents=True, exist_ok=True)
        aside.rename(root / name)
    writer = _Writer(root, numbered)
    writer.write_profile(profile, boot_id)
    for path, text in loaded.items():  # a driver restart does not reprogram a card
        if path.exists():
            path.write_text(text)
    (root / STAMP).write_text(_fingerprint(profile))
    writer.file(root / PCI_IDS, catalog.pci_ids())
    return _node(root, writer, profile)


def _fpga_loaded(sysfs: Path) -> dict[Path, str]:
    """What the FPGAs of the tree being replaced have loaded (Alveo logic_uuids, DFL
    afu_id): a rebuilt tree keeps it, as a card keeps its function over a driver restart."""
    found: dict[Path, str] = {}
    for pattern in ("devices/*/*/*/logic_uuids", "devices/*/*/*/fpga_region/*/dfl-port.*/afu_id"):
        for path in sysfs.glob(pattern):
            try:
                found[path] = path.read_text()
            except OSError:
                continue
    return found


def _rdma_numbers(sysfs: Path) -> dict[str, tuple[int, str]]:
    """PCI function -> (uverbs number, ibdev name) of the tree being replaced. The kernel
    numbers uverbs devices and names RDMA devices (mlx5_N) when they appear, with the lowest
    free number, and never renumbers one that stays: a rebuilt tree keeps them, so that a
    VF added does not look like every later function's RDMA device moving."""
    numbers: dict[str, tuple[int, str]] = {}
    verbs = sysfs / "class" / "infiniband_verbs"
    try:
        entries = os.listdir(verbs)
    except OSError:
        return numbers
    for entry in entries:
        target = verbs / entry
        try:
            ibdev = (target / "ibdev").read_text().strip()
            function = target.resolve().parent.parent.name
        except OSError:
            continue
        if entry.startswith("uverbs") and entry[6:].isdigit():
            numbers[function] = (int(entry[6:]), ibdev)
    return numbers


def _lowest_free(taken: set[int]) -> int:
    number = 0
    while number in taken:
        number += 1
    return number


STAMP = ".profile"
GPU_STATE = "gpu-state"  # driver/devices/mock/gpustate.py
GPU_LOAD = "gpu-load"  # driver/devices/mock/gpuload.py
KEPT = (GPU_STATE, GPU_LOAD)
FPGA_TOOLS = "fpga-tools"  # the fake xbutil and fpgaconf
BITSTREAMS = "bitstreams"  # the mock node's bitstream store
PCI_IDS = Path("usr/share/hwdata/pci.ids")  # below the mock root, as Debian's hwdata has it


def _fingerprint(profile: Profile) -> str:
    return hashlib.sha256(repr(profile).encode()).hexdigest()


def _node(root: Path, writer: "_Writer", profile: Profile) -> MockNode:
    nvml, library = fakenvml.load(writer.gpus, profile.driver_version, profile.cuda_driver_version,
                                  root)
    return MockNode(root, root / "sys", root / "dev", root / "proc", nvml, root / "driver-root",
                    writer.interfaces, root / PCI_IDS, library)


def attach(profile: Profile, root: Path) -> MockNode | None:
    """The tree at `root` as another running driver instance built it, without touching it
    (rebuilding would pull the files from under that instance), or None when it was built
    from another profile. The layout is a pure function of the profile, so it is derived
    again in a scratch directory."""
    root = root.absolute()
    try:
        if (root / STAMP).read_text() != _fingerprint(profile):
            return None
    except OSError:
        return None
    with tempfile.TemporaryDirectory(prefix="dra-mock-layout-") as scratch:
        writer = _Writer(Path(scratch))
        writer.write_profile(profile, "")
    return _node(root, writer, profile)


def _ifname(domain: str, bus: int) -> str:
    """systemd's predictable name for function 0 of a slot: enp23s0f0, enP1p23s0f0."""
    prefix = "enp" if int(domain, 16) == 0 else f"enP{int(domain, 16)}p"
    return f"{prefix}{bus}s0f0"


class _Writer:
    def __init__(self, root: Path, rdma_numbers: dict[str, tuple[int, str]] | None = None) -> None:
        self.sys = root / "sys"
        self.dev = root / "dev"
        self.proc = root / "proc"
        self.driver_root = root / "driver-root"
        self.gpus: list[FakeGpu] = []
        self.interfaces: list[str] = []
        self._mknod_ok = True
        # RDMA numbers the functions had in the tree this one replaces: kept, and not given
        # to a new function (see _rdma_numbers).
        self._rdma_numbers = rdma_numbers or {}
        self._uverbs: set[int] = {n for n, _ in self._rdma_numbers.values()}
        self._rdma_devices = 0
        self._ibdev: dict[str, set[int]] = {}
        for _, name in self._rdma_numbers.values():
            prefix = name.rstrip("0123456789")
            if name[len(prefix):]:
                self._ibdev.setdefault(prefix, set()).add(int(name[len(prefix):]))
        self._render = 128
        self._xclmgmt = 0
        self._dfl_region = 0
        self._dfl_fme = 0
        self._dfl_port = 0
        self._cap_minor = 3

    # -- primitives ------------------------------------------------------------------------
    def file(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")

    def link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, link.parent), link)

    def node(self, path: str) -> None:
        """A device node under the dev tree; `path` is the container path (/dev/...)."""
        target = self.dev / path.removeprefix("/dev/")
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        if self._mknod_ok:
            try:
                os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(*_NULL_DEV))
                return
            except (PermissionError, OSError):
                self._mknod_ok = False
        target.touch()

    def pci_function(
        self, parent: Path, bdf: str, vendor: int, device: int, cls: int,
        driver: str | None, numa: int | None,
    ) -> Path:
        path = parent / bdf
        self.file(path / "vendor", f"0x{vendor:04x}")
        self.file(path / "device", f"0x{device:04x}")
        self.file(path / "subsystem_vendor", f"0x{vendor:04x}")
        self.file(path / "subsystem_device", "0x0000")
        self.file(path / "class", f"0x{cls:06x}")
        self.file(path / "numa_node", str(-1 if numa is None else numa))
        self.link(self.sys / "bus" / "pci" / "devices" / bdf, path)
        if driver:
            drv = self.sys / "bus" / "pci" / "drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            self.link(path / "driver", drv)
        return path

    # -- layout -----------------------------------------------------------------------------
    def write_profile(self, profile: Profile, boot_id: str) -> None:
        self.file(self.proc / "sys" / "kernel" / "random" / "boot_id", boot_id)
        route = ["Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT"]
        if profile.management_nic is not None:
            # Root complex 0000:00 hosts the on-board management NIC.
            root_port = self.root_complex("0000", 0x00) / "0000:00:1c.0"
            self.pci_function(root_port.parent, "0000:00:1c.0", 0x8086, 0xA110, 0x060400, "pcieport", 0)
            name = profile.management_nic.ifname or "eno1"
            self.nic(root_port, "0000:01:00.0", profile.management_nic, 0, name, mgmt=True)
            route.append(f"{name}\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0")
        self.virtual_interfaces()
        for r, root_spec in enumerate(profile.roots):
            domain = f"{r // 15:04x}"
            bus = 0x10 * (r % 15 + 1)
            complex_dir = self.root_complex(domain, bus)
            for j, card in enumerate(root_spec.devices):
                port_bdf = f"{domain}:{bus:02x}:{j + 1:02x}.0"
                port = self.pci_function(complex_dir, port_bdf, 0x8086, 0x352A, 0x060400, "pcieport", root_spec.numa)
                ep_bus = bus + j + 1
                ep = f"{domain}:{ep_bus:02x}:00"
                if isinstance(card, GpuSpec):
                    self.gpu(port, f"{ep}.0", card, root_spec.numa)
                elif isinstance(card, NicSpec):
                    self.nic(port, f"{ep}.0", card, root_spec.numa, card.ifname or _ifname(domain, ep_bus))
                elif isinstance(card, AlveoSpec):
                    self.alveo(port, ep, card, root_spec.numa)
                elif isinstance(card, DflSpec):
                    self.dfl(port, f"{ep}.0", card, root_spec.numa)
        mgmt = (profile.management_nic.ifname or "eno1") if profile.management_nic else None
        self.addresses(route, [i for i in self.interfaces if i != mgmt])
        if self._rdma_devices:
            self.node("/dev/infiniband/rdma_cm")
        if self._xclmgmt or self._dfl_fme:
            self.fpga_files()
        if self.gpus:
            for control in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
                self.node(f"/dev/{control}")
            self.driver_files(profile.driver_version or "")

    def driver_files(self, version: str) -> None:
        """Stand-ins for the driver's user-space files, where a host installation has them."""
        lib = self.driver_root / "usr" / "lib" / "x86_64-linux-gnu"
        for name in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"):
            self.file(lib / f"{name}.{version}", f"mock {name} {version}")
        bin_dir = self.driver_root / "usr" / "bin"
        count = len(self.gpus)
        # nvidia-smi stays a shell script, so that a container (busybox) can run it; the
        # subcommand the driver uses goes to the mock's tool (driver/devices/mock/tools.py).
        # The tree is shared: the driver on the host and the MPS daemon pod (another
        # Python, the image's /opt/dra) run the same scripts, so no interpreter path is
        # written here. The driver process that runs a tool names its own interpreter
        # (tools.PYTHON_VARIABLE); without it, python3 on PATH (the image's /opt/dra/bin).
        tool = f'"${{{tools.PYTHON_VARIABLE}:-python3}}" -m driver.devices.mock.tools'
        root = shlex.quote(str(self.driver_root.parent))
        self.file(bin_dir / "nvidia-smi", "\n".join((
            "#!/bin/sh",
            f'if [ "$1" = compute-policy ]; then exec {tool} --root {root} nvidia-smi "$@"; fi',
            f"echo 'mock nvidia-smi: driver {version}, {count} GPU(s) on the node'",
        )))
        self.file(bin_dir / "nvidia-cuda-mps-control",
                  f'#!/bin/sh\nexec {tool} --root {root} nvidia-cuda-mps-control "$@"')
        for name in ("nvidia-smi", "nvidia-cuda-mps-control"):
            (bin_dir / name).chmod(0o755)

    def fpga_files(self) -> None:
        """The programming tools (fake xbutil and fpgaconf, shell scripts that run the
        mock's tools under the driver's Python, driver/devices/mock/fpgatools.py) and a
        bitstream store with images for every catalog card (docs/fpga.md)."""
        tools_dir = self.sys.parent / FPGA_TOOLS
        # -W: runpy warns that the package (imported first) already holds the module.
        tool = f'"${{{tools.PYTHON_VARIABLE}:-python3}}" -W ignore::RuntimeWarning -m driver.devices.mock.fpgatools'
        root = shlex.quote(str(self.sys.parent))
        for name in ("xbutil", "fpgaconf"):
            self.file(tools_dir / name, f'#!/bin/sh\nexec {tool} --root {root} {name} "$@"')
            (tools_dir / name).chmod(0o755)
        store = self.sys.parent / BITSTREAMS
        for model, alveo in catalog.ALVEO.items():
            for function, payload in fpgatools.MOCK_IMAGES.items():
                self.image(store / alveo.interface_uuid / f"{function}-{model}.xclbin",
                           fpgatools.xclbin(alveo.interface_uuid, fpgatools.function_id(function, model),
                                            alveo.vbnv, payload))
        for model, dfl in catalog.DFL.items():
            interface = str(uuid.UUID(dfl.compat_id))
            for function, payload in fpgatools.MOCK_IMAGES.items():
                self.image(store / interface / f"{function}-{model}.gbs",
                           fpgatools.gbs(interface, fpgatools.function_id(function, model),
                                         f"{function} ({model})", payload))

    def image(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def root_complex(self, domain: str, bus: int) -> Path:
        path = self.sys / "devices" / f"pci{domain}:{bus:02x}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def addresses(self, route: list[str], interfaces: list[str]) -> None:
        """Each data NIC gets 10.<100+n/250>.<n%250>.2/24 and fd00::<n>:0:0:2/64, in the
        files the kernel lists them in (driver/devices/addresses.py reads them). /proc/1/net
        is the host's namespace (driver/devices/net.py); /proc/net as well, as the kernel
        offers it."""
        trie = ["Main:", "  +-- 0.0.0.0/0 3 0 5", "Local:", "  +-- 0.0.0.0/0 3 0 5"]
        inet6 = []
        for n, ifname in enumerate(interfaces):
            third, second = n % 250, 100 + n // 250
            subnet = struct.unpack("<I", bytes((10, second, third, 0)))[0]
            route.append(f"{ifname}\t{subnet:08X}\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0")
            trie += [f"     |-- 10.{second}.{third}.2", "        /32 host LOCAL"]
            inet6.append(f"fd00{n:016x}000000000002 {n + 2:02x} 40 00 80 {ifname}")
        for net in (self.proc / "1" / "net", self.proc / "net"):
            self.file(net / "route", "\n".join(route))
            self.file(net / "fib_trie", "\n".join(trie))
            self.file(net / "if_inet6", "\n".join(inet6))

    def virtual_interfaces(self) -> None:
        for name, mac in (("lo", "00:00:00:00:00:00"), ("docker0", "02:42:ac:11:00:01"),
                          ("veth1a2b3c", "9e:11:22:33:44:55")):
            path = self.sys / "devices" / "virtual" / "net" / name
            self.file(path / "address", mac)
            self.file(path / "mtu", "65536" if name == "lo" else "1500")
            self.file(path / "operstate", "unknown" if name == "lo" else "up")
            self.link(self.sys / "class" / "net" / name, path)

    def gpu(self, port: Path, bdf: str, card: GpuSpec, numa: int | None) -> None:
        model = catalog.GPUS[card.model]
        self.pci_function(port, bdf, 0x10DE, model.pci_device, 0x030200, "nvidia", numa)
        index = len(self.gpus)
        minor = index
        gpu = FakeGpu(
            index=index, minor=minor, uuid=f"GPU-{uuid.uuid5(_UUID_NS, bdf)}", bus_id=bdf,
            product=model.product, brand=model.brand, architecture=model.architecture,
            compute_capability=model.compute_capability,
            memory_bytes=model.memory_mib * catalog.MIB,
            mig_capable=bool(model.mig or model.gi_profiles),
            lost=card.lost, pci_device=model.pci_device, gi_profiles=model.gi_profiles,
            mig_mode_needs_reset=model.mig_mode_needs_reset,
        )
        taken: set[int] = set()  # memory slices of the static instances, first fit
        # As the GPU driver writes it; nvidia-smi's stand-in finds the node's GPUs here.
        self.file(self.proc / "driver" / "nvidia" / "gpus" / bdf / "information",
                  f"Model: \t\t {model.product}\nGPU UUID: \t {gpu.uuid}\nBus Location: \t {bdf}")
        caps = self.proc / "driver" / "nvidia" / "capabilities" / f"gpu{minor}" / "mig"
        for k, profile_name in enumerate(card.mig):
            spec = model.mig[profile_name]
            gi, ci = k + 1, 0
            gi_minor, ci_minor = self._cap_minor, self._cap_minor + 1
            self._cap_minor += 2
            self.file(caps / f"gi{gi}" / "access", f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292")
            self.file(caps / f"gi{gi}" / f"ci{ci}" / "access", f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292")
            self.node(f"/dev/nvidia-caps/nvidia-cap{gi_minor}")
            self.node(f"/dev/nvidia-caps/nvidia-cap{ci_minor}")
            gi_profile = next((g for g in model.gi_profiles if g.name == profile_name), None)
            start, size = 0, 0
            if gi_profile is not None:
                size = gi_profile.memory_slices
                start = next((st for st in gi_profile.starts
                              if not taken & set(range(st, st + size))), 0)
                taken |= set(range(start, start + size))
            gpu.migs.append(FakeMig(
                uuid=f"MIG-{uuid.uuid5(_UUID_NS, f'{bdf}/{gi}/{ci}')}", profile=profile_name,
                gi=gi, ci=ci, memory_bytes=spec.memory_mib * catalog.MIB, slices=spec.slices,
                multiprocessors=spec.multiprocessors, copy_engines=spec.copy_engines,
                decoders=spec.decoders, encoders=spec.encoders, start=start, memory_slices=size,
                gi_profile=gi_profile.index if gi_profile else None,
            ))
        self.gpus.append(gpu)
        self.node(f"/dev/nvidia{minor}")

    def nic(self, port: Path, bdf: str, card: NicSpec, numa: int | None, ifname: str,
            mgmt: bool = False) -> None:
        model = catalog.NICS[card.model]
        pf = self.pci_function(port, bdf, model.vendor, model.pci_device, 0x020000, model.driver, numa)
        if model.net_driver:  # virtio: PCI function -> virtio0 (its own driver) -> net/<if>
            bus_device = pf / "virtio0"
            drv = self.sys / "bus" / "virtio" / "drivers" / model.net_driver
            drv.mkdir(parents=True, exist_ok=True)
            bus_device.mkdir(parents=True, exist_ok=True)
            self.link(bus_device / "driver", drv)
            self.netdev(bus_device, ifname, card, model.speed_mbps, bdf)
        else:
            self.netdev(pf, ifname, card, model.speed_mbps, bdf)
        if model.total_vfs and not mgmt:
            self.file(pf / "sriov_totalvfs", str(model.total_vfs))
            self.file(pf / "sriov_numvfs", str(card.vfs))
        if card.rdma:
            self.rdma(pf)
        domain, bus, _ = bdf.split(":")
        for i in range(card.vfs):
            rid = 2 + i  # VF offset 2, stride 1 (ARI): routing id -> device.function
            vf_bdf = f"{domain}:{bus}:{rid >> 3:02x}.{rid & 7}"
            vf = self.pci_function(port, vf_bdf, model.vendor, model.vf_device or model.pci_device,
                                   0x020000, model.driver, numa)
            self.link(pf / f"virtfn{i}", vf)
            self.link(vf / "physfn", pf)
            self.netdev(vf, f"{ifname}v{i}", card, model.speed_mbps, vf_bdf)
            if card.rdma:
                self.rdma(vf)

    def netdev(self, function: Path, ifname: str, card: NicSpec, speed: int, bdf: str) -> None:
        path = function / "net" / ifname
        mac_seed = uuid.uuid5(_UUID_NS, f"mac-{bdf}").bytes
        mac = ":".join(f"{b:02x}" for b in (0x02,) + tuple(mac_seed[:5]))
        self.file(path / "address", mac)
        self.file(path / "mtu", str(card.mtu))
        self.file(path / "operstate", card.link)
        self.file(path / "speed", str(speed if card.link == "up" else -1))
        self.file(path / "type", "1")
        self.file(path / "dev_port", "0")
        for counter in ("rx_bytes", "tx_bytes"):  # what a test moves to make traffic
            self.file(path / "statistics" / counter, "0")
        self.link(path / "device", function)
        self.link(self.sys / "class" / "net" / ifname, path)
        self.interfaces.append(ifname)

    def rdma(self, function: Path) -> None:
        prefix = "mlx5_" if (function / "driver").resolve().name == "mlx5_core" else "irdma"
        known = self._rdma_numbers.get(function.name)
        if known is not None and known[1].startswith(prefix):
            number, ibdev = known
        else:
            taken = self._ibdev.setdefault(prefix, set())
            index = _lowest_free(taken)
            taken.add(index)
            ibdev = f"{prefix}{index}"
            number = _lowest_free(self._uverbs)
            self._uverbs.add(number)
        (function / "infiniband" / ibdev).mkdir(parents=True)
        uverbs = f"uverbs{number}"
        self._rdma_devices += 1
        verbs = function / "infiniband_verbs" / uverbs
        self.file(verbs / "ibdev", ibdev)
        self.link(self.sys / "class" / "infiniband_verbs" / uverbs, verbs)
        self.node(f"/dev/infiniband/{uverbs}")

    def alveo(self, port: Path, slot: str, card: AlveoSpec, numa: int | None) -> None:
        model = catalog.ALVEO[card.model]
        mgmt = self.pci_function(port, f"{slot}.0", 0x10EE, model.mgmt_device, 0x120000, "xclmgmt", numa)
        user = self.pci_function(port, f"{slot}.1", 0x10EE, model.user_device, 0x120000, "xocl", numa)
        instance = self._xclmgmt
        self._xclmgmt += 1
        self.file(mgmt / "instance", str(instance))
        self.file(mgmt / "rom.0" / "VBNV", model.vbnv)
        self.file(mgmt / "rom.0" / "FPGA", model.part)
        render = self._render
        self._render += 1
        (user / "drm" / f"renderD{render}").mkdir(parents=True)
        (user / "drm" / f"card{render - 128}").mkdir(parents=True)
        self.file(user / "interface_uuids", model.interface_uuid)
        self.file(user / "logic_uuids", str(uuid.uuid5(_UUID_NS, f"logic-{slot}")))
        self.node(f"/dev/dri/renderD{render}")
        self.node(f"/dev/xclmgmt{instance}")

    def dfl(self, port: Path, bdf: str, card: DflSpec, numa: int | None) -> None:
        model = catalog.DFL[card.model]
        function = self.pci_function(port, bdf, 0x8086, model.pci_device, 0x120000, "dfl-pci", numa)
        region = function / "fpga_region" / f"region{self._dfl_region}"
        self.link(self.sys / "class" / "fpga_region" / region.name, region)
        self._dfl_region += 1
        fme = region / f"dfl-fme.{self._dfl_fme}"
        self._dfl_fme += 1
        self.file(fme / "bitstream_id", model.bitstream_id)
        pr_region = fme / f"dfl-fme-region.{self._dfl_fme}" / "fpga_region" / f"region{self._dfl_region}"
        self.file(pr_region / "compat_id", model.compat_id)
        self.link(self.sys / "class" / "fpga_region" / pr_region.name, pr_region)
        self._dfl_region += 1
        self.node(f"/dev/{fme.name}")
        for _ in range(card.ports):
            port_dir = region / f"dfl-port.{self._dfl_port}"
            self._dfl_port += 1
            self.file(port_dir / "afu_id", card.afu_id)
            self.node(f"/dev/{port_dir.name}")
