"""FPGAs programmed at prepare: the claim's FpgaConfig names a function, the driver loads
the store's bitstream for it into the allocated device before the container starts.

Order, for one device (under the prepare lock, on a pool thread):
  1. the function is loaded already (sysfs says so, and no record of ours says a
     programming of it was cut short) and no digest asks for more -> nothing to do;
  2. the store's bitstream for the function that fits the device's shell, refused with
     one line naming both interface IDs when none fits, or when the file's digest is not
     the claim's;
  3. a record <state-dir>/fpga/<device>.json, state "programming", written BEFORE the tool
     runs: a crash or a failed or stopped tool leaves it, and a device whose record says
     "programming" is never trusted to hold what sysfs shows (a partial reconfiguration
     cut short leaves the region undefined), so the next prepare programs it again;
  4. the tool (driver/devices/fpgatools.py), inside the budget, its output logged; its
     PID goes into the record once it runs, so that a tool a crash left running (it
     has its own session) is stopped before the device is touched again;
  5. sysfs read again: it must show the function, then the record says "loaded".

Unprepare changes nothing: the last function stays loaded (documented choice,
docs/fpga.md) so that the next claim for it skips step 4 and claims can select the
programmed FPGA by its published `logicUUID` / `afuID`. Hence no container can ever
lose its function under it: the only change is a prepare's, and prepare refuses a device
another prepared claim (one with admin access) still holds. After a reboot the kernel's
sysfs is the truth and records of the old boot are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import structlog

from driver.devices.bitstreams import ALVEO, DFL, BitstreamStore, canonical_uuid
from driver.devices.fpga import loaded_function
from driver.devices.fpgatools import ProgramError, Programmer, ToolProcess
from driver.devices.model import Device
from driver.prepare.opaque import FpgaConfig
from driver.prepare.records import RecordStore
from driver.state.checkpoint import ClaimRecord, State
from driver.state.instance import Instance

FORMAT_VERSION = 1
PROGRAMMING, LOADED = "programming", "loaded"
# The kubelet cancels a prepare after 45 s; the lookup, the spec and the record writes
# around the tool need a few of them.
DEFAULT_TIMEOUT = 35.0


class FpgaProgramError(Exception):
    """The claim's function cannot be loaded; one line naming the claim, device and why."""


@dataclass(frozen=True)
class FpgaRecord:
    device: str
    function: str  # canonical UUID
    bitstream: str  # the file loaded
    digest: str | None  # sha256:... where the claim asked for one
    boot_id: str
    state: str  # PROGRAMMING or LOADED
    claim: str  # namespace/name of the claim that had it loaded, for people
    # "<pid>:<starttime>" of the tool while it runs (fpgatools.ToolProcess): a tool that a
    # crash left running is stopped before anything else touches the device.
    tool: str | None = None

    def to_json(self) -> bytes:
        return json.dumps({"version": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: Path) -> "FpgaRecord":
        try:
            data = json.loads(raw)
            if data.pop("version", None) != FORMAT_VERSION:
                raise FpgaProgramError(f"{source}: unknown format")
            return cls(**data)
        except FpgaProgramError:
            raise
        except (ValueError, TypeError) as err:
            raise FpgaProgramError(f"{source}: corrupt FPGA record: {err}") from err


class FpgaRecords(RecordStore[FpgaRecord]):
    """<state-dir>/fpga: what this driver loaded into which FPGA, or was loading."""

    def __init__(self, state_dir: Path, instance: Instance) -> None:
        super().__init__(state_dir / "fpga", instance, FpgaRecord.from_json, FpgaProgramError)


class FpgaPrograms:
    def __init__(self, records: FpgaRecords, store: BitstreamStore, programmer: Programmer,
                 sysfs: Path, boot_id: str, timeout: float = DEFAULT_TIMEOUT,
                 rediscover: Callable[[], None] = lambda: None) -> None:
        self.records = records
        self.store = store
        self.programmer = programmer
        self.sysfs = sysfs
        self.boot_id = boot_id
        self.timeout = timeout
        # The published logicUUID / afuID follow a programming (claims select by them).
        self.rediscover = rediscover
        self.log = structlog.get_logger(component="fpga")

    def ensure(self, claim: str, device: Device, config: FpgaConfig,
               holders: Iterable[str] = ()) -> Device:
        """The device with config.function loaded: as the container gets it."""
        if config.function is None:
            return device
        function = config.function
        where = f"claim {claim}: FPGA {device.name}"
        record = self._current_record(device.name)
        path, loaded = loaded_function(self.sysfs, device)
        trusted = record is None or record.state == LOADED
        if loaded == function and trusted and (
                config.digest is None or (record is not None and record.digest == config.digest)):
            self.log.info("fpga_function_already_loaded", claim=claim, device=device.name,
                          function=function)
            return device
        family = str(device.attributes.get("family", ""))
        if family not in (ALVEO, DFL):
            raise FpgaProgramError(f"{where}: family {family!r} cannot be programmed by this driver")
        if family == DFL and int(device.attributes.get("port", 0)) != 0:
            raise FpgaProgramError(f"{where}: is port {device.attributes.get('port')} of its card; "
                                   "fpgaconf programs port 0 only")
        shell = canonical_uuid(str(device.attributes.get("interfaceID", "")))
        found = self.store.lookup(function, shell, family)
        if found.fits is None:
            if not found.candidates:
                raise FpgaProgramError(
                    f"{where}: no bitstream for function {function} in the store "
                    f"{self.store.root or '(none configured: --fpga-bitstreams)'}"
                    + (f" ({len(found.unreadable)} unreadable file(s), first: {found.unreadable[0]})"
                       if found.unreadable else ""))
            theirs = ", ".join(sorted({f"{b.interface} ({b.path.name})" for b in found.candidates}))
            raise FpgaProgramError(f"{where}: bitstream for function {function} is built for "
                                   f"interface {theirs}; the device's shell is interface {shell}")
        bitstream = found.fits
        digest = None
        if config.digest is not None:
            digest = bitstream.digest()
            if digest != config.digest:
                raise FpgaProgramError(f"{where}: {bitstream.path} has digest {digest}, the claim "
                                       f"asks for {config.digest}")
        busy = sorted(h for h in holders if h != claim)
        if busy:
            raise FpgaProgramError(f"{where}: holds another function and is in use by claim(s) "
                                   f"{', '.join(busy)}; it is not reprogrammed under them")
        self._stop_orphan(record, where)
        # Recorded before the region changes: a crash from here on leaves a record that
        # makes the next prepare program the device again (step 3 above).
        programming = FpgaRecord(device.name, function, str(bitstream.path), digest,
                                 self.boot_id, PROGRAMMING, claim)
        self.records.put(programming)
        log = self.log.bind(claim=claim, device=device.name, function=function,
                            bitstream=str(bitstream.path))
        log.info("fpga_programming_started", was=loaded, size=bitstream.size)
        started = time.monotonic()
        try:
            self.programmer.program(
                device, bitstream, self.timeout,
                lambda line: log.info("fpga_programming_progress", output=line),
                lambda tool: self.records.put(dataclasses.replace(programming, tool=tool.text())))
        except ProgramError as err:
            log.warning("fpga_programming_failed", error=str(err))
            self.rediscover()
            raise FpgaProgramError(f"claim {claim}: {err}") from err
        _, now = loaded_function(self.sysfs, device)
        if now != function:
            self.rediscover()
            raise FpgaProgramError(f"{where}: the tool reported success but {path} shows "
                                   f"{now or 'nothing'}, not {function}")
        self.records.put(FpgaRecord(device.name, function, str(bitstream.path), digest,
                                    self.boot_id, LOADED, claim))
        log.info("fpga_programmed", seconds=round(time.monotonic() - started, 3))
        self.rediscover()
        key = "afuID" if family == DFL else "logicUUID"
        published = path.read_text().strip() or function  # as discovery publishes it
        return dataclasses.replace(device, attributes={**device.attributes, key: published})

    def _stop_orphan(self, record: FpgaRecord | None, where: str) -> None:
        """The tool of a programming that a crash cut short, if it still runs: stopped
        before the device is programmed again, or it would finish its download later and
        overwrite what this claim gets."""
        if record is None or record.state != PROGRAMMING or not record.tool:
            return
        tool = ToolProcess.parse(record.tool)
        if tool is None or not tool.orphaned():
            return
        stopped = tool.stop()
        self.log.warning("fpga_orphan_tool_stopped", device=record.device, pid=tool.pid,
                         claim=record.claim, stopped=stopped)
        if not stopped:
            raise FpgaProgramError(f"{where}: the programming tool (PID {tool.pid}) of an earlier, "
                                   "interrupted programming still runs and cannot be stopped")

    def _current_record(self, device: str) -> FpgaRecord | None:
        try:
            record = self.records.get(device)
        except FpgaProgramError as err:
            # Unreadable: treated as a programming cut short (never trusted), replaced by
            # the next programming's record.
            self.log.warning("fpga_record_unreadable", device=device, error=str(err))
            return FpgaRecord(device, "", "", None, self.boot_id, PROGRAMMING, "")
        if record is not None and record.boot_id != self.boot_id:
            self.records.remove(device)  # rebooted: what the kernel shows now is the truth
            return None
        return record

    def reconcile(self, claims: Iterable[ClaimRecord]) -> list[str]:
        """After a start and periodically: records of an earlier boot go; a programming
        cut short stays recorded (the next prepare of the device reprograms it, and
        `dra-driver status` can say so); nothing on a device is undone."""
        held = {d.device for r in claims if r.state is State.PREPARE_COMPLETED for d in r.devices}
        notes = []
        for record in self.records.all_or_errors():
            if isinstance(record, Exception):
                continue
            if record.boot_id != self.boot_id:
                self.records.remove(record.device)
                self.log.info("fpga_record_dropped", device=record.device, reason="rebooted")
            elif record.state == PROGRAMMING:
                try:
                    self._stop_orphan(record, f"FPGA {record.device}")
                except FpgaProgramError as err:
                    self.log.warning("fpga_orphan_tool_left", device=record.device, error=str(err))
                if record.device not in held:
                    notes.append(record.device)
        if notes:
            self.log.info("fpga_programming_cut_short", devices=notes,
                          next_step="the next claim of each programs it again")
        return []

