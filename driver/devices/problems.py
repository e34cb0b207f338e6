"""Problems found during discovery: each names the device (or sysfs path) it concerns.

Discovery never stops at one bad device. It records what was wrong, skips or trims that
device, and carries on; the caller logs the problems as structured warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


class DeviceError(Exception):
    """A device cannot be read well enough to publish it. The message names it."""


@dataclass(frozen=True)
class Problem:
    device: str  # device name, PCI address, interface or sysfs path
    message: str
    skipped: bool  # True: the device was left out; False: published without some detail


@dataclass
class Problems:
    items: list[Problem] = field(default_factory=list)

    def skip(self, device: str, message: str) -> None:
        self.items.append(Problem(device, message, skipped=True))

    def note(self, device: str, message: str) -> None:
        self.items.append(Problem(device, message, skipped=False))

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
