"""What a mock GPU remembers between processes: compute mode, time slice, MIG mode and the
GPU/compute instances created on it.

On a real node these live in the GPU driver, so they outlive a restart of our driver and
are lost at a reboot; the fake NVML library (in the driver's process) and the fake
`nvidia-smi` (a separate process) must agree on them the same way. One JSON file per GPU
under `<mock root>/gpu-state/`, stamped with the boot id: after a (simulated) reboot an old
file reads as the power-on defaults.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_COMPUTE_MODE = 0  # NVML_COMPUTEMODE_DEFAULT
DEFAULT_TIMESLICE = 0


@dataclass(frozen=True)
class GpuState:
    compute_mode: int = DEFAULT_COMPUTE_MODE
    timeslice: int = DEFAULT_TIMESLICE
    mig_mode: int | None = None  # None: as the profile built it
    pending_mig_mode: int | None = None  # set, waiting for a GPU reset (Ampere)
    # Instances created through NVML: {"gi": id, "profile": GI profile index, "start": s,
    # "ci": id or None, "ci_profile": CI profile index or None}
    instances: tuple = field(default=())


class GpuStateStore:
    def __init__(self, root: Path) -> None:
        self.root = root
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
                        int(data.get("timeslice", DEFAULT_TIMESLICE)),
                        data.get("mig_mode"), data.get("pending_mig_mode"),
                        tuple(dict(i) for i in data.get("instances") or ()))

    def update(self, uuid: str, **changes) -> GpuState:
        state = GpuState(**{**asdict(self.get(uuid)), **changes})
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{uuid}.json"
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        temp.write_text(json.dumps({**asdict(state), "boot_id": self._boot_id()}))
        temp.replace(path)
        return state


class MemoryGpuStateStore:
    """The same, in this process only (a fake library without a mock root)."""

    root = None  # no mock tree to write capability files into

    def __init__(self) -> None:
        self._states: dict[str, GpuState] = {}
        self._lock = threading.Lock()

    def get(self, uuid: str) -> GpuState:
        return self._states.get(uuid, GpuState())

    def update(self, uuid: str, **changes) -> GpuState:
        with self._lock:
            state = GpuState(**{**asdict(self.get(uuid)), **changes})
            self._states[uuid] = state
            return state
