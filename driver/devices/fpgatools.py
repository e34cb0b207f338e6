"""Loading a bitstream into an FPGA's programmable region, through the vendor's tool.

One small interface, two implementations:

* Alveo: XRT's `xbutil program --device <user BDF> --user <file.xclbin>` (XRT >= 2021.1;
  it checks the xclbin's interface UUID against the shell and downloads it through
  xclmgmt; xocl then publishes the xclbin's UUID as `logic_uuids`).
* Intel DFL: OPAE's `fpgaconf --segment S -B bus -D device -F function <file.gbs>`, which
  checks the GBS against the FIM's PR interface and writes it through the FME's
  partial-reconfiguration ioctl into port (slot) 0; the port then publishes the AFU's
  `afu_id`.

The tool's output goes line by line to `progress` (the driver logs it), and a tool that
runs past `timeout` is killed with its process group: the kubelet gives up on a prepare
after 45 s, and a programming that outlives its prepare would race the retry.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from driver.devices.bitstreams import ALVEO, DFL, Bitstream
from driver.devices.model import Device

# A mock node's tools are scripts that run the mock under the Python they are told
# (driver/devices/mock/fpgatools.py); a real xbutil or fpgaconf ignores the variable.
PYTHON_VARIABLE = "DRA_MOCK_PYTHON"
TOOLS = {ALVEO: "xbutil", DFL: "fpgaconf"}
# Where the vendors' packages install them, after $PATH.
DEFAULT_DIRS = (Path("/opt/xilinx/xrt/bin"), Path("/usr/bin"), Path("/usr/local/bin"))


class ProgramError(Exception):
    """The tool failed or ran too long; the message names the device, the file and why."""


@dataclass(frozen=True)
class ToolProcess:
    """A programming tool as started: its PID (it leads its own session, so its group is
    the tool and whatever it runs) and the kernel's start time of that PID, so that a
    recycled PID is never taken for it. Recorded because the tool outlives a driver that
    is SIGKILLed outside a container (or whose container keeps another PID 1): left
    alone, it would finish its download after the restarted driver loaded another
    function, and the card would hold what no claim asked for."""

    pid: int
    start: str

    @classmethod
    def of(cls, pid: int) -> "ToolProcess | None":
        stat = _stat(pid)
        return cls(pid, stat[2]) if stat is not None else None

    def text(self) -> str:
        return f"{self.pid}:{self.start}"

    @classmethod
    def parse(cls, text: str) -> "ToolProcess | None":
        pid, _, start = text.partition(":")
        return cls(int(pid), start) if pid.isdigit() and start else None

    def orphaned(self) -> bool:
        """Still running, and not a child of this process (that one is a programming in
        progress here, not one a crash left)."""
        stat = _stat(self.pid)
        return stat is not None and stat[2] == self.start and stat[0] != "Z" and stat[1] != os.getpid()

    def stop(self, timeout: float = 10.0) -> bool:
        """SIGKILL its group; True once it is gone (or a zombie)."""
        if not self.orphaned():
            return True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + timeout
        while self.orphaned():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent PID, starttime) from /proc/<pid>/stat; None when it is gone. The
    driver's own /proc: the tool runs in the driver's PID namespace."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), fields[19]


class Programmer(Protocol):
    def program(self, device: Device, bitstream: Bitstream, timeout: float,
                progress: Callable[[str], None],
                started: Callable[[ToolProcess], None] = ...) -> None: ...


@dataclass(frozen=True)
class ToolProgrammer:
    """Runs the family's tool; `tools_dir` first (the chart's or a mock node's), then
    $PATH and the vendors' install directories."""

    tools_dir: Path | None = None

    def locate(self, family: str) -> Path | None:
        name = TOOLS[family]
        if self.tools_dir is not None and (self.tools_dir / name).is_file():
            return self.tools_dir / name
        found = shutil.which(name)
        if found:
            return Path(found)
        return next((d / name for d in DEFAULT_DIRS if (d / name).is_file()), None)

    def command(self, device: Device, bitstream: Bitstream, tool: Path) -> list[str]:
        bdf = device.pci.bus_id if device.pci is not None else ""
        if bitstream.family == ALVEO:
            return [str(tool), "program", "--device", bdf, "--user", str(bitstream.path)]
        segment, bus, rest = bdf.split(":")
        dev, function = rest.split(".")
        return [str(tool), "--segment", f"0x{segment}", "-B", f"0x{bus}", "-D", f"0x{dev}",
                "-F", function, str(bitstream.path)]

    def program(self, device: Device, bitstream: Bitstream, timeout: float,
                progress: Callable[[str], None],
                started: Callable[[ToolProcess], None] = lambda tool: None) -> None:
        tool = self.locate(bitstream.family)
        what = f"FPGA {device.name}: loading {bitstream.path}"
        if tool is None:
            raise ProgramError(f"{what}: {TOOLS[bitstream.family]} not found (in "
                               f"{self.tools_dir or '$PATH'} or {', '.join(map(str, DEFAULT_DIRS))})")
        env = {**os.environ, PYTHON_VARIABLE: sys.executable}
        proc = subprocess.Popen(self.command(device, bitstream, tool), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        process = ToolProcess.of(proc.pid)
        if process is not None:
            try:
                started(process)
            except BaseException:
                _kill(proc)  # unrecorded, it could not be stopped after a crash
                raise
        last: list[str] = []
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            pending = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    _kill(proc)
                    raise ProgramError(f"{what}: {tool.name} ran longer than {timeout:g} s and was "
                                       "stopped (the kubelet allows a prepare 45 s); the region's "
                                       "content is unknown and the next claim programs it again")
                if not sel.select(min(left, 0.5)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace").strip()
                    if text:
                        last = (last + [text])[-3:]
                        progress(text)
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        if code != 0:
            said = " / ".join(last) or "no output"
            raise ProgramError(f"{what}: {tool.name} exited with {code}: {said}")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
