"""Whether a starting driver should wait for the NVIDIA driver installation, and whether
it has arrived.

With the GPU operator the installation appears under /run/nvidia/driver only once the
operator's driver container has built the kernel modules and mounted its root there,
minutes after this pod may have started. A discovery before that finds no NVML and
publishes the node without its GPUs. So the plugin waits a while first (bounded:
--nvidia-driver-wait), but only where GPUs are expected: NVIDIA display-class functions
(vendor 0x10de, PCI base class 0x03: VGA and 3D controllers) on the PCI bus, which the
kernel lists whether or not a driver is installed. A NIC- or FPGA-only node has none,
whatever driver root the chart names for the whole cluster, and starts at once. The
driver root being something other than `/` is no sign of GPUs: one chart value serves
every node of a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from driver.devices import nvlibs, pci

LIBRARY = "libnvidia-ml.so.1"
NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03  # PCI base class (the top byte of the 24-bit class code)


def nvidia_gpus_on_pci(sysfs: Path) -> int:
    """NVIDIA GPUs the kernel lists, driver or not (their audio and USB functions are
    other classes and are not counted)."""
    count = 0
    for bdf in pci.list_functions(sysfs):
        function = sysfs / "bus" / "pci" / "devices" / bdf
        vendor = pci.read_int(function / "vendor", 16)
        class_code = pci.read_int(function / "class", 16)
        if vendor == NVIDIA_VENDOR and class_code is not None and class_code >> 16 == DISPLAY_CLASS:
            count += 1
    return count


@dataclass(frozen=True)
class DriverWait:
    """What the start-up wait looks at: the node's sysfs and the installation's root as
    this process sees it."""

    sysfs: Path
    driver_root: Path

    def gpus_without_library(self) -> int:
        """The NVIDIA GPUs on the bus when the installation lacks its NVML library (the
        node should wait for it); 0 when there is nothing to wait for."""
        if self.library() is not None:
            return 0
        return nvidia_gpus_on_pci(self.sysfs)

    def library(self) -> Path | None:
        return nvlibs.locate(self.driver_root, LIBRARY)
