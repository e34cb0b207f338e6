"""`dra-driver` with only what the image installs (requirements.lock): no cel-python, the
`demo` extra that explain and the demo need. Found on the local cluster's node, where the
MPS control daemon pod, running our image, crashed at `dra-driver mps-control-daemon` with
"No module named 'celpy'": building the CLI's parser imported explain's engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

# The interpreter as the image has it: cel-python's modules cannot be imported.
WITHOUT_CEL = ("import sys; sys.modules['celpy'] = None; sys.modules['lark'] = None; "
               "from driver.cli import main; sys.exit(main(sys.argv[1:]))")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_CEL, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_the_image_installs_no_cel_python():
    """The premise: what the Dockerfile installs (requirements.lock) has no CEL library."""
    pins = {line.split("==")[0].strip().lower() for line in (REPO / "requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert "cel-python" not in pins and "lark" not in pins, pins


@pytest.mark.parametrize("args", [["mps-control-daemon", "--help"], ["run", "--help"],
                                  ["discover", "--mock", "mixed"]])
def test_commands_of_the_image_run_without_cel_python(args):
    done = cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "celpy" not in done.stderr


def test_explain_without_cel_python_says_what_it_needs_in_one_line():
    done = cli("explain", "-f", "examples/gpu-single/claim.yaml", "--mock", "mixed")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dra-driver explain: needs cel-python (celpy is not installed), the [demo] extra: "
        "pip install -e '.[demo]' in the checkout, or pip install 'cel-python>=0.5'"]


def test_demo_without_cel_python_gives_the_same_hint_as_explain():
    done = cli("demo", "--claim", "examples/gpu-single/claim.yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dra-driver demo: needs cel-python (celpy is not installed), the [demo] extra: "
        "pip install -e '.[demo]' in the checkout, or pip install 'cel-python>=0.5'"]
