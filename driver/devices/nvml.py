"""NVIDIA GPUs and MIG devices through NVML (`nvidia-ml-py`, imported as `pynvml`).

The module object is passed in: the real `pynvml` on a node; in mock mode a private copy
of the same nvidia-ml-py bound to a fake libnvidia-ml.so.1 (driver/devices/mock/fakenvml.py).
Every call goes through nvidia-ml-py's own wrappers either way, so this file has no
mock-specific branch.

Older drivers lack newer functions (nvidia-ml-py raises NVMLError_FunctionNotFound): what
they would tell us is left out, said once per function, and discovery goes on.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import structlog

from driver.kube import names
from driver.devices import migdynamic, nvlibs, pci
from driver.devices.model import AttributeSet, Device, DeviceKind, PciLocation
from driver.devices.problems import DeviceError, Problems

T = TypeVar("T")

ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
    8: "Ada", 9: "Hopper", 10: "Blackwell", 13: "Rubin",
}
BRANDS = {
    1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
    12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

_MIG_NAME = re.compile(r"\bMIG\s+(\S+)$")
_CAP_MINOR = re.compile(r"DeviceFileMinor:\s*(\d+)")


def load_nvml(driver_root: Path = Path("/")) -> Any | None:
    """The real NVML binding, or None when the Python package itself is missing.

    libnvidia-ml.so.1 is loaded by absolute path from the driver installation (`driver_root`,
    as this process sees it) before nvmlInit, which then finds it loaded. The alternative,
    the installation's library folders on LD_LIBRARY_PATH, breaks every process of the
    container: those folders hold the host's glibc too, and the image's loader then loads
    it and dies with "symbol lookup error ... GLIBC_PRIVATE" wherever the two differ.
    Without the library under the root, nvidia-ml-py's own lookup (the loader's default
    path) stays, so a host install with the driver in the usual place works as before."""
    try:
        import pynvml  # noqa: PLC0415 - optional at import time by design
    except ImportError:
        return None
    bind_library(pynvml, driver_root)
    return pynvml


def bind_library(nv: Any, driver_root: Path) -> Path | None:
    """Load libnvidia-ml.so.1 of the installation at `driver_root` into the binding `nv`
    unless it has a library already; the library loaded now, else None. Called again before
    each discovery: the GPU operator's driver container may install the library long after
    this process started (after its start-up wait gave up), and nvidia-ml-py's own lookup,
    the loader's default path, never looks under the driver root."""
    if getattr(nv, "nvmlLib", None) is not None:
        return None
    library = nvlibs.locate(driver_root, "libnvidia-ml.so.1")
    if library is None:
        return None
    try:
        nv.nvmlLib = ctypes.CDLL(str(library))
    except OSError as err:
        # nvmlInit then fails with LIBRARY_NOT_FOUND, which discovery reports; this says why.
        structlog.get_logger(component="nvml").warning(
            "nvml_library_unloadable", library=str(library), error=str(err))
        return None
    return library


def memory_quantity(total_bytes: int) -> str:
    mib, rest = divmod(int(total_bytes), 1 << 20)
    return f"{mib}Mi" if rest == 0 else str(int(total_bytes))


def cuda_version(encoded: int) -> str:
    """NVML encodes CUDA 12.4 as 12040."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}.0"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_handles(nv: Any, parent: Any) -> Iterator[tuple[int, Any]]:
    """(slot, handle) of every MIG device of a GPU; empty slots are skipped."""
    for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            yield slot, nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
        except nv.NVMLError_NotFound:
            continue


class NvmlDiscovery:
    def __init__(self, nvml: Any, sysfs: Path, proc: Path, mig_mode: str = "static",
                 owned: Callable[[], set[tuple[str, int]]] = set,
                 mig_profiles: frozenset[str] = frozenset()) -> None:
        self.nvml = nvml
        self.sysfs = sysfs
        self.proc = proc
        self.mig_mode = mig_mode  # "static": MIG devices as they exist; "dynamic": partitions
        self.owned = owned  # (GPU UUID, GPU instance id) of instances this driver created
        self.mig_profiles = mig_profiles  # dynamic MIG: the profiles offered; empty: all
        self.counter_sets: dict[str, dict[str, str]] = {}
        self.unavailable: str | None = None  # why NVML could not be used, if it could not
        self.driver_version: str | None = None  # as NVML says it ("535.104.05"): file names use it
        self.missing: set[str] = set()  # NVML functions this driver's library does not have

    def discover(self, problems: Problems) -> list[Device]:
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            # No driver (libnvidia-ml.so.1 missing) is the normal case on NIC/FPGA nodes:
            # not a problem, just no GPUs.
            self.unavailable = str(err)
            return []
        try:
            return self._discover(problems)
        finally:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        """A property some GPUs lack (NotSupported), or that the installed driver's NVML
        does not have yet (FunctionNotFound), becomes a missing attribute."""
        try:
            return fn(*args)
        except self.nvml.NVMLError_NotSupported:
            return None
        except self.nvml.NVMLError_FunctionNotFound:
            self.missing.add(fn.__name__)
            return None

    def _discover(self, problems: Problems) -> list[Device]:
        nv = self.nvml
        driver_version = self._optional(nv.nvmlSystemGetDriverVersion)
        cuda = self._optional(nv.nvmlSystemGetCudaDriverVersion)
        self.driver_version = _text(driver_version) if driver_version else None
        common = {
            "driverVersion": self.driver_version,
            "cudaDriverVersion": cuda_version(cuda) if cuda else None,
        }
        devices: list[Device] = []
        self.missing.clear()
        for index in range(nv.nvmlDeviceGetCount()):
            where = f"gpu index {index}"
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                devices.extend(self._gpu(handle, index, common, problems))
            except nv.NVMLError_GpuIsLost:
                problems.skip(where, "GPU is lost (fallen off the bus); not published")
            except nv.NVMLError as err:
                problems.skip(where, f"NVML error: {err}")
            except (DeviceError, ValueError) as err:
                problems.skip(where, str(err))
        if self.missing:
            problems.note("nvml", f"NVML of driver {self.driver_version} lacks "
                                  f"{', '.join(sorted(self.missing))}: what they report is not published")
        return devices

    def _location(self, handle: Any) -> tuple[PciLocation, pci.PciFunction | None]:
        raw = _text(self.nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
        bdf = raw[-12:]  # NVML: "00000000:17:00.0"; sysfs: "0000:17:00.0"
        if not pci.BDF.match(bdf):
            raise DeviceError(f"NVML returned an unusable PCI bus id {raw!r}")
        try:
            function = pci.read_function(self.sysfs, bdf)
        except DeviceError:
            return PciLocation(bdf, None, None), None
        return function.location, function

    def _gpu(self, handle: Any, index: int, common: dict, problems: Problems) -> list[Device]:
        nv = self.nvml
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
        location, function = self._location(handle)
        name = names.label_from_pci("gpu", location.bus_id)
        if function is None:
            problems.note(name, f"no sysfs entry for {location.bus_id}: pcieRoot and NUMA unknown")
        minor = nv.nvmlDeviceGetMinorNumber(handle)
        product = _text(nv.nvmlDeviceGetName(handle))
        attrs = AttributeSet(name)
        attrs.set("type", "gpu")
        attrs.set("uuid", uuid)
        attrs.set("productName", product)
        attrs.set("brand", BRANDS.get(self._optional(nv.nvmlDeviceGetBrand, handle) or 0))
        arch = self._optional(nv.nvmlDeviceGetArchitecture, handle)
        attrs.set("architecture", ARCHITECTURES.get(arch) if arch is not None else None)
        cc = self._optional(nv.nvmlDeviceGetCudaComputeCapability, handle)
        attrs.version("cudaComputeCapability", f"{cc[0]}.{cc[1]}" if cc else None)
        attrs.version("driverVersion", common["driverVersion"])
        attrs.version("cudaDriverVersion", common["cudaDriverVersion"])
        attrs.set("index", index)
        attrs.set("minor", minor)
        if function is not None:
            attrs.set("pciVendorID", pci.hex_id(function.vendor))
            attrs.set("pciDeviceID", pci.hex_id(function.device))
        attrs.pci(location)

        if self.mig_mode == "dynamic":
            offer = self._dynamic(handle, name, uuid, minor, attrs, location, product, arch, problems)
            if offer is not None:
                return offer
        mig_devices = self._mig_devices(handle, name, uuid, minor, attrs.values, location, problems)
        if mig_devices is not None:
            # A GPU in MIG mode is published only as its MIG devices: advertising the whole
            # GPU too would let the scheduler hand it out twice.
            return mig_devices

        for dropped in attrs.dropped:
            problems.note(name, f"attribute dropped: {dropped}")
        memory = nv.nvmlDeviceGetMemoryInfo(handle).total
        return [
            Device(
                name=name,
                kind=DeviceKind.GPU,
                attributes=attrs.values,
                capacity={"memory": memory_quantity(memory)},
                device_nodes=(f"/dev/nvidia{minor}",),
                pci=location,
                model=product,
            )
        ]

    def _dynamic(self, handle: Any, name: str, uuid: str, minor: int, attrs: AttributeSet,
                 location: PciLocation, product: str, arch: int | None,
                 problems: Problems) -> list[Device] | None:
        """Dynamic MIG (driver/devices/migdynamic.py): the GPU's possible partitions."""
        nv = self.nvml
        mode = self._optional(nv.nvmlDeviceGetMigMode, handle)
        if mode is None:
            return None  # not MIG-capable
        enabled = mode[0] == nv.NVML_DEVICE_MIG_ENABLE
        memory = nv.nvmlDeviceGetMemoryInfo(handle).total
        whole = Device(name=name, kind=DeviceKind.GPU, attributes=attrs.values,
                       capacity={"memory": memory_quantity(memory)},
                       device_nodes=(f"/dev/nvidia{minor}",), pci=location, model=product)
        occupied: set[int] = set()
        created: set[tuple[int, int]] = set()
        partitions = migdynamic.profiles(nv, handle)
        if enabled:
            owned = self.owned()
            for profile_id in {p.profile_id for p in partitions}:
                for info in self._gpu_instances(handle, profile_id):
                    if (uuid, info.id) in owned:
                        created.add((profile_id, info.placement.start))
                    else:
                        occupied |= set(range(info.placement.start,
                                              info.placement.start + info.placement.size))
        offer = migdynamic.partition_devices(partitions, whole, minor, location, occupied,
                                             problems, enabled, arch, self.mig_profiles,
                                             frozenset(created))
        if offer is None:
            return None
        devices, sets = offer
        self.counter_sets.update(sets)
        return devices

    def _gpu_instances(self, handle: Any, profile_id: int) -> list[Any]:
        nv = self.nvml
        array = (nv.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint(8)
        nv.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
        return [nv.nvmlGpuInstanceGetInfo(array[i]) for i in range(count.value)]

    def _mig_devices(
        self,
        parent: Any,
        parent_name: str,
        parent_uuid: str,
        parent_minor: int,
        parent_attrs: dict,
        location: PciLocation,
        problems: Problems,
    ) -> list[Device] | None:
        nv = self.nvml
        mode = self._optional(nv.nvmlDeviceGetMigMode, parent)  # older than MIG: no MIG
        if mode is None:
            return None
        current, _pending = mode
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            return None
        devices: list[Device] = []
        for slot, handle in mig_handles(nv, parent):
            try:
                devices.append(
                    self._mig(handle, parent_name, parent_uuid, parent_minor, parent_attrs, location)
                )
            except (nv.NVMLError, DeviceError, ValueError) as err:
                problems.skip(f"{parent_name} MIG slot {slot}", str(err))
        if not devices:
            problems.note(parent_name, "MIG mode is enabled but no MIG devices exist")
        return devices

    def _mig(
        self,
        handle: Any,
        parent_name: str,
        parent_uuid: str,
        parent_minor: int,
        parent_attrs: dict,
        location: PciLocation,
    ) -> Device:
        nv = self.nvml
        gi = nv.nvmlDeviceGetGpuInstanceId(handle)
        ci = nv.nvmlDeviceGetComputeInstanceId(handle)
        info = nv.nvmlDeviceGetAttributes(handle)
        full_name = _text(nv.nvmlDeviceGetName(handle))
        match = _MIG_NAME.search(full_name)
        profile = (
            match.group(1)
            if match
            else f"{info.gpuInstanceSliceCount}g.{round(info.memorySizeMB / 1024)}gb"
        )
        name = f"mig-{parent_name.removeprefix('gpu-')}-gi{gi}-ci{ci}"
        attrs = AttributeSet(name)
        attrs.set("type", "mig")
        attrs.set("uuid", _text(nv.nvmlDeviceGetUUID(handle)))
        attrs.set("parentUUID", parent_uuid)
        attrs.set("profile", profile)
        for key in ("productName", "brand", "architecture", "cudaComputeCapability",
                    "driverVersion", "cudaDriverVersion", "index", "minor", "pciVendorID",
                    "pciDeviceID"):
            if key in parent_attrs:
                attrs.set("parentIndex" if key == "index" else
                          "parentMinor" if key == "minor" else key, parent_attrs[key])
        attrs.set("gpuInstanceID", gi)
        attrs.set("computeInstanceID", ci)
        attrs.pci(location)
        memory = nv.nvmlDeviceGetMemoryInfo(handle).total
        capacity = {
            "memory": memory_quantity(memory),
            "multiprocessors": str(info.multiprocessorCount),
            "copyEngines": str(info.sharedCopyEngineCount),
            "decoders": str(info.sharedDecoderCount),
            "encoders": str(info.sharedEncoderCount),
        }
        caps = self._mig_caps(parent_minor, gi, ci)
        return Device(
            name=name,
            kind=DeviceKind.MIG,
            attributes=attrs.values,
            capacity=capacity,
            device_nodes=(f"/dev/nvidia{parent_minor}", *caps),
            pci=location,
            model=f"{parent_attrs.get('productName', 'GPU')} MIG {profile}",
        )

    def _mig_caps(self, parent_minor: int, gi: int, ci: int) -> tuple[str, ...]:
        """The /dev/nvidia-caps nodes that grant access to one GPU and compute instance."""
        base = self.proc / "driver" / "nvidia" / "capabilities" / f"gpu{parent_minor}" / "mig"
        nodes = []
        for access in (base / f"gi{gi}" / "access", base / f"gi{gi}" / f"ci{ci}" / "access"):
            text = pci.read_text(access)
            match = _CAP_MINOR.search(text or "")
            if match is None:
                raise DeviceError(f"MIG capability file {access} missing or unreadable")
            nodes.append(f"/dev/nvidia-caps/nvidia-cap{match.group(1)}")
        return tuple(nodes)
