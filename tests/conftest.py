from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from driver.devices import mock
from driver.devices.discovery import DiscoveryResult, discover
from driver.devices.net import NicFilter

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"  # optional extras (the upstream CDI schema); never required
# Where tests/driverproc.py makes socket-friendly short folders: named after this pytest
# process, so that cleaning up never touches another session's or a user's folders.
SHORT_TMP_PREFIX = f"/tmp/dra-test-{os.getpid()}-"


@pytest.fixture(autouse=True)
def _remove_short_temp_folders():
    """Whatever a test does (including failing half-way), the short folders it made for
    driver processes are removed after it."""
    yield
    parent = Path(SHORT_TMP_PREFIX).parent
    for path in parent.glob(Path(SHORT_TMP_PREFIX).name + "*"):
        shutil.rmtree(path, ignore_errors=True)


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
