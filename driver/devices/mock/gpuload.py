"""What a mock GPU or MIG device is doing: SM utilization, memory in use, power and its
compute processes, scripted by tests and the demo (`set`), read by the fake NVML library.

A real GPU's driver samples SM utilization every 1/6 s to 1 s and keeps the recent samples
in a ring buffer that `nvmlDeviceGetSamples` reads. The fake keeps the history of scripted
changes and derives the samples from it, so that a burst scripted between two reads of
the driver shows up in the samples, as on hardware.

One JSON file per device UUID under `<mock root>/gpu-load/`, so that a test, the demo and
a driver in another process agree; without a mock root, kept in memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_PERIOD_US = 166_667  # the shortest period NVML documents (1/6 s)
RING = 120  # samples the driver's buffer holds: 20 s at 1/6 s
HISTORY = 256  # scripted changes kept


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    memory_bytes: int


@dataclass(frozen=True)
class GpuLoad:
    sm_percent: int = 0
    memory_used_bytes: int = 0
    power_milliwatts: int | None = None  # None: the board's idle power
    processes: tuple[GpuProcess, ...] = ()
    # (wall-clock microseconds, SM %) of every change, oldest first
    history: tuple[tuple[int, int], ...] = field(default=())

    def samples(self, after_us: int, now_us: int) -> list[tuple[int, int]]:
        """(timestamp µs, SM %) of the samples newer than `after_us`, at most RING."""
        history = ((0, 0), *self.history)  # idle from power-on to the first change
        first = max(after_us + 1, history[0][0], now_us - RING * SAMPLE_PERIOD_US)
        start = -(-first // SAMPLE_PERIOD_US) * SAMPLE_PERIOD_US  # the next sample point
        out = []
        index = 0
        for stamp in range(start, now_us + 1, SAMPLE_PERIOD_US):
            while index + 1 < len(history) and history[index + 1][0] <= stamp:
                index += 1
            out.append((stamp, history[index][1]))
        # A burst shorter than a period still lands in the sample that follows it, as
        # the hardware counters accumulate between samples.
        for changed, value in history:
            if after_us < changed <= now_us and value > 0:
                later = -(-changed // SAMPLE_PERIOD_US) * SAMPLE_PERIOD_US
                out = [(s, max(v, value) if s == later else v) for s, v in out]
        return out[-RING:]


def _decode(data: dict) -> GpuLoad:
    return GpuLoad(int(data.get("sm_percent", 0)), int(data.get("memory_used_bytes", 0)),
                   data.get("power_milliwatts"),
                   tuple(GpuProcess(int(p), int(m)) for p, m in data.get("processes") or ()),
                   tuple((int(t), int(v)) for t, v in data.get("history") or ()))


def _encode(load: GpuLoad) -> dict:
    return {"sm_percent": load.sm_percent, "memory_used_bytes": load.memory_used_bytes,
            "power_milliwatts": load.power_milliwatts,
            "processes": [[p.pid, p.memory_bytes] for p in load.processes],
            "history": [list(h) for h in load.history]}


def now_us() -> int:
    return int(time.time() * 1_000_000)


def _changed(old: GpuLoad, sm_percent: int | None, memory_used_bytes: int | None,
             power_milliwatts: int | None, processes: list[tuple[int, int]] | None) -> GpuLoad:
    sm = old.sm_percent if sm_percent is None else int(sm_percent)
    if not 0 <= sm <= 100:
        raise ValueError(f"SM utilization {sm} is not a percentage")
    procs = old.processes if processes is None else tuple(GpuProcess(p, m) for p, m in processes)
    if memory_used_bytes is None:
        memory = sum(p.memory_bytes for p in procs) if processes is not None else old.memory_used_bytes
    else:
        memory = int(memory_used_bytes)
    history = old.history
    if sm_percent is not None or not history:
        history = (*history, (now_us(), sm))[-HISTORY:]
    power = old.power_milliwatts if power_milliwatts is None else int(power_milliwatts)
    return GpuLoad(sm, memory, power, procs, history)


class GpuLoadStore:
    def __init__(self, root: Path) -> None:
        self.directory = root / "gpu-load"  # kept by tree.build across driver restarts

    def get(self, uuid: str) -> GpuLoad:
        try:
            return _decode(json.loads((self.directory / f"{uuid}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return GpuLoad()

    def set(self, uuid: str, sm_percent: int | None = None, memory_used_bytes: int | None = None,
            power_milliwatts: int | None = None,
            processes: list[tuple[int, int]] | None = None) -> GpuLoad:
        """Change what the device is doing from now on; what is not given stays."""
        load = _changed(self.get(uuid), sm_percent, memory_used_bytes, power_milliwatts, processes)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{uuid}.json"
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        temp.write_text(json.dumps(_encode(load)))
        temp.replace(path)
        return load


class MemoryGpuLoadStore:
    """The same, in this process only."""

    def __init__(self) -> None:
        self._loads: dict[str, GpuLoad] = {}
        self._lock = threading.Lock()

    def get(self, uuid: str) -> GpuLoad:
        return self._loads.get(uuid, GpuLoad())

    def set(self, uuid: str, sm_percent: int | None = None, memory_used_bytes: int | None = None,
            power_milliwatts: int | None = None,
            processes: list[tuple[int, int]] | None = None) -> GpuLoad:
        with self._lock:
            load = _changed(self.get(uuid), sm_percent, memory_used_bytes, power_milliwatts,
                            processes)
            self._loads[uuid] = load
            return load
