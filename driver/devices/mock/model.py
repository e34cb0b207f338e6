"""The devices the fake NVML library models, and how its C functions are declared.

Shared by driver/devices/mock/fakenvml.py (the library) and fakemig.py (its MIG
management functions), so that each stays one concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from driver.devices.mock.catalog import GiProfile


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
    start: int = 0  # placement in the GPU's memory slices
    memory_slices: int = 0
    gi_profile: int | None = None  # NVML_GPU_INSTANCE_PROFILE_* index, when known


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
    pci_device: int = 0x0000
    pci_vendor: int = 0x10DE
    gi_profiles: tuple[GiProfile, ...] = ()  # what dynamic MIG can create
    mig_mode_needs_reset: bool = False


class Return(Exception):
    """Raised inside a callback: return this NVML code to the caller."""

    def __init__(self, code: int) -> None:
        self.code = code


def export(*argtypes: Any, name: str | None = None):
    """Mark a method as the C function `name` (default: the method's name without its
    leading underscore: a public method of that name would shadow the function table)."""
    def mark(method):
        method.c_name = name or method.__name__.removeprefix("_")
        method.c_argtypes = argtypes
        return method
    return mark
