"""Tools the tests build from the Go module proxy with hack/local-cluster/build.sh, as CI
builds them: the version pinned in versions.env, and the build (a stamp check once built).
Without Go a test that needs one is skipped with the reason; under CI=true it fails (CI
installs Go, so a missing tool there is a broken CI, not an optional extra)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = ROOT / "hack" / "local-cluster"


def pinned(variable: str) -> str:
    """The version versions.env pins for VARIABLE (the environment may override it)."""
    text = (LOCAL_CLUSTER / "versions.env").read_text()
    found = re.search(rf"{variable}=\$\{{{variable}:-(v[^}}]+)\}}", text)
    assert found, f"versions.env names no {variable}"
    return os.environ.get(variable, found.group(1))


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; required under CI=true")
    pytest.skip(reason)


def build(target: str) -> None:
    """`build.sh TARGET`; skips (fails under CI) without Go."""
    if shutil.which("go") is None:
        skip_or_fail(f"Go is not installed: build.sh {target} cannot build it")
    done = subprocess.run([str(LOCAL_CLUSTER / "build.sh"), target], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
