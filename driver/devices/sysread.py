"""Cheap reads of sysfs and /dev by string path, for the loops that touch every device
again and again (the health probe every 5 s, NIC counters every 10 s, the rediscovery
fingerprint every 60 s).

On a node of 2,048 VFs, building pathlib objects and text-mode file objects cost more CPU
than the reads themselves (75 ms a health probe, most of it pathlib), so these take
strings made once per inventory and make the fewest system calls a read can.
"""

from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

from driver.devices.model import Inventory

T = TypeVar("T")


class PerInventory(Generic[T]):
    """What `make` derives from an inventory (each device's paths, say), made again only
    when the inventory changes: rediscovery replaces it whole, so its identity says when."""

    def __init__(self, make: Callable[[Inventory], T]) -> None:
        self._make = make
        self._for: Inventory | None = None
        self._value: T | None = None

    def of(self, inventory: Inventory) -> T:
        if inventory is not self._for or self._value is None:
            self._value, self._for = self._make(inventory), inventory
        return self._value


def read_small(path: str, limit: int = 256) -> bytes | None:
    """The first `limit` bytes of a sysfs attribute; None when it cannot be read (gone,
    EINVAL for the speed of a link that is down, EACCES)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def exists(path: str) -> bool:
    try:
        os.stat(path)
    except OSError:
        return False
    return True
