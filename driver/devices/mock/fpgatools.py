"""The mock node's FPGA images and programming tools: `xbutil program` and `fpgaconf`
as the driver runs them (driver/devices/fpgatools.py), acting on the mock sysfs.

Like the real tools they read the image's header, refuse an image whose interface UUID
is not the shell's (the card is left untouched), print progress, and change what the
kernel publishes: `logic_uuids` of the Alveo user function, `afu_id` of DFL port 0. The
region is cleared first and written last, as a partial reconfiguration leaves it between
the two: a tool killed halfway leaves an empty `logic_uuids` / zero `afu_id`. An image
whose bitstream proper starts with `MOCK-FAIL` fails the download (as a corrupt
bitstream does on a card); `MOCK-SLOW:<seconds>` makes the download take that long.

    python -m driver.devices.mock.fpgatools --root ROOT xbutil program --device BDF --user FILE
    python -m driver.devices.mock.fpgatools --root ROOT fpgaconf [--segment S] -B B -D D -F F FILE
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import uuid
from pathlib import Path

from driver.devices import bitstreams
from driver.devices.bitstreams import BitstreamError

FAIL, SLOW = b"MOCK-FAIL", b"MOCK-SLOW:"
# The images of the mock node's store, per catalog card: a working function, one whose
# download takes longer than the driver's budget, one whose download fails.
MOCK_IMAGES = {"vadd": b"\0" * 64, "slow": SLOW + b"120\0", "broken": FAIL + b"\0"}
_FUNCTIONS = uuid.UUID("3c7d5a52-8f0e-4f55-9a47-2f6f4e1c0b11")


def function_id(function: str, model: str) -> str:
    """The function UUID of a mock image (stable: the docs and the example name them)."""
    return str(uuid.uuid5(_FUNCTIONS, f"{function}-{model}"))


# -- images ------------------------------------------------------------------------------------
def xclbin(interface: str, function: str, vbnv: str, payload: bytes = b"\0" * 64) -> bytes:
    """A minimal axlf container: header, one BITSTREAM section (XRT's xclbin.h layout)."""
    sections = 1
    table_end = 304 + 152 + 40 * sections
    offset = (table_end + 7) & ~7  # sections are 8-byte aligned
    length = offset + len(payload)
    head = bitstreams.XCLBIN_MAGIC + struct.pack("<i", -1) + b"\xff" * 28 + b"\0" * 256 \
        + struct.pack("<Q", 1)
    header = struct.pack("<QQQHBBHH16s64s16s16sI4x", length, 0, 0, 0, 2, 1, 1, 0,
                         uuid.UUID(interface).bytes, vbnv.encode()[:63], uuid.UUID(function).bytes,
                         b"", sections)
    section = struct.pack("<I16s4xQQ", bitstreams.BITSTREAM_SECTION, b"bitstream", offset, len(payload))
    blob = head + header + section
    return blob + b"\0" * (offset - len(blob)) + payload


def gbs(interface: str, function: str, name: str, payload: bytes = b"\0" * 64) -> bytes:
    """A GBS as OPAE's packager writes it: GUID, metadata length, JSON, bitstream."""
    metadata = json.dumps({
        "version": 1, "platform-name": "mock",
        "afu-image": {"magic-no": bitstreams.GBS_MAGIC_NO, "interface-uuid": interface,
                      "accelerator-clusters": [{"name": name, "total-contexts": 1,
                                                "accelerator-type-uuid": function}]},
    }).encode()
    return bitstreams.GBS_GUID.bytes + struct.pack("<I", len(metadata)) + metadata + payload


# -- tools --------------------------------------------------------------------------------------
def _payload(image: bitstreams.Bitstream) -> bytes:
    with open(image.path, "rb") as f:
        f.seek(image.payload[0])
        return f.read(min(image.payload[1], 64))


def _download(image: bitstreams.Bitstream, target: Path, published: str, tool: str) -> int:
    payload = _payload(image)
    seconds = 0.0
    if payload.startswith(SLOW):
        seconds = float(payload[len(SLOW):].split(b"\0", 1)[0] or 0)
    print(f"{tool}: downloading {image.path.name} ({image.size} bytes)", flush=True)
    target.write_text(("0" * 32 if tool == "fpgaconf" else "") + "\n")  # region cleared
    steps = 4
    for step in range(1, steps + 1):
        time.sleep(seconds / steps)
        print(f"{tool}: {step * 100 // steps}%", flush=True)
        if payload.startswith(FAIL) and step == 2:
            print(f"ERROR: {tool}: bitstream download failed (configuration error)", flush=True)
            return 1
    target.write_text(published + "\n")
    return 0


def xbutil(root: Path, args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="xbutil")
    parser.add_argument("command", choices=["program"])
    parser.add_argument("--device", "-d", required=True)
    parser.add_argument("--user", "-u", required=True)
    opts = parser.parse_args(args)
    user = root / "sys" / "bus" / "pci" / "devices" / opts.device
    if not (user / "interface_uuids").exists():
        print(f"ERROR: no user function {opts.device}", flush=True)
        return 1
    try:
        image = bitstreams.read(Path(opts.user))
    except BitstreamError as err:
        print(f"ERROR: {err}", flush=True)
        return 1
    shell = bitstreams.canonical_uuid((user / "interface_uuids").read_text().split()[0])
    if image.family != bitstreams.ALVEO or image.interface != shell:
        print(f"ERROR: xclbin interface {image.interface} does not match the shell's {shell}", flush=True)
        return 1
    return _download(image, user / "logic_uuids", image.function, "xbutil")


def fpgaconf(root: Path, args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fpgaconf")
    parser.add_argument("--segment", default="0x0000")
    parser.add_argument("-B", "--bus", required=True)
    parser.add_argument("-D", "--device", required=True)
    parser.add_argument("-F", "--function", required=True)
    parser.add_argument("gbs")
    opts = parser.parse_args(args)
    bdf = (f"{int(opts.segment, 16):04x}:{int(opts.bus, 16):02x}:{int(opts.device, 16):02x}."
           f"{int(opts.function, 16)}")
    function = (root / "sys" / "bus" / "pci" / "devices" / bdf).resolve()
    compat = sorted(function.glob("fpga_region/*/dfl-fme.*/*/fpga_region/*/compat_id"))
    ports = sorted(function.glob("fpga_region/*/dfl-port.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if not compat or not ports:
        print(f"Error: no suitable FPGA at {bdf}", flush=True)
        return 1
    try:
        image = bitstreams.read(Path(opts.gbs))
    except BitstreamError as err:
        print(f"Error: {err}", flush=True)
        return 1
    if image.family != bitstreams.DFL or image.interface != bitstreams.canonical_uuid(compat[0].read_text()):
        print(f"Error: interface id {image.interface} doesn't match the FIM's", flush=True)
        return 1
    return _download(image, ports[0] / "afu_id", image.function.replace("-", ""), "fpgaconf")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--root" or argv[2] not in ("xbutil", "fpgaconf"):
        print(__doc__, file=sys.stderr)
        return 2
    root, tool, rest = Path(argv[1]), argv[2], argv[3:]
    return xbutil(root, rest) if tool == "xbutil" else fpgaconf(root, rest)


if __name__ == "__main__":
    sys.exit(main())
