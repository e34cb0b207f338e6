"""What a user sees matches what is so (issue 29.9): the demo's labels and hints, the
help and error texts, and the names the docs promise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from driver.demo.podman import ready as podman_ready
from tests.conftest import REPO
from tests.test_chart import render
from tests.test_demo import _demo


def test_demo_help_shows_no_none_defaults():
    done = subprocess.run([sys.executable, "-m", "driver", "demo", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    assert "(default: None)" not in done.stdout and "(default: mixed)" in done.stdout


def test_an_option_that_takes_0_says_so_when_out_of_range():
    done = subprocess.run([sys.executable, "-m", "driver", "run", "--idle-after", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--idle-after: -1.0 is outside 1..86400 seconds (or 0 for off)" in done.stderr, done.stderr


def test_a_builtin_claim_that_misses_its_own_profile_says_why(tmp_path):
    """a100-mig with --mig-mode dynamic: mig-slice was 'not on profile a100-mig (fits
    a100-mig)'; and share-b was 'beside share-a' on another GPU."""
    code, out, err = _demo("--profile", "a100-mig", "--mig-mode", "dynamic", cdi_root=tmp_path)
    assert code == 0, out + err
    text = "\n".join(out)
    assert "mig-slice (fits a100-mig)" not in text
    assert "not on profile a100-mig with --mig-mode dynamic:" in text
    assert "mig-slice (it fits a100-mig with --mig-mode static; in dynamic mode" in text
    assert "== claim share-b: 30Gi and 50% of a GPU, on another GPU than share-a (no room left " \
           "beside it)" in text
    code, out, err = _demo("--profile", "mixed", cdi_root=tmp_path)
    assert "== claim share-b: 30Gi and 50% of a GPU, beside share-a\n" in "\n".join(out) + "\n"


def test_only_containers_given_mps_show_a_pipe_directory():
    """On l4, the containers after share-a printed an empty 'MPS pipe directory:' line
    (the mount point share-a's container left in the shared rootfs)."""
    if podman_ready() is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the container tests: {podman_ready()}")
        pytest.skip(f"podman cannot run here: {podman_ready()}")
    code, out, err = _demo("--profile", "l4")
    assert code == 0, out + err
    lines = [line.strip() for line in out]
    assert "MPS pipe directory:" not in lines, out
    assert lines.count("MPS pipe directory: control nvidia-cuda-mps-control.pid") == 1


def test_the_docs_name_the_admission_policy_the_chart_renders():
    (policy,) = [o for o in render() if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"].endswith("-opaque-config")]
    docs = (REPO / "docs" / "claim-status.md").read_text()
    assert f"`{policy['metadata']['name']}`" in docs  # the release is named dra in render()
    assert "`<release>-dra-accel-driver-opaque-config`" in docs


def test_the_mig_dynamic_readme_says_how_explain_sees_too_many():
    readme = (REPO / "examples" / "mig-dynamic" / "README.md").read_text()
    assert "explain judges each claim\nalone" in readme
    from tests.test_explain import run

    code, out, _ = run("-f", str(REPO / "examples" / "mig-dynamic" / "claim.yaml"), "--mock", "h100x8",
                       "--mig-mode", "dynamic")
    assert code == 0 and "Claim default/too-many (ResourceClaim from claim.yaml): fits" in out


def test_the_readme_shows_the_demo_line_for_line():
    """The README's demo output is what `dra-driver demo` prints here (where containers
    run), with ports, PIDs and UIDs written as placeholders."""
    import re

    if podman_ready() is not None:
        pytest.skip(f"the README shows containers; podman cannot run here: {podman_ready()}")
    readme = (REPO / "docs" / "demo.md").read_text()  # the README links it
    block = readme.split("Output (CI runs it too):\n\n```\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-m", "driver", "demo"], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr

    def normal(text: str) -> list[str]:
        text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
        text = re.sub(r"/tmp/dra-demo-\d+-\w+", "/tmp/dra-demo-PID-XXXX", text)
        text = re.sub(r"demo-\d+-[0-9a-f-]{36}", "demo-PID-UID", text)
        text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "SHAREID", text)
        return text.strip().splitlines()

    assert normal(done.stdout) == normal(block)
