"""A stand-in for the `pynvml` module, answering from a mock profile.

It implements the NVML calls that `driver.devices.nvml` makes, with NVML's own semantics
(refcounted init, NotSupported for MIG calls on non-MIG GPUs, NotFound for empty MIG slots,
GpuIsLost for a lost GPU). Exception classes and constants are the real ones from
`pynvml`, so the code under test catches exactly what it catches on a node.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeMig:
    uuid: str
    profile: str
    gi: int
    ci: int
    memory_bytes: int
    slices: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int


@dataclass
class FakeGpu:
    index: int
    minor: int
    uuid: str
    bus_id: str  # sysfs form "0000:17:00.0"
    product: str
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    mig_capable: bool
    migs: list[FakeMig] = field(default_factory=list)
    lost: bool = False


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None


class _EventHandle:
    """Like the ctypes pointer NVML puts in an event: the same device as a handle from
    nvmlDeviceGetHandleByIndex, but a different object that compares by identity."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        self.mig = None


@dataclass
class _EventSet:
    gpus: set[int] = field(default_factory=set)
    freed: bool = False


NO_INSTANCE = 0xFFFFFFFF  # NVML's "not attributed to a GPU/compute instance"


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu], driver_version: str | None, cuda: int) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda = cuda
        self._lock = threading.Lock()
        self._refs = 0
        self._events: list[SimpleNamespace] = []
        self._event_ready = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        # Constants and exception classes come from the real binding; functions do not, so
        # a call the fake lacks fails loudly instead of reaching a real library.
        if name.startswith("NVML") or name.startswith("nvmlEventType"):
            return getattr(pynvml, name)
        raise AttributeError(f"fake NVML does not implement {name}")

    # -- library -------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.driver_version is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        with self._lock:
            self._refs += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._refs == 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
            self._refs -= 1

    def _check(self) -> None:
        if self._refs == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.driver_version or ""

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return _Handle(index)

    # -- per device ------------------------------------------------------------------------
    def _gpu(self, handle: _Handle) -> FakeGpu:
        self._check()
        gpu = self.gpus[handle.gpu]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _mig(self, handle: _Handle) -> FakeMig | None:
        gpu = self._gpu(handle)
        return gpu.migs[handle.mig] if handle.mig is not None else None

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        mig = self._mig(handle)
        return mig.uuid if mig else self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        gpu, mig = self._gpu(handle), self._mig(handle)
        return f"{gpu.product} MIG {mig.profile}" if mig else gpu.product

    def nvmlDeviceGetBrand(self, handle: _Handle) -> int:
        return self._gpu(handle).brand

    def nvmlDeviceGetArchitecture(self, handle: _Handle) -> int:
        return self._gpu(handle).architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._gpu(handle)
        # NVML reports an 8-digit domain: "00000000:17:00.0", upper-case hex.
        return SimpleNamespace(busId=("0000" + gpu.bus_id).upper(), busIdLegacy=gpu.bus_id.upper())

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        mig = self._mig(handle)
        total = mig.memory_bytes if mig else self._gpu(handle).memory_bytes
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        if handle.mig is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle).minor

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        gpu = self._gpu(handle)
        if not gpu.mig_capable or handle.mig is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.migs else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < len(gpu.migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(handle.gpu, index)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        mig = self._mig(handle)
        if mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig.gi

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        mig = self._mig(handle)
        if mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig.ci

    def nvmlDeviceGetAttributes(self, handle: _Handle) -> SimpleNamespace:
        mig = self._mig(handle)
        if mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(
            multiprocessorCount=mig.multiprocessors,
            sharedCopyEngineCount=mig.copy_engines,
            sharedDecoderCount=mig.decoders,
            sharedEncoderCount=mig.encoders,
            sharedJpegCount=0,
            sharedOfaCount=0,
            gpuInstanceSliceCount=mig.slices,
            computeInstanceSliceCount=mig.slices,
            memorySizeMB=mig.memory_bytes >> 20,
        )

    # -- events (health) -------------------------------------------------------------------
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle:
        self._check()
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                if gpu.lost:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
                return _Handle(gpu.index)
            for k, mig in enumerate(gpu.migs):
                if mig.uuid == uuid:
                    return _Handle(gpu.index, k)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlEventSetCreate(self) -> _EventSet:
        self._check()
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: _EventSet) -> None:
        self._gpu(handle)
        if not event_types & pynvml.nvmlEventTypeXidCriticalError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.gpus.add(handle.gpu)

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
        deadline = timeout_ms / 1000.0
        with self._event_ready:
            self._event_ready.wait_for(
                lambda: any(e.gpu in event_set.gpus for e in self._events), timeout=deadline)
            for i, event in enumerate(self._events):
                if event.gpu in event_set.gpus:
                    del self._events[i]
                    return event.data
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        event_set.freed = True

    def inject_xid(self, index: int, xid: int, gpu_instance: int | None = None,
                   compute_instance: int | None = None) -> None:
        """Mock mode: queue an XID critical error event as the driver would report it."""
        data = SimpleNamespace(
            device=_EventHandle(index), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid,
            gpuInstanceId=NO_INSTANCE if gpu_instance is None else gpu_instance,
            computeInstanceId=NO_INSTANCE if compute_instance is None else compute_instance,
        )
        with self._event_ready:
            self._events.append(SimpleNamespace(gpu=index, data=data))
            self._event_ready.notify_all()
