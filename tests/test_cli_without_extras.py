"""`dra-driver` and the image's dependencies (requirements.lock). The image once had no
cel-python (then the `demo` extra): the MPS control daemon pod, running our image, crashed
at `dra-driver mps-control-daemon` with "No module named 'celpy'" (building the CLI's parser
imported explain's engine), and `run`'s fragmentation gauges exported nothing without a
word. cel-python is a runtime dependency now, pinned with what it needs; where an install
lacks it anyway, the commands that do not evaluate CEL still run, and those that do say so."""

from __future__ import annotations

import importlib.metadata
import json
import re
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


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_key(name.strip())] = version.strip()
    return pins


def test_the_image_installs_cel_python_and_what_it_needs():
    """What the Dockerfile installs (requirements.lock, pip --no-deps) has the CEL library and,
    for every pinned package installed here at its pinned version, each of its requirements
    (for the image's CPython 3.12 on Linux): with --no-deps nothing else would bring them."""
    from packaging.requirements import Requirement

    pins = lock_pins()
    assert {"cel-python", "lark"} <= set(pins), pins
    image = {"python_version": "3.12", "python_full_version": "3.12.8", "sys_platform": "linux",
             "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
             "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    checked, missing = set(), []
    for name, version in pins.items():
        try:
            if importlib.metadata.version(name) != version:
                continue  # another version here: its requirements may differ from the pinned one's
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        checked.add(name)
        for text in requires:
            requirement = Requirement(text)
            if (requirement.marker is None or requirement.marker.evaluate(image)) and _key(requirement.name) not in pins:
                missing.append(f"{name}=={version} needs {text}")
    if "cel-python" not in checked:
        pytest.skip(f"cel-python {pins['cel-python']} (the pin) is not the version installed here")
    assert not missing, missing


@pytest.mark.parametrize("args", [["mps-control-daemon", "--help"], ["run", "--help"],
                                  ["discover", "--mock", "mixed"]])
def test_commands_that_evaluate_no_cel_run_without_cel_python(args):
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


GAUGES_WITHOUT_CEL = """
import sys
sys.modules['celpy'] = None
sys.modules['lark'] = None
from driver import logs
from driver.explain.capacitymetrics import CapacityCollector
from driver.metrics import Metrics
from driver.publish import mocknode

logs.configure("json", "info")
objects = mocknode.mock_objects("mixed", "accel.dra.io", "exclusive", "static")
metrics = Metrics("accel.dra.io")
metrics.registry.register(CapacityCollector("accel.dra.io", lambda taints: objects, list))
for _ in range(3):  # three scrapes
    exposed = metrics.exposition().decode()
print("SERIES", sum(line.startswith("dra_driver_capacity_") for line in exposed.splitlines()))
"""


def test_run_s_gauges_without_cel_python_say_so_once_and_export_nothing():
    """The collector of `run` (driver/explain/capacitymetrics.py) where cel-python cannot be
    imported: the scrapes work, without the gauges' series, and the log says why once."""
    done = subprocess.run([sys.executable, "-c", GAUGES_WITHOUT_CEL], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    assert "SERIES 0" in lines, lines
    events = [json.loads(line) for line in lines if line.startswith("{")]
    warned = [e for e in events if e.get("event") == "capacity_gauges_unavailable"]
    assert len(warned) == 1, events
    assert warned[0]["level"] == "warning" and warned[0]["missing"] == "celpy", warned
    assert "cel-python" in warned[0]["hint"]
