from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from driver.devices import mock
from driver.devices.discovery import DiscoveryResult, discover
from driver.devices.net import NicFilter
from driver.prepare import shm

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"  # optional extras (the upstream CDI schema); never required
# Where tests/driverproc.py makes socket-friendly short folders: named after this pytest
# process, so that cleaning up never touches another session's or a user's folders.
SHORT_TMP_PREFIX = f"/tmp/dra-test-{os.getpid()}-"


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest process gets a base folder of its own. pytest's default numbered
    folders (/tmp/pytest-of-USER/pytest-N) are shared by every session on the machine, and
    under a retention policy of "none" a session that ends removes all of them, a running
    session's included: two test runs at once then failed each other with
    FileNotFoundError. A folder named after this process is removed by this process only."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix=f"dra-pytest-{os.getpid()}-")
        config.add_cleanup(lambda: shutil.rmtree(config.option.basetemp, ignore_errors=True))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Many tests run the driver as its own process, and the emulated kubelet starts pods
    that run `dra-driver` by name: those import `driver` from wherever it is installed,
    not from this folder. An install of another checkout (or an older copy) would make
    them test that code and fail in ways that say nothing about the cause, so stop first
    with the one line that does."""
    here = (REPO / "driver").resolve()
    probe = subprocess.run(
        [sys.executable, "-c", "import driver, os; print(os.path.dirname(os.path.realpath(driver.__file__)))"],
        cwd="/", capture_output=True, text=True, timeout=120,
    )
    found = probe.stdout.strip() or (probe.stderr.strip().splitlines() or ["nothing"])[-1]
    if found != str(here):
        pytest.exit(f"{sys.executable} imports the driver from {found}, not from this checkout "
                    f"({here}); the tests start the driver as its own process, so install "
                    "this checkout first: pip install -e '.[test]'", returncode=4)


@pytest.fixture(autouse=True)
def _remove_short_temp_folders():
    """Whatever a test does (including failing half-way), the driver processes it started
    in its short folders are killed and the folders removed after it. A test that fails
    between starting a driver and terminating it left that driver running for the rest of
    the session (two were found after a run here, busy with their periodic work)."""
    yield
    leftovers = _kill_processes_mentioning(SHORT_TMP_PREFIX)
    parent = Path(SHORT_TMP_PREFIX).parent
    for path in parent.glob(Path(SHORT_TMP_PREFIX).name + "*"):
        shm.release_all_under(path)  # a killed driver's MPS tmpfs mounts
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        warnings.warn(f"killed {len(leftovers)} process(es) the test left running: {leftovers}")


def _kill_processes_mentioning(text: str) -> list[str]:
    """SIGKILL every process whose command line contains `text` (this session's folder
    prefix, so no other session's or user's processes); their command lines, shortened."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in argv if a)
        if text in line:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(line[:120])
    return killed


def discover_profile(profile: str | mock.Profile, root: Path,
                     nic_filter: NicFilter = NicFilter()) -> tuple[mock.MockNode, DiscoveryResult]:
    if isinstance(profile, str):
        profile = mock.load(profile)
    node = mock.build(profile, root)
    return node, discover(node.sources(nic_filter))


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """Read-only discovery results per built-in profile, built once per session (the scale
    profile's tree has ~14,000 symlinks and takes seconds to write)."""
    cache: dict[str, tuple[mock.MockNode, DiscoveryResult]] = {}

    def get(name: str) -> tuple[mock.MockNode, DiscoveryResult]:
        if name not in cache:
            cache[name] = discover_profile(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[mock.MockNode, DiscoveryResult]:
    return discover_profile("mixed", tmp_path / "mock")
