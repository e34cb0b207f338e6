"""A fake `libnvidia-ml.so.1` for mock mode: the real nvidia-ml-py runs on top of it.

The driver's NVML code receives a `pynvml` module, as on a GPU node. In mock mode that
module is a private copy of the real nvidia-ml-py (`bindings()`: its own globals, so two
mock nodes in one process never share state) whose `nvmlLib` is a FakeNvmlLibrary instead
of the shared library. Every call therefore runs through nvidia-ml-py's own wrappers: the
`_v2`/`_v3` C names they pick, their ctypes structs, str/bytes conversion, the mapping of
return codes to exception classes, fresh pointer objects in event data. Nothing of
nvidia-ml-py is replaced or patched.

The library is a stateful model of the devices of a mock profile. Its attributes are
`ctypes.CFUNCTYPE` callbacks named like the C functions; pointer arguments arrive as
addresses, are cast to nvidia-ml-py's own structs and filled, and the return value is the
NVML return code. A function the library does not export (one newer than the profile's
driver branch, see SINCE) is an AttributeError to ctypes, which nvidia-ml-py turns into
NVMLError_FunctionNotFound, exactly as with an older driver.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import sys
import threading
from ctypes import CFUNCTYPE, c_char_p, c_int, c_uint, c_ulonglong, c_void_p
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from driver.devices.mock.fakemig import MigManagement
from driver.devices.mock.gpuload import GpuLoadStore, MemoryGpuLoadStore, now_us
from driver.devices.mock.gpustate import GpuStateStore, MemoryGpuStateStore
from driver.devices.mock.model import FakeGpu, FakeMig
from driver.devices.mock.model import Return as _Return
from driver.devices.mock.model import export as _export

NO_INSTANCE = 0xFFFFFFFF  # NVML's "not attributed to a GPU/compute instance"
MAX_MIG_DEVICES = 7
_GPU_BASE, _GPU_STRIDE, _MIG_STRIDE = 0x7F5A_0000_1000, 0x1000, 0x100  # handle addresses
_BINDING_STRIDE = 0x10_0000  # a rebound GPU's handles move by this (see MigManagement.rebind)
_SET_BASE = 0x7F5B_0000_0000

# The first driver branch that exports a function (NVML's changelogs: MIG and the
# architecture query arrived with R450/CUDA 11.0, the v2 attributes with R470). Functions
# not listed are older than every branch a mock profile can name.
SINCE = {
    "nvmlDeviceGetArchitecture": 450,
    "nvmlDeviceGetMigMode": 450,
    "nvmlDeviceGetMaxMigDeviceCount": 450,
    "nvmlDeviceGetMigDeviceHandleByIndex": 450,
    "nvmlDeviceGetGpuInstanceId": 450,
    "nvmlDeviceGetComputeInstanceId": 450,
    "nvmlDeviceGetAttributes_v2": 470,
    "nvmlDeviceSetMigMode": 450,
    "nvmlDeviceGetGpuInstances": 450,
    "nvmlDeviceGetGpuInstanceById": 450,
    "nvmlGpuInstanceGetInfo": 450,
    "nvmlGpuInstanceDestroy": 450,
    "nvmlGpuInstanceCreateComputeInstance": 450,
    "nvmlGpuInstanceGetComputeInstances": 450,
    "nvmlComputeInstanceDestroy": 450,
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2": 470,
    "nvmlDeviceCreateGpuInstanceWithPlacement": 470,
    "nvmlDeviceGetGpuInstanceProfileInfo": 450,
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": 450,
    "nvmlDeviceGetGpuInstanceProfileInfoV": 510,
    "nvmlDeviceGetComputeRunningProcesses_v3": 510,
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV": 510,
}


_instances = itertools.count()


def bindings() -> ModuleType:
    """A private instance of the real nvidia-ml-py module (pynvml), not yet bound.

    nvidia-ml-py keeps its library handle, function-pointer cache and refcount in module
    globals; a module of its own per mock node keeps nodes apart. At import it looks itself
    up in sys.modules (to attach its exception classes), so it is registered there under a
    private name while it runs."""
    found = importlib.util.find_spec("pynvml")
    if found is None or found.origin is None:
        raise ImportError("nvidia-ml-py (module pynvml) is not installed")
    name = f"_dra_mock_pynvml_{next(_instances)}"
    spec = importlib.util.spec_from_file_location(name, found.origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


class FakeNvmlLibrary(MigManagement):
    """What nvidia-ml-py finds where it expects `libnvidia-ml.so.1`."""

    def __init__(self, gpus: list[FakeGpu], driver_version: str | None, cuda: int,
                 nv: ModuleType, state: GpuStateStore | None = None,
                 loads: GpuLoadStore | None = None) -> None:
        self.gpus = gpus
        # Settings a GPU keeps across processes (compute mode, MIG instances); shared with
        # the fake nvidia-smi. Without a mock root, kept in memory.
        self.state = state if state is not None else MemoryGpuStateStore()
        # What each GPU and MIG device is doing (driver/devices/mock/gpuload.py).
        self.loads = loads if loads is not None else MemoryGpuLoadStore()
        self.driver_version = driver_version  # None: no driver installed (init fails)
        self.cuda = cuda
        self.nv = nv
        self.unsupported: set[str] = set()  # C functions that answer NOT_SUPPORTED (tests)
        # GPU index -> how often the GPU was rebound (a MIG mode change, tests): its handles
        # carry the count, so that a handle from before the rebind is refused.
        self.bindings: dict[int, int] = {}
        self.rebind_at_mig_mode_change: set[str] = set()
        self.lookups: list[str] = []  # function-table lookups, in order
        self.calls: dict[str, int] = {}
        self.errors: list[str] = []  # bugs inside the fake: never silently "success"
        self._refs = 0
        self._lock = threading.RLock()
        self._events: list[tuple[int, int, int, int]] = []  # (gpu, xid, gi, ci)
        self._event_ready = threading.Condition(self._lock)
        self._sets: dict[int, set[int]] = {}
        self._next_set = 0
        self._keep: list[Any] = []  # buffers handed out (nvmlErrorString)
        branch = _branch(driver_version)
        table: dict[str, Any] = {}
        for attribute in dir(type(self)):
            method = getattr(type(self), attribute)
            c_name = getattr(method, "c_name", None)
            if c_name is None or (branch is not None and branch < SINCE.get(c_name, 0)):
                continue
            restype = c_void_p if c_name == "nvmlErrorString" else c_int
            prototype = CFUNCTYPE(restype, *method.c_argtypes)
            table[c_name] = prototype(self._guarded(c_name, getattr(self, attribute)))
        self._table = table

    def __getattr__(self, name: str) -> Any:
        # What ctypes' CDLL does for a symbol the library lacks: AttributeError.
        table = self.__dict__.get("_table", {})
        if name not in table:
            raise AttributeError(f"fake libnvidia-ml.so.1 ({self.driver_version}) has no symbol {name}")
        self.lookups.append(name)
        return table[name]

    @property
    def exported(self) -> set[str]:
        return set(self._table)

    def _guarded(self, name: str, impl: Callable[..., int | None]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            try:
                if name in self.unsupported:
                    return self.nv.NVML_ERROR_NOT_SUPPORTED
                result = impl(*args)
                return self.nv.NVML_SUCCESS if result is None else result
            except _Return as ret:
                return ret.code
            except Exception as err:  # a bug in the fake: an error code, never success
                self.errors.append(f"{name}: {err!r}")
                return self.nv.NVML_ERROR_UNKNOWN
        return call

    # -- helpers ---------------------------------------------------------------------------
    def _fail(self, code_name: str) -> _Return:
        return _Return(getattr(self.nv, code_name))

    def _initialized(self) -> None:
        if self._refs == 0:
            raise self._fail("NVML_ERROR_UNINITIALIZED")

    def _handle_address(self, index: int, mig: int | None = None) -> int:
        address = _GPU_BASE + self.bindings.get(index, 0) * _BINDING_STRIDE + index * _GPU_STRIDE
        return address if mig is None else address + (mig + 1) * _MIG_STRIDE

    def _resolve(self, address: int | None) -> tuple[FakeGpu, FakeMig | None]:
        """The device behind a handle; lost GPUs answer GPU_IS_LOST to everything."""
        self._initialized()
        if not address:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        offset = address - _GPU_BASE
        binding, within = divmod(offset, _BINDING_STRIDE)
        index, rest = divmod(within, _GPU_STRIDE)
        by_index = {g.index: g for g in self.gpus}
        if offset < 0 or index not in by_index or rest % _MIG_STRIDE:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        if binding != self.bindings.get(index, 0):  # a handle from before a rebind
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        gpu = by_index[index]
        if gpu.lost:
            raise self._fail("NVML_ERROR_GPU_IS_LOST")
        slot = rest // _MIG_STRIDE - 1
        if slot < 0:
            return gpu, None
        migs = self.migs(gpu)
        if slot >= len(migs):
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        return gpu, migs[slot]

    def _string(self, buffer: int, length: int, text: str) -> None:
        data = text.encode()
        if len(data) + 1 > length:
            raise self._fail("NVML_ERROR_INSUFFICIENT_SIZE")
        ctypes.memmove(buffer, data + b"\0", len(data) + 1)

    @staticmethod
    def _put(ctype: Any, address: int, value: Any) -> None:
        ctype.from_address(address).value = value

    # -- library -----------------------------------------------------------------------------
    @_export(c_uint)
    def _nvmlInitWithFlags(self, flags: int) -> int | None:
        if self.driver_version is None:
            return self.nv.NVML_ERROR_LIBRARY_NOT_FOUND
        with self._lock:
            self._refs += 1
        return None

    @_export()
    def _nvmlShutdown(self) -> int | None:
        with self._lock:
            self._initialized()
            self._refs -= 1
        return None

    @_export(c_int)
    def _nvmlErrorString(self, code: int) -> int:
        text = ctypes.create_string_buffer(f"NVML error {code}".encode())
        self._keep.append(text)
        return ctypes.addressof(text)

    @_export(c_void_p, c_uint)
    def _nvmlSystemGetDriverVersion(self, buffer: int, length: int) -> None:
        self._initialized()
        self._string(buffer, length, self.driver_version or "")

    @_export(c_void_p)
    def _nvmlSystemGetCudaDriverVersion(self, out: int) -> None:
        self._initialized()
        self._put(ctypes.c_int, out, self.cuda)

    @_export(c_void_p, name="nvmlDeviceGetCount_v2")
    def _device_count(self, out: int) -> None:
        self._initialized()
        self._put(c_uint, out, len(self.gpus))

    @_export(c_uint, c_void_p, name="nvmlDeviceGetHandleByIndex_v2")
    def _handle_by_index(self, index: int, out: int) -> None:
        self._initialized()
        gpu = next((g for g in self.gpus if g.index == index), None)
        if gpu is None:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        if gpu.lost:
            raise self._fail("NVML_ERROR_GPU_IS_LOST")
        self._put(c_void_p, out, self._handle_address(gpu.index))

    @_export(c_char_p, c_void_p)
    def _nvmlDeviceGetHandleByUUID(self, uuid: bytes, out: int) -> None:
        self._initialized()
        wanted = (uuid or b"").decode()
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                if gpu.lost:
                    raise self._fail("NVML_ERROR_GPU_IS_LOST")
                self._put(c_void_p, out, self._handle_address(gpu.index))
                return
            for slot, mig in enumerate(self.migs(gpu)):
                if mig.uuid == wanted:
                    if gpu.lost:
                        raise self._fail("NVML_ERROR_GPU_IS_LOST")
                    self._put(c_void_p, out, self._handle_address(gpu.index, slot))
                    return
        raise self._fail("NVML_ERROR_NOT_FOUND")

    # -- per device --------------------------------------------------------------------------
    @_export(c_void_p, c_void_p, c_uint)
    def _nvmlDeviceGetUUID(self, handle: int, buffer: int, length: int) -> None:
        gpu, mig = self._resolve(handle)
        self._string(buffer, length, mig.uuid if mig else gpu.uuid)

    @_export(c_void_p, c_void_p, c_uint)
    def _nvmlDeviceGetName(self, handle: int, buffer: int, length: int) -> None:
        gpu, mig = self._resolve(handle)
        self._string(buffer, length, f"{gpu.product} MIG {mig.profile}" if mig else gpu.product)

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetBrand(self, handle: int, out: int) -> None:
        gpu, _ = self._resolve(handle)
        self._put(c_int, out, gpu.brand)

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetArchitecture(self, handle: int, out: int) -> None:
        gpu, _ = self._resolve(handle)
        self._put(c_uint, out, gpu.architecture)

    @_export(c_void_p, c_void_p, c_void_p)
    def _nvmlDeviceGetCudaComputeCapability(self, handle: int, major: int, minor: int) -> None:
        gpu, _ = self._resolve(handle)
        self._put(c_int, major, gpu.compute_capability[0])
        self._put(c_int, minor, gpu.compute_capability[1])

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetPciInfo_v3(self, handle: int, out: int) -> None:
        gpu, _ = self._resolve(handle)
        info = self.nv.nvmlPciInfo_t.from_address(out)
        domain, bus, rest = gpu.bus_id.split(":")
        device = rest.split(".")[0]
        # NVML: an 8-digit upper-case domain in busId, the 4-digit legacy form beside it.
        info.busId = f"{int(domain, 16):08X}:{bus.upper()}:{device.upper()}.{rest.split('.')[1]}".encode()
        info.busIdLegacy = gpu.bus_id.upper().encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(device, 16)
        info.pciDeviceId = (gpu.pci_device << 16) | gpu.pci_vendor
        info.pciSubSystemId = (0x1000 << 16) | gpu.pci_vendor

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetMemoryInfo(self, handle: int, out: int) -> None:
        gpu, mig = self._resolve(handle)
        memory = self.nv.c_nvmlMemory_t.from_address(out)
        memory.total = mig.memory_bytes if mig else gpu.memory_bytes
        memory.used = self._memory_used(gpu, mig)
        memory.free = memory.total - memory.used

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetMemoryInfo_v2(self, handle: int, out: int) -> None:
        gpu, mig = self._resolve(handle)
        memory = self.nv.c_nvmlMemory_v2_t.from_address(out)
        if memory.version != self.nv.nvmlMemory_v2:
            raise self._fail("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        memory.total = mig.memory_bytes if mig else gpu.memory_bytes
        memory.reserved = 0
        memory.used = self._memory_used(gpu, mig)
        memory.free = memory.total - memory.used

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetMinorNumber(self, handle: int, out: int) -> None:
        gpu, mig = self._resolve(handle)
        if mig is not None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        self._put(c_uint, out, gpu.minor)

    @_export(c_void_p, c_void_p, c_void_p)
    def _nvmlDeviceGetMigMode(self, handle: int, current: int, pending: int) -> None:
        gpu, mig = self._resolve(handle)
        if not gpu.mig_capable or mig is not None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        mode, pending_mode = self.mig_modes(gpu)
        self._put(c_uint, current, mode)
        self._put(c_uint, pending, pending_mode)

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: int, out: int) -> None:
        gpu, _ = self._resolve(handle)
        if not gpu.mig_capable:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        self._put(c_uint, out, MAX_MIG_DEVICES)

    @_export(c_void_p, c_uint, c_void_p)
    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int, out: int) -> None:
        gpu, mig = self._resolve(handle)
        if not gpu.mig_capable or mig is not None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        if index >= MAX_MIG_DEVICES:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        if index >= len(self.migs(gpu)):
            raise self._fail("NVML_ERROR_NOT_FOUND")
        self._put(c_void_p, out, self._handle_address(gpu.index, index))

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetGpuInstanceId(self, handle: int, out: int) -> None:
        _, mig = self._resolve(handle)
        if mig is None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        self._put(c_uint, out, mig.gi)

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetComputeInstanceId(self, handle: int, out: int) -> None:
        _, mig = self._resolve(handle)
        if mig is None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        self._put(c_uint, out, mig.ci)

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetComputeMode(self, handle: int, out: int) -> None:
        gpu, mig = self._resolve(handle)
        if mig is not None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        self._put(c_uint, out, self.compute_mode(gpu))

    @_export(c_void_p, c_uint)
    def _nvmlDeviceSetComputeMode(self, handle: int, mode: int) -> None:
        gpu, mig = self._resolve(handle)
        if mig is not None:  # a MIG device has no compute mode of its own
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        if mode == self.nv.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")  # removed from current drivers
        if mode >= self.nv.NVML_COMPUTEMODE_COUNT:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        self.state.update(gpu.uuid, compute_mode=mode)

    def compute_mode(self, gpu: FakeGpu) -> int:
        return self.state.get(gpu.uuid).compute_mode

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetAttributes_v2(self, handle: int, out: int) -> None:
        _, mig = self._resolve(handle)
        if mig is None:  # NVML: "currently only supports MIG device handles"
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        attrs = self.nv.c_nvmlDeviceAttributes.from_address(out)
        attrs.multiprocessorCount = mig.multiprocessors
        attrs.sharedCopyEngineCount = mig.copy_engines
        attrs.sharedDecoderCount = mig.decoders
        attrs.sharedEncoderCount = mig.encoders
        attrs.sharedJpegCount = 0
        attrs.sharedOfaCount = 0
        attrs.gpuInstanceSliceCount = mig.slices
        attrs.computeInstanceSliceCount = mig.slices
        attrs.memorySizeMB = mig.memory_bytes >> 20

    # -- what the device is doing ------------------------------------------------------------
    def _memory_used(self, gpu: FakeGpu, mig: FakeMig | None) -> int:
        total = mig.memory_bytes if mig else gpu.memory_bytes
        used = self.loads.get(mig.uuid if mig else gpu.uuid).memory_used_bytes
        if mig is None:  # a GPU in MIG mode: what its MIG devices use
            used += sum(self.loads.get(m.uuid).memory_used_bytes for m in self.migs(gpu))
        return min(used, total)

    def _whole_gpu(self, handle: int) -> FakeGpu:
        """Utilization and power are the whole GPU's, and not measured in MIG mode (NVML
        answers NOT_SUPPORTED, nvidia-smi shows N/A)."""
        gpu, mig = self._resolve(handle)
        if mig is not None or (gpu.mig_capable and self.mig_modes(gpu)[0] == 1):
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        return gpu

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetUtilizationRates(self, handle: int, out: int) -> None:
        gpu = self._whole_gpu(handle)
        utilization = self.nv.c_nvmlUtilization_t.from_address(out)
        # The last sample period's, as the hardware counters give it.
        utilization.gpu = self.loads.get(gpu.uuid).sm_percent
        utilization.memory = utilization.gpu // 2

    @_export(c_void_p, c_uint, c_ulonglong, c_void_p, c_void_p, c_void_p)
    def _nvmlDeviceGetSamples(self, handle: int, kind: int, last_seen: int, value_type: int,
                              count: int, samples: int | None) -> int | None:
        gpu = self._whole_gpu(handle)
        if kind != self.nv.NVML_GPU_UTILIZATION_SAMPLES:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        found = self.loads.get(gpu.uuid).samples(last_seen, now_us())
        if not found:  # NVML: nothing newer than lastSeenTimeStamp is NOT_FOUND
            raise self._fail("NVML_ERROR_NOT_FOUND")
        self._put(c_uint, value_type, self.nv.NVML_VALUE_TYPE_UNSIGNED_INT)
        room = c_uint.from_address(count)
        if not samples:  # the size query
            room.value = len(found)
            return None
        found = found[-room.value:] if room.value < len(found) else found
        array = (self.nv.c_nvmlSample_t * len(found)).from_address(samples)
        for slot, (stamp, value) in enumerate(found):
            array[slot].timeStamp = stamp
            array[slot].sampleValue.uiVal = value
        room.value = len(found)
        return None

    @_export(c_void_p, c_void_p)
    def _nvmlDeviceGetPowerUsage(self, handle: int, out: int) -> None:
        gpu = self._whole_gpu(handle)
        load = self.loads.get(gpu.uuid)
        idle = 70_000 + 3_000 * load.sm_percent  # milliwatts: about an H100's idle and slope
        self._put(c_uint, out, idle if load.power_milliwatts is None else load.power_milliwatts)

    @_export(c_void_p, c_void_p, c_void_p)
    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle: int, count: int,
                                                 infos: int | None) -> int | None:
        gpu, mig = self._resolve(handle)
        # A GPU's list holds its MIG devices' processes too, each naming its instances.
        holders = [mig] if mig is not None else [None, *self.migs(gpu)]
        found = [(p, m) for m in holders
                 for p in self.loads.get(m.uuid if m else gpu.uuid).processes]
        room = c_uint.from_address(count)
        if not infos or room.value < len(found):
            room.value = len(found)
            return self.nv.NVML_ERROR_INSUFFICIENT_SIZE if found else None
        array = (self.nv.c_nvmlProcessInfo_v3_t * max(len(found), 1)).from_address(infos)
        for slot, (process, holder) in enumerate(found):
            array[slot].pid = process.pid
            array[slot].usedGpuMemory = process.memory_bytes
            array[slot].gpuInstanceId = holder.gi if holder else NO_INSTANCE
            array[slot].computeInstanceId = holder.ci if holder else NO_INSTANCE
        room.value = len(found)
        return None

    # -- events ------------------------------------------------------------------------------
    @_export(c_void_p)
    def _nvmlEventSetCreate(self, out: int) -> None:
        self._initialized()
        with self._lock:
            self._next_set += 1
            address = _SET_BASE + self._next_set * 0x10
            self._sets[address] = set()
        self._put(c_void_p, out, address)

    def _event_set(self, address: int | None) -> set[int]:
        if address not in self._sets:
            raise self._fail("NVML_ERROR_INVALID_ARGUMENT")
        return self._sets[address]

    @_export(c_void_p, c_ulonglong, c_void_p)
    def _nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: int) -> None:
        gpu, mig = self._resolve(handle)
        if mig is not None:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        if not types & self.nv.nvmlEventTypeXidCriticalError:
            raise self._fail("NVML_ERROR_NOT_SUPPORTED")
        with self._lock:
            self._event_set(event_set).add(gpu.index)

    @_export(c_void_p, c_void_p, c_uint)
    def _nvmlEventSetWait_v2(self, event_set: int, out: int, timeout_ms: int) -> int | None:
        with self._event_ready:
            registered = self._event_set(event_set)
            self._event_ready.wait_for(lambda: any(e[0] in registered for e in self._events),
                                       timeout=timeout_ms / 1000.0)
            for i, (gpu, xid, gi, ci) in enumerate(self._events):
                if gpu in registered:
                    del self._events[i]
                    break
            else:
                return self.nv.NVML_ERROR_TIMEOUT
        data = self.nv.c_nvmlEventData_t.from_address(out)
        # The event names the device by its handle, the same address nvmlDeviceGetHandle*
        # returned; nvidia-ml-py wraps it in a new pointer object.
        data.device = ctypes.cast(self._handle_address(gpu), self.nv.c_nvmlDevice_t)
        data.eventType = self.nv.nvmlEventTypeXidCriticalError
        data.eventData = xid
        data.gpuInstanceId = gi
        data.computeInstanceId = ci
        return None

    @_export(c_void_p)
    def _nvmlEventSetFree(self, event_set: int) -> None:
        with self._lock:
            self._event_set(event_set)
            del self._sets[event_set]

    # -- what the mock's "hardware" does ------------------------------------------------------
    def inject_xid(self, index: int, xid: int, gpu_instance: int | None = None,
                   compute_instance: int | None = None) -> None:
        """Queue an XID critical error event as the kernel driver would report it."""
        with self._event_ready:
            self._events.append((index, xid, NO_INSTANCE if gpu_instance is None else gpu_instance,
                                 NO_INSTANCE if compute_instance is None else compute_instance))
            self._event_ready.notify_all()


def _branch(driver_version: str | None) -> int | None:
    try:
        return int(str(driver_version).split(".")[0]) if driver_version else None
    except ValueError:
        return None


def load(gpus: list[FakeGpu], driver_version: str | None, cuda: int,
         root: Path | None = None) -> tuple[ModuleType, FakeNvmlLibrary]:
    """nvidia-ml-py bound to a fake library for these GPUs: (the pynvml module, the library).
    With the mock node's `root`, device settings persist there (driver/devices/mock/gpustate.py)."""
    nv = bindings()
    library = FakeNvmlLibrary(gpus, driver_version, cuda, nv,
                              GpuStateStore(root) if root is not None else None,
                              GpuLoadStore(root) if root is not None else None)
    nv.nvmlLib = library
    return nv, library


__all__ = ["FakeGpu", "FakeMig", "FakeNvmlLibrary", "NO_INSTANCE", "SINCE", "bindings", "load"]
