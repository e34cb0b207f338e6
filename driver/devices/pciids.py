"""Product names from the PCI ID database (`pci.ids`, Debian's `pci.ids`/`hwdata`).

A NIC or an FPGA tells sysfs only its numeric ids; claims read far better with
`productName.contains("ConnectX-7")` than with `pciDeviceID == "0x1021"`. The database is
read once, at the first lookup, from the first path that exists; without one (or for an
id it does not list) the name is the ids themselves, `15b3:1021`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Debian's hwdata, Debian's pci.ids package, and the usual elsewhere.
SYSTEM_PATHS = (Path("/usr/share/hwdata/pci.ids"), Path("/usr/share/misc/pci.ids"),
                Path("/usr/share/pci.ids"))
MAX_NAME = 64  # the API server's limit for a string attribute


@dataclass
class PciIds:
    paths: tuple[Path, ...] = SYSTEM_PATHS
    _names: dict[tuple[int, int | None], str] | None = field(default=None, repr=False)

    def _load(self) -> dict[tuple[int, int | None], str]:
        names: dict[tuple[int, int | None], str] = {}
        for path in self.paths:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            vendor = None
            for line in text.splitlines():
                if not line or line.startswith("#"):
                    continue
                if line.startswith("C "):
                    break  # the device class section follows the vendors
                if not line.startswith("\t"):
                    vendor = _entry(line)
                    if vendor is not None:
                        names[(vendor[0], None)] = vendor[1]
                elif not line.startswith("\t\t") and vendor is not None:
                    device = _entry(line[1:])
                    if device is not None:
                        names[(vendor[0], device[0])] = device[1]
            break  # the first database found is the one
        return names

    def product(self, vendor: int, device: int) -> str:
        if self._names is None:
            self._names = self._load()
        name = self._names.get((vendor, device))
        if name is None:
            return f"{vendor:04x}:{device:04x}"
        return name[:MAX_NAME].rstrip()

    def vendor(self, vendor: int) -> str | None:
        if self._names is None:
            self._names = self._load()
        return self._names.get((vendor, None))


def _entry(line: str) -> tuple[int, str] | None:
    ident, _, name = line.partition("  ")
    try:
        return int(ident, 16), name.strip()
    except ValueError:
        return None
