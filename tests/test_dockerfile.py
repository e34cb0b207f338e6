"""The Dockerfile cannot be built here (no container engine): check what can be checked."""

from __future__ import annotations

import re
import tomllib

from driver.cli import parser
from tests.conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in DOCKERFILE.splitlines() if line.startswith(name + " ")]


def test_copied_files_exist():
    for args in instructions("COPY"):
        if args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (REPO / source).exists(), source


def test_base_image_is_pinned():
    (arg,) = [a for a in instructions("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", arg)


def test_entrypoint_matches_the_cli():
    import json

    (entrypoint,) = [json.loads(a) for a in instructions("ENTRYPOINT")]
    (cmd,) = [json.loads(a) for a in instructions("CMD")]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert entrypoint == ["dra-driver"] and "dra-driver" in project["scripts"]
    args = parser().parse_args(cmd)
    assert args.command == "run"


def test_lock_pins_every_runtime_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{line}: not pinned exactly"
            pins[name.lower().replace("_", "-")] = version
    for dependency in project["dependencies"]:
        name = re.split(r"[<>=!~ ;\[]", dependency, 1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in requirements.lock"


def test_usage_comment_matches_the_entrypoint():
    """With ENTRYPOINT dra-driver, `docker run IMAGE dra-driver ...` would run `dra-driver
    dra-driver ...`: every example in the comments passes the subcommand directly."""
    for line in DOCKERFILE.splitlines():
        if "docker run IMAGE" in line:
            assert "docker run IMAGE dra-driver" not in line, line
            args = line.split("docker run IMAGE", 1)[1].split("`", 1)[0].split()
            assert parser().parse_args(args + ["--node-name", "n"]).command in ("discover", "run")


def test_the_image_has_the_pci_id_database():
    from driver.devices.pciids import SYSTEM_PATHS

    assert re.search(r"apt-get install [^\n]*\bpci\.ids\b", DOCKERFILE)
    assert any(str(p) == "/usr/share/misc/pci.ids" for p in SYSTEM_PATHS), "where Debian's package puts it"


def test_the_pod_emulator_runs_containers_as_the_images_user():
    """driver/sim/pods.py runs a pod that does not ask for a user as the image's USER, so
    a pod of ours that needs root and forgets runAsUser fails in the fast tests too."""
    from driver.sim.pods import IMAGE_USER

    (user,) = instructions("USER")
    assert user.split(":")[0] == str(IMAGE_USER)
