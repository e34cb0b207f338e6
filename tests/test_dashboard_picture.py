"""docs/images/utilization-dashboard.png is held to the dashboard the chart ships.

hack/hack_dashboard.py writes what it drew the picture from (the dashboard's sha256 and each
panel's id and title) into the PNG's "Description" text chunk. These tests read it with the
standard library only: matplotlib and PIL are tools of the demo, not of the test suite.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PICTURE = REPO / "docs" / "images" / "utilization-dashboard.png"
DASHBOARD = REPO / "charts" / "dra-accel-driver" / "dashboards" / "dra-accel-driver.json"
SIGNATURE = b"\x89PNG\r\n\x1a\n"
REDRAW = "run `python3 hack/utilization-demo.py --png docs/images/utilization-dashboard.png` (needs matplotlib)"


def png_text(data: bytes, name: str) -> dict[str, str]:
    """The text chunks (tEXt, zTXt, iTXt) of a PNG, by keyword, as the PNG spec lays them out."""
    if not data.startswith(SIGNATURE):
        raise ValueError(f"{name}: not a PNG")
    found: dict[str, str] = {}
    at = len(SIGNATURE)
    while at < len(data):
        if at + 8 > len(data):
            raise ValueError(f"{name}: truncated chunk header at byte {at}")
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        stored = data[at + 8 + length:at + 12 + length]
        if len(body) != length or len(stored) != 4 or zlib.crc32(kind + body) != struct.unpack(">I", stored)[0]:
            raise ValueError(f"{name}: chunk {kind!r} at byte {at} is damaged")
        at += 12 + length
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            found[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            found[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed = rest[0] == 1
            _language, _, rest = rest[2:].partition(b"\0")
            _translated, _, text = rest.partition(b"\0")
            found[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode("utf-8")
        elif kind == b"IEND":
            break
    return found


def drift(picture: bytes, dashboard: dict, name: str = "docs/images/utilization-dashboard.png") -> str | None:
    """Why the picture no longer shows the dashboard's panels, or None when it does."""
    description = png_text(picture, name).get("Description")
    if description is None:
        return f"{name} does not say which dashboard it was drawn from: {REDRAW}"
    try:
        drawn = [(p["id"], p["title"]) for p in json.loads(description)["panels"]]
    except (ValueError, KeyError, TypeError):
        return f"{name}: its Description is not hack/hack_dashboard.py's record of the panels: {REDRAW}"
    shipped = [(p["id"], p["title"]) for p in dashboard["panels"]]
    if drawn == shipped:
        return None
    gone = [f"{i}: {t!r}" for i, t in drawn if (i, t) not in shipped]
    new = [f"{i}: {t!r}" for i, t in shipped if (i, t) not in drawn]
    return (f"{name} was drawn with panel titles the dashboard no longer has ({', '.join(gone) or 'none'}) "
            f"and lacks its panels {', '.join(new) or '(order differs)'}: {REDRAW}")


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def tiny_png(*text_chunks: bytes) -> bytes:
    """A valid 1x1 grey PNG with the given text chunks before its image data."""
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    image = chunk(b"IDAT", zlib.compress(b"\0\x80"))
    return SIGNATURE + header + b"".join(text_chunks) + image + chunk(b"IEND", b"")


def description(panels: list[tuple[int, str]]) -> str:
    return json.dumps({"panels": [{"id": i, "title": t, "drawn": t} for i, t in panels]})


SHIPPED = {"panels": [{"id": 1, "title": "Idle longer than $idle"}, {"id": 7, "title": "Kernel time per claim"}]}


def test_the_picture_was_drawn_with_the_shipped_dashboards_panel_titles() -> None:
    problem = drift(PICTURE.read_bytes(), json.loads(DASHBOARD.read_text()))
    assert problem is None, problem


def test_a_renamed_panel_is_named_and_the_demo_is_pointed_to() -> None:
    old = tiny_png(chunk(b"tEXt", b"Description\0" + description(
        [(1, "Idle longer than $idle"), (7, "SM utilization per claim")]).encode()))
    problem = drift(old, SHIPPED)
    assert "'SM utilization per claim'" in problem
    assert "7: 'Kernel time per claim'" in problem
    assert "hack/utilization-demo.py" in problem


def test_a_picture_without_the_record_is_drift() -> None:
    # What the pictures drawn before the record existed look like: a Software chunk only.
    problem = drift(tiny_png(chunk(b"tEXt", b"Software\0Matplotlib version3.8")), SHIPPED)
    assert "does not say which dashboard" in problem
    assert "hack/utilization-demo.py" in problem


def test_an_added_panel_is_drift() -> None:
    picture = tiny_png(chunk(b"tEXt", b"Description\0" + description([(1, "Idle longer than $idle")]).encode()))
    assert "7: 'Kernel time per claim'" in drift(picture, SHIPPED)


@pytest.mark.parametrize("kind", ["tEXt", "zTXt", "iTXt", "iTXt compressed"])
def test_each_kind_of_text_chunk_is_read(kind: str) -> None:
    text = description([(1, "Idle longer than $idle"), (7, "Kernel time per claim")])
    if kind == "tEXt":
        body = b"Description\0" + text.encode("latin-1")
    elif kind == "zTXt":
        body = b"Description\0\0" + zlib.compress(text.encode("latin-1"))
    elif kind == "iTXt":
        body = b"Description\0\0\0en\0\0" + text.encode("utf-8")
    else:
        body = b"Description\0\1\0en\0\0" + zlib.compress(text.encode("utf-8"))
    assert drift(tiny_png(chunk(kind[:4].encode(), body)), SHIPPED) is None


def test_a_damaged_picture_is_one_line_naming_the_file() -> None:
    good = tiny_png(chunk(b"tEXt", b"Description\0{}"))
    damaged = good[:40] + bytes([good[40] ^ 0xFF]) + good[41:]
    with pytest.raises(ValueError, match=r"^utilization-dashboard\.png: chunk .* is damaged$"):
        png_text(damaged, "utilization-dashboard.png")
    with pytest.raises(ValueError, match="not a PNG"):
        png_text(b"GIF89a", "utilization-dashboard.png")
