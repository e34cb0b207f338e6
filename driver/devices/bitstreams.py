"""The node's bitstream store: FPGA images indexed by the shell they fit and the function
they load, with both read from the files themselves.

Two formats, one per family:

* Alveo (XRT) `.xclbin`: the axlf container of XRT's xclbin.h. An 8-byte magic
  `xclbin2\\0`, a signature length, 28 reserved bytes, a 256-byte key block, a 64-bit unique
  id, then the 152-byte axlf_header (at offset 304): length, time stamps, version, mode,
  action mask, the 16-byte *interface UUID* (the shell it fits), the platform VBNV, the
  16-byte *xclbin UUID* (what xocl publishes as `logic_uuids` once loaded) and the section
  count; 40-byte section headers follow (kind, name, offset, size), BITSTREAM is kind 0.
* Intel DFL (OPAE) `.gbs`: a 16-byte GUID (58656f6e-4650-4741-b747-425376303031), a
  little-endian 32-bit metadata length, the JSON metadata, then the partial bitstream.
  `afu-image.interface-uuid` is the FIM's PR interface (the region's `compat_id`),
  `afu-image.accelerator-clusters[0].accelerator-type-uuid` the AFU id a port publishes
  as `afu_id` once loaded, `afu-image.magic-no` 488605312.

The function ID a claim names (FpgaConfig.function) is that second UUID: the one sysfs
shows while the function is loaded, so "already loaded" and "select a programmed FPGA by
attribute" need no other name. Where a file sits in the store does not matter (the
layout in docs/fpga.md is a convention for people); what it says of itself does.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

XCLBIN_MAGIC = b"xclbin2\0"
_AXLF_HEADER = 304  # magic 8 + signature length 4 + reserved 28 + key block 256 + unique id 8
_HEADER = struct.Struct("<QQQHBBHH16s64s16s16sI4x")  # axlf_header, 152 bytes
_SECTION = struct.Struct("<I16s4xQQ")  # axlf_section_header, 40 bytes
BITSTREAM_SECTION = 0
GBS_GUID = uuid.UUID("58656f6e-4650-4741-b747-425376303031")
GBS_MAGIC_NO = 488605312  # afu-image.magic-no of every GBS OPAE accepts (0x1d1f8680)
MAX_GBS_METADATA = 1 << 20
ALVEO, DFL = "alveo", "dfl"
SUFFIXES = {".xclbin": ALVEO, ".gbs": DFL}

assert _HEADER.size == 152 and _SECTION.size == 40


class BitstreamError(ValueError):
    """A file that is not the bitstream it claims to be; the message names it."""


def canonical_uuid(text: str) -> str | None:
    """`0x`-less hex with or without dashes (sysfs prints both ways) -> dashed lowercase."""
    try:
        return str(uuid.UUID(text.strip()))
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class Bitstream:
    path: Path
    family: str  # ALVEO or DFL
    interface: str  # the shell / PR interface it fits (canonical UUID)
    function: str  # what sysfs shows once it is loaded (canonical UUID)
    name: str  # the platform VBNV (xclbin) or the accelerator's name (GBS), for people
    size: int
    payload: tuple[int, int]  # (offset, length) of the bitstream proper in the file

    def digest(self) -> str:
        """sha256 of the whole file, as a claim's FpgaConfig.digest names it."""
        sha = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        return f"sha256:{sha.hexdigest()}"


def read(path: Path) -> Bitstream:
    family = SUFFIXES.get(path.suffix)
    if family is None:
        raise BitstreamError(f"{path}: not a .xclbin or .gbs file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_AXLF_HEADER + _HEADER.size if family == ALVEO else 20)
            if family == ALVEO:
                return _xclbin(path, f, head, size)
            return _gbs(path, f, head, size)
    except OSError as err:
        raise BitstreamError(f"{path}: cannot read it: {err.strerror or err}") from err


def _xclbin(path: Path, f, head: bytes, size: int) -> Bitstream:
    if len(head) < _AXLF_HEADER + _HEADER.size or head[:8] != XCLBIN_MAGIC:
        raise BitstreamError(f"{path}: not an xclbin (no xclbin2 axlf header)")
    (length, _, _, _, _, _, _, _, interface, vbnv, xclbin_uuid, _, sections) = \
        _HEADER.unpack_from(head, _AXLF_HEADER)
    if length > size:
        raise BitstreamError(f"{path}: truncated: the header says {length} bytes, the file has {size}")
    if not any(interface):
        raise BitstreamError(f"{path}: the xclbin has no interface UUID (a flat shell's xclbin "
                             "cannot be loaded into a partial-reconfiguration region)")
    if sections > 0x10000:
        raise BitstreamError(f"{path}: {sections} sections, more than XRT allows")
    f.seek(_AXLF_HEADER + _HEADER.size)
    table = f.read(sections * _SECTION.size)
    if len(table) < sections * _SECTION.size:
        raise BitstreamError(f"{path}: truncated section table")
    payload = None
    for i in range(sections):
        kind, _, offset, length_ = _SECTION.unpack_from(table, i * _SECTION.size)
        if kind == BITSTREAM_SECTION:
            payload = (offset, length_)
    if payload is None or payload[0] + payload[1] > size:
        raise BitstreamError(f"{path}: the xclbin has no BITSTREAM section within the file")
    return Bitstream(path, ALVEO, str(uuid.UUID(bytes=interface)), str(uuid.UUID(bytes=xclbin_uuid)),
                     vbnv.split(b"\0", 1)[0].decode(errors="replace"), size, payload)


def _gbs(path: Path, f, head: bytes, size: int) -> Bitstream:
    if len(head) < 20 or head[:16] != GBS_GUID.bytes:
        raise BitstreamError(f"{path}: not a GBS (no {GBS_GUID} header)")
    (length,) = struct.unpack_from("<I", head, 16)
    if not 0 < length <= min(MAX_GBS_METADATA, size - 20):
        raise BitstreamError(f"{path}: the GBS metadata length {length} does not fit the file")
    try:
        metadata = json.loads(f.read(length))
        image = metadata["afu-image"]
        interface = image["interface-uuid"]
        cluster = image["accelerator-clusters"][0]
        function = cluster["accelerator-type-uuid"]
        magic = image.get("magic-no")
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise BitstreamError(f"{path}: GBS metadata lacks afu-image interface-uuid or "
                             f"accelerator-clusters[0].accelerator-type-uuid ({err!r})") from err
    if magic != GBS_MAGIC_NO:
        raise BitstreamError(f"{path}: afu-image.magic-no is {magic!r}, OPAE wants {GBS_MAGIC_NO}")
    ids = [canonical_uuid(str(interface)), canonical_uuid(str(function))]
    if None in ids:
        raise BitstreamError(f"{path}: interface-uuid {interface!r} or accelerator-type-uuid "
                             f"{function!r} is not a UUID")
    return Bitstream(path, DFL, ids[0], ids[1], str(cluster.get("name", "")), size,
                     (20 + length, size - 20 - length))


@dataclass(frozen=True)
class Lookup:
    """What the store holds for one function: the file that fits the shell, if any, and
    every file of that function (to name them when none fits)."""

    fits: Bitstream | None
    candidates: tuple[Bitstream, ...]
    unreadable: tuple[str, ...]  # files in the store that are not bitstreams (their errors)


class BitstreamStore:
    """A directory of bitstreams, read when asked (a prepare that programs), headers only:
    an operator adds a file and the next claim finds it, with no restart."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def scan(self) -> tuple[list[Bitstream], list[str]]:
        if self.root is None:
            return [], []
        found, errors = [], []
        for dirpath, _, files in os.walk(self.root, followlinks=False):
            for name in sorted(files):
                path = Path(dirpath) / name
                if path.suffix not in SUFFIXES:
                    continue
                try:
                    found.append(read(path))
                except BitstreamError as err:
                    errors.append(str(err))
        return found, errors

    def lookup(self, function: str, interface: str | None, family: str) -> Lookup:
        found, errors = self.scan()
        mine = tuple(b for b in found if b.function == function and b.family == family)
        fits = [b for b in mine if interface is not None and b.interface == interface]
        return Lookup(min(fits, key=lambda b: str(b.path)) if fits else None, mine, tuple(errors))
