"""What a mock GPU remembers between processes: compute mode and time-slice setting.

On a real node these live in the GPU driver, so they outlive a restart of our driver and
are lost at a reboot; the fake NVML library (in the driver's process) and the fake
`nvidia-smi` (a separate process) must agree on them the same way. One JSON file per GPU
under `<mock root>/gpu-state/`, stamped with the boot id: after a (simulated) reboot an old
file reads as the power-on defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_COMPUTE_MODE = 0  # NVML_COMPUTEMODE_DEFAULT
DEFAULT_TIMESLICE = 0


@dataclass(frozen=True)
class GpuState:
    compute_mode: int = DEFAULT_COMPUTE_MODE
    timeslice: int = DEFAULT_TIMESLICE


class GpuStateStore:
    def __init__(self, root: Path) -> None:
        self.directory = root / "gpu-state"  # kept by tree.build across driver restarts
        self.boot_id_file = root / "proc" / "sys" / "kernel" / "random" / "boot_id"

    def _boot_id(self) -> str:
        try:
            return self.boot_id_file.read_text().strip()
        except OSError:
            return ""

    def get(self, uuid: str) -> GpuState:
        try:
            data = json.loads((self.directory / f"{uuid}.json").read_text())
        except (OSError, ValueError):
            return GpuState()
        if data.get("boot_id") != self._boot_id():
            return GpuState()
        return GpuState(int(data.get("compute_mode", DEFAULT_COMPUTE_MODE)),
                        int(data.get("timeslice", DEFAULT_TIMESLICE)))

    def update(self, uuid: str, **changes: int) -> GpuState:
        state = GpuState(**{**asdict(self.get(uuid)), **changes})
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{uuid}.json"
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        temp.write_text(json.dumps({**asdict(state), "boot_id": self._boot_id()}))
        temp.replace(path)
        return state
