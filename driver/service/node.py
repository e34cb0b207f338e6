"""Where this node's devices are read from: the real /sys, /dev, /proc and NVML, or a mock."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

from driver.service.config import Config
from driver.devices import mock
from driver.devices.discovery import Sources
from driver.devices.nvml import bind_library, load_nvml
from driver.devices.pciids import PciIds
from driver.state.instance import Instance


@dataclass(frozen=True)
class NodeRoots:
    sysfs: Path
    dev: Path
    proc: Path
    nvml: Any | None
    mock: mock.MockNode | None = None
    driver_root_host: Path = Path("/")  # NVIDIA driver files, as the runtime finds them
    driver_root_local: Path = Path("/")  # the same, as this process sees them
    pci_ids: PciIds = field(default_factory=PciIds)  # read once, at the first lookup

    @classmethod
    def of_mock(cls, node: mock.MockNode) -> "NodeRoots":
        """A mock node's trees, NVML and driver root, as a real node's would be."""
        return cls(node.sysfs, node.dev, node.proc, node.nvml, node,
                   driver_root_host=node.driver_root, driver_root_local=node.driver_root,
                   pci_ids=node.pci_db)

    def sources(self, config: Config, mig_mode: str | None = None,
                owned_mig: Callable[[], set] = set,
                away_netdevs: Callable[[], tuple] = tuple) -> Sources:
        if self.mock is None and self.nvml is not None:
            # Each discovery (start, rediscovery) looks again: the installation may have
            # appeared under the driver root since the last one.
            library = bind_library(self.nvml, self.driver_root_local)
            if library is not None:  # not there at start: from now on GPUs are published
                structlog.get_logger(component="nvml").info("nvml_library_loaded", library=str(library))
        return Sources(self.sysfs, self.proc, self.nvml, config.nic_filter, self.pci_ids,
                       mig_mode or config.mig_mode, owned_mig, away_netdevs, config.mig_profiles)


def open_node(config: Config, mock_root: Path | None = None,
              instance: Instance | None = None) -> NodeRoots:
    """The real node, or the mock profile's trees generated under `mock_root`
    (default: `<state-dir>/mock`, so that CDI host paths stay valid while the driver runs).
    While another instance runs (an upgrade), its mock tree is shared, not rebuilt."""
    if config.mock is None:
        return NodeRoots(config.sysfs_root, config.dev_root, config.proc_root, load_nvml(config.nvidia_driver_root_mount),
                         driver_root_host=config.nvidia_driver_root,
                         driver_root_local=config.nvidia_driver_root_mount)
    root = mock_root or config.state_dir / "mock"
    node = None
    if instance is not None and instance.peers():
        node = mock.attach(config.mock, root)
        if node is None:  # the other instance runs another profile: keep out of its way
            root = root.with_name(f"{root.name}-{instance.token}")
    if node is None:
        node = mock.build(config.mock, root)
    return NodeRoots.of_mock(node)
