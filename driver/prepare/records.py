"""One crash-safe JSON record per device in a directory of the state dir: the shape both
the device-state checkpoint (sharing) and the MIG partition records take. Read and written
under the cross-process prepare lock, like the claim records; a file named after the
device, written atomically by this instance."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from driver.state import atomic

from driver.kube import names
from driver.state.instance import Instance


class Record(Protocol):
    device: str

    def to_json(self) -> bytes: ...


R = TypeVar("R", bound=Record)


class RecordStore(Generic[R]):
    def __init__(self, directory: Path, instance: Instance,
                 decode: Callable[[bytes, Path], R], error: type[Exception]) -> None:
        self.directory = directory
        self.instance = instance
        self.decode = decode
        self.error = error  # what decode raises for an unreadable record
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic.sweep_temp_files(self.directory, instance.owner_state)

    def path(self, device: str) -> Path:
        if not names.is_dns_label(device):
            raise self.error(f"device name {device!r} cannot name a record in {self.directory}")
        return self.directory / f"{device}.json"

    def get(self, device: str) -> R | None:
        path = self.path(device)
        try:
            return self.decode(path.read_bytes(), path)
        except FileNotFoundError:
            return None

    def put(self, record: R) -> None:
        atomic.write(self.path(record.device), record.to_json(), mode=0o600,
                     owner=self.instance.token)

    def remove(self, device: str) -> bool:
        return atomic.remove(self.path(device))

    def devices(self) -> set[str]:
        """Devices with a record (a directory listing: cheap enough for every call). Every
        prepare asks, on the event loop: one listdir (~4 us on a quiet machine), not
        pathlib's glob (~43 us, and ~0.4 ms a call under cProfile in a node's burst of 64
        prepares, bench/RESULTS.md)."""
        try:
            return {name[:-5] for name in os.listdir(self.directory)
                    if name.endswith(".json") and not name.startswith(".")}  # as glob's "*"
        except FileNotFoundError:
            return set()

    def all_or_errors(self) -> list[R | Exception]:
        """Every record; an unreadable one comes back as its error (kept on disk for a
        human: guessing what to undo could break a device)."""
        found: list[R | Exception] = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                found.append(self.decode(path.read_bytes(), path))
            except self.error as err:
                found.append(err)
            except OSError:
                continue
        return found
