"""Where this node's devices are read from: the real /sys, /dev, /proc and NVML, or a mock."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.config import Config
from driver.devices import mock
from driver.devices.discovery import Sources
from driver.devices.nvml import load_nvml


@dataclass(frozen=True)
class NodeRoots:
    sysfs: Path
    dev: Path
    proc: Path
    nvml: Any | None
    mock: mock.MockNode | None = None
    driver_root_host: Path = Path("/")  # NVIDIA driver files, as the runtime finds them
    driver_root_local: Path = Path("/")  # the same, as this process sees them

    def sources(self, config: Config) -> Sources:
        return Sources(self.sysfs, self.proc, self.nvml, config.nic_filter)


def open_node(config: Config, mock_root: Path | None = None) -> NodeRoots:
    """The real node, or the mock profile's trees generated under `mock_root`
    (default: `<state-dir>/mock`, so that CDI host paths stay valid while the driver runs)."""
    if config.mock is None:
        return NodeRoots(config.sysfs_root, config.dev_root, config.proc_root, load_nvml(),
                         driver_root_host=config.nvidia_driver_root,
                         driver_root_local=config.nvidia_driver_root_mount)
    node = mock.build(config.mock, mock_root or config.state_dir / "mock")
    return NodeRoots(node.sysfs, node.dev, node.proc, node.nvml, node,
                     driver_root_host=node.driver_root, driver_root_local=node.driver_root)
