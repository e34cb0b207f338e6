"""Mock node profiles: which cards sit on which PCIe root, in a small YAML format.

```yaml
description: two H100s, each beside a ConnectX-7 on its own PCIe root
nvidia: {driverVersion: "550.54.15", cudaDriverVersion: 12040}   # omit: no NVML
managementNic: {model: i350, ifName: eno1}                        # gets the default route
roots:                      # PCIe root complexes; cards on one root share pcieRoot
  - numa: 0
    repeat: 2               # this root, twice
    devices:
      - {type: gpu, model: h100-sxm5-80gb, mig: [3g.40gb, 3g.40gb]}
      - {type: nic, model: connectx-7, vfs: 4, rdma: true, link: up, mtu: 9000}
      - {type: alveo, model: u250}
      - {type: dfl, model: d5005, ports: 1}
```

Built-in profiles are files of the same format in `profiles/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from driver.devices.mock import catalog

MAX_DEVICES_PER_ROOT = 14  # each card gets its own bus below the root, within 0x10 buses


class ProfileError(ValueError):
    """A mock profile is unusable; the message names the profile and the offending field."""


@dataclass(frozen=True)
class GpuSpec:
    model: str
    mig: tuple[str, ...] = ()
    lost: bool = False  # NVML answers GpuIsLost for this GPU (tests the skip path)


@dataclass(frozen=True)
class NicSpec:
    model: str
    vfs: int = 0
    rdma: bool = False
    link: str = "up"
    mtu: int = 1500
    ifname: str | None = None


@dataclass(frozen=True)
class AlveoSpec:
    model: str


@dataclass(frozen=True)
class DflSpec:
    model: str
    ports: int = 1
    afu_id: str = "d8424dc4a4a3c413f89e433683f9040b"


CardSpec = GpuSpec | NicSpec | AlveoSpec | DflSpec


@dataclass(frozen=True)
class RootSpec:
    numa: int | None
    devices: tuple[CardSpec, ...]


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    driver_version: str | None  # None: NVML library absent
    cuda_driver_version: int
    management_nic: NicSpec | None
    roots: tuple[RootSpec, ...]


def builtin_profiles() -> list[str]:
    folder = resources.files("driver.devices.mock") / "profiles"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load(name_or_path: str) -> Profile:
    """A built-in profile by name, or a YAML file by path."""
    if name_or_path in builtin_profiles():
        text = (resources.files("driver.devices.mock") / "profiles" / f"{name_or_path}.yaml").read_text()
        return parse(text, name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"mock profile {name_or_path!r} is neither a built-in profile "
            f"({', '.join(builtin_profiles())}) nor a readable file"
        )
    try:
        text = path.read_text()
    except OSError as err:
        raise ProfileError(f"mock profile {path}: {err}") from err
    return parse(text, str(path))


def parse(text: str, source: str) -> Profile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ProfileError(f"mock profile {source}: not valid YAML: {err}") from err
    return _Parser(source).profile(data)


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> ProfileError:
        return ProfileError(f"mock profile {self.source}: {where}: {message}")

    def mapping(self, value: Any, where: str, allowed: set[str]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, "must be a mapping")
        unknown = set(value) - allowed
        if unknown:
            raise self.fail(where, f"unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        return value

    def boolean(self, value: Any, where: str) -> bool:
        # YAML's own booleans only: `"false"` (a string) would be truthy in Python.
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false (a YAML boolean), got {value!r}")
        return value

    def string(self, value: Any, where: str) -> str:
        # `driverVersion: 550.54` is a float to YAML: quote it.
        if not isinstance(value, str):
            raise self.fail(where, f"must be a string (quote it), got {value!r}")
        return value

    def hex_id(self, value: Any, where: str, digits: int) -> str:
        text = self.string(value, where)
        if len(text) != digits or any(c not in "0123456789abcdefABCDEF" for c in text):
            raise self.fail(where, f"must be {digits} hexadecimal digits, got {value!r}")
        return text.lower()

    def integer(self, value: Any, where: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(where, f"must be an integer in [{low}, {high}], got {value!r}")
        return value

    def model(self, value: Any, where: str, table: dict) -> str:
        if not isinstance(value, str) or value not in table:
            raise self.fail(where, f"unknown model {value!r}; known: {', '.join(sorted(table))}")
        return value

    def profile(self, data: Any) -> Profile:
        data = self.mapping(data, "top level", {"description", "nvidia", "managementNic", "roots"})
        nvidia = data.get("nvidia")
        driver_version, cuda = None, 0
        if nvidia is not None:
            nvidia = self.mapping(nvidia, "nvidia", {"driverVersion", "cudaDriverVersion"})
            driver_version = self.string(nvidia.get("driverVersion", "550.54.15"), "nvidia.driverVersion")
            cuda = self.integer(nvidia.get("cudaDriverVersion", 12040), "nvidia.cudaDriverVersion", 1000, 99999)
        mgmt = None
        if data.get("managementNic") is not None:
            mgmt = self.nic(data["managementNic"], "managementNic")
        roots_data = data.get("roots") or []
        if not isinstance(roots_data, list):
            raise self.fail("roots", "must be a list")
        roots: list[RootSpec] = []
        for i, root in enumerate(roots_data):
            where = f"roots[{i}]"
            root = self.mapping(root, where, {"numa", "repeat", "devices"})
            numa = root.get("numa")
            if numa is not None:
                numa = self.integer(numa, f"{where}.numa", 0, 63)
            repeat = self.integer(root.get("repeat", 1), f"{where}.repeat", 1, 64)
            cards = root.get("devices") or []
            if not isinstance(cards, list) or not cards:
                raise self.fail(f"{where}.devices", "must be a non-empty list")
            if len(cards) > MAX_DEVICES_PER_ROOT:
                raise self.fail(f"{where}.devices", f"at most {MAX_DEVICES_PER_ROOT} cards per root")
            specs = tuple(self.card(c, f"{where}.devices[{j}]") for j, c in enumerate(cards))
            roots.extend(RootSpec(numa, specs) for _ in range(repeat))
        if len(roots) > 15 * 255:
            raise self.fail("roots", "too many PCIe roots")
        if any(isinstance(c, GpuSpec) for r in roots for c in r.devices) and driver_version is None:
            raise self.fail("nvidia", "GPUs need an `nvidia` section (driver versions)")
        self.unique_interface_names(mgmt, roots_data, roots)
        name = Path(self.source).name.removesuffix(".yaml")
        description = self.string(data.get("description", ""), "description")
        return Profile(name, description, driver_version, cuda, mgmt, tuple(roots))

    def unique_interface_names(self, mgmt: "NicSpec | None", roots_data: list, roots: list) -> None:
        """Two NICs with one ifName would be one /sys/class/net entry on a real node."""
        seen: dict[str, str] = {}
        if mgmt is not None and mgmt.ifname:
            seen[mgmt.ifname] = "managementNic.ifName"
        index = 0
        for i, root in enumerate(roots_data):
            for _ in range(root.get("repeat", 1)):
                for j, card in enumerate(roots[index].devices):
                    if isinstance(card, NicSpec) and card.ifname:
                        where = f"roots[{i}].devices[{j}].ifName"
                        if card.ifname in seen:
                            again = " (the root repeats)" if seen[card.ifname] == where else ""
                            raise self.fail(where, f"interface name {card.ifname!r} is already used by "
                                                   f"{seen[card.ifname]}{again}")
                        seen[card.ifname] = where
                index += 1

    def card(self, data: Any, where: str) -> CardSpec:
        if not isinstance(data, dict) or "type" not in data:
            raise self.fail(where, "must be a mapping with a `type` (gpu, nic, alveo, dfl)")
        kind = data["type"]
        if not isinstance(kind, str):
            raise self.fail(f"{where}.type", f"must be gpu, nic, alveo or dfl, got {kind!r}")
        rest = {k: v for k, v in data.items() if k != "type"}
        if kind == "gpu":
            rest = self.mapping(rest, where, {"model", "mig", "lost"})
            model = self.model(rest.get("model"), f"{where}.model", catalog.GPUS)
            mig = rest.get("mig") or []
            if not isinstance(mig, list):
                raise self.fail(f"{where}.mig", "must be a list of MIG profile names")
            for profile in mig:
                if profile not in catalog.GPUS[model].mig:
                    raise self.fail(f"{where}.mig", f"{model} has no MIG profile {profile!r}")
            slices = sum(catalog.GPUS[model].mig[p].slices for p in mig)
            if slices > 7:
                raise self.fail(f"{where}.mig", f"MIG profiles use {slices} of 7 slices")
            return GpuSpec(model, tuple(mig), self.boolean(rest.get("lost", False), f"{where}.lost"))
        if kind == "nic":
            return self.nic(rest, where)
        if kind == "alveo":
            rest = self.mapping(rest, where, {"model"})
            return AlveoSpec(self.model(rest.get("model"), f"{where}.model", catalog.ALVEO))
        if kind == "dfl":
            rest = self.mapping(rest, where, {"model", "ports", "afuId"})
            model = self.model(rest.get("model"), f"{where}.model", catalog.DFL)
            ports = self.integer(rest.get("ports", 1), f"{where}.ports", 1, 4)
            afu = self.hex_id(rest.get("afuId", DflSpec.afu_id), f"{where}.afuId", 32)
            return DflSpec(model, ports, afu)
        raise self.fail(f"{where}.type", f"unknown card type {kind!r} (gpu, nic, alveo, dfl)")

    def nic(self, data: Any, where: str) -> NicSpec:
        data = self.mapping(data, where, {"model", "vfs", "rdma", "link", "mtu", "ifName", "type"})
        model = self.model(data.get("model"), f"{where}.model", catalog.NICS)
        spec = catalog.NICS[model]
        vfs = self.integer(data.get("vfs", 0), f"{where}.vfs", 0, max(spec.total_vfs, 0))
        rdma = self.boolean(data.get("rdma", False), f"{where}.rdma")
        if rdma and spec.rdma_prefix is None:
            raise self.fail(f"{where}.rdma", f"{model} has no RDMA")
        link = data.get("link", "up")
        if link not in ("up", "down"):
            raise self.fail(f"{where}.link", "must be up or down")
        mtu = self.integer(data.get("mtu", 1500), f"{where}.mtu", 68, 65535)
        ifname = data.get("ifName")
        if ifname is not None and (not isinstance(ifname, str) or not 0 < len(ifname) < 16
                                   or "/" in ifname or ifname.strip() != ifname):
            raise self.fail(f"{where}.ifName", "must be an interface name of 1-15 characters")
        return NicSpec(model, vfs, rdma, link, mtu, ifname)
