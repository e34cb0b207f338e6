"""The suite must not depend on being alone on the machine (two developers, or CI and a
developer, run it at once)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_writes_to_its_tmp_path(tmp_path):
    """Run on its own by the test below, as a second session that uses tmp_path."""
    (tmp_path / "f").write_text("y")
    assert (tmp_path / "f").read_text() == "y"


def test_a_second_pytest_session_leaves_this_sessions_tmp_path_alone(tmp_path):
    marker = tmp_path / "still-here"
    marker.write_text("x")
    # A whole second session, run to its end while this one is running: it used to remove
    # every /tmp/pytest-of-USER/pytest-N at its exit, this session's included.
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).name}::test_writes_to_its_tmp_path"],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300,
    )
    assert inner.returncode == 0, inner.stdout[-2000:] + inner.stderr[-2000:]
    assert marker.read_text() == "x"
