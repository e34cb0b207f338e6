"""Opaque device configuration that claims and DeviceClasses pass to this driver.

```yaml
config:
- requests: [gpu]
  opaque:
    driver: accel.dra.io
    parameters:
      apiVersion: accel.dra.io/v1alpha1
      kind: GpuConfig
      env: {NCCL_DEBUG: INFO}
      sharing:                      # optional; field names as in NVIDIA's GpuConfig
        strategy: MPS               # or TimeSlicing (whole GPUs only)
        mpsConfig:
          defaultActiveThreadPercentage: 50
          defaultPinnedDeviceMemoryLimit: 20Gi
          multiUser: false          # true: pods of different UIDs share one MPS server
```

Decoding is strict: an unknown kind, an unknown field or a wrongly typed value is an
error that names the claim and the field, never silently ignored.
"""

from __future__ import annotations

import ipaddress
import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from driver.kube import quantity
from driver.devices.model import DeviceKind

API_VERSION = "accel.dra.io/v1alpha1"
MAX_PARAMETERS_BYTES = 10 * 1024  # the API server's limit for opaque parameters
MAX_ENV = 64
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


class ConfigDecodeError(ValueError):
    pass


TIME_SLICING, MPS = "TimeSlicing", "MPS"
STRATEGIES = (TIME_SLICING, MPS)
# nvidia-smi compute-policy --set-timeslice takes these numbers (NVIDIA's driver maps the
# names the same way); the milliseconds behind them are the GPU driver's business.
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
MIN_PINNED_MEMORY = 1 << 20  # MPS takes limits in whole MiB


@dataclass(frozen=True)
class TimeSlicingConfig:
    interval: str = "Default"


@dataclass(frozen=True)
class MpsConfig:
    # Server-wide defaults of the GPU's MPS control daemon (set_default_* commands);
    # None leaves the MPS default (100 %, no pinned-memory limit).
    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | None = None  # a quantity, canonical form
    # `nvidia-cuda-mps-control -M` (NVIDIA's GpuConfig calls it multiUser too): one MPS
    # server, run as root, serves the clients of every UID, so pods running as different
    # users can share the GPU. Volta or newer; the users are not isolated from each other.
    multiUser: bool = False


@dataclass(frozen=True)
class Sharing:
    strategy: str
    timeSlicingConfig: TimeSlicingConfig | None = None
    mpsConfig: MpsConfig | None = None


@dataclass(frozen=True)
class GpuConfig:
    env: Mapping[str, str] = field(default_factory=dict)
    sharing: Sharing | None = None


@dataclass(frozen=True)
class FpgaConfig:
    env: Mapping[str, str] = field(default_factory=dict)
    # Also hand out the management node (/dev/xclmgmtN, /dev/dfl-fme.N): it can reflash
    # the card, so it is off unless asked for.
    managementAccess: bool = False
    # The accelerator function to load at prepare (docs/fpga.md): the UUID the device shows
    # once it is loaded (Alveo logicUUID = the xclbin's UUID, DFL afuID = the GBS's
    # accelerator-type-uuid), canonical form; the node's bitstream store holds the file.
    function: str | None = None
    digest: str | None = None  # "sha256:<64 hex>" of the store's file; only with function


@dataclass(frozen=True)
class NicRoute:
    destination: str  # a network in CIDR form (host bits zero), or "default"
    gateway: str | None = None  # an IP of the destination's family; None: on-link


@dataclass(frozen=True)
class NicConfig:
    env: Mapping[str, str] = field(default_factory=dict)
    # Move the interface into the pod's network namespace: by the driver's NRI plugin
    # (--nri-socket, driver/nri/), or else by the runtime from CDI netDevices (needs
    # containerd >= 2.2.1 or CRI-O >= 1.35 and runc >= 1.4).
    moveInterface: bool = False
    interfaceName: str | None = None  # name inside the pod; default: the host name
    rdma: bool = True
    # Inside the pod (moveInterface only; set by the NRI plugin, CDI netDevices carry
    # none of them): addresses in CIDR form, the MTU, routes through the interface.
    addresses: tuple[str, ...] = ()
    mtu: int | None = None
    routes: tuple[NicRoute, ...] = ()


MAX_ADDRESSES = MAX_ROUTES = 16
MIN_MTU, MAX_MTU = 68, 65535  # IPv4's minimum; the largest netlink takes


DeviceConfig = GpuConfig | FpgaConfig | NicConfig

_BOOL_FIELDS = {"managementAccess", "moveInterface", "rdma"}
KINDS: dict[str, type] = {"GpuConfig": GpuConfig, "FpgaConfig": FpgaConfig, "NicConfig": NicConfig}
APPLIES_TO: dict[type, tuple[DeviceKind, ...]] = {
    GpuConfig: (DeviceKind.GPU, DeviceKind.MIG),
    FpgaConfig: (DeviceKind.FPGA,),
    NicConfig: (DeviceKind.NIC,),
}


def default_for(kind: DeviceKind) -> DeviceConfig:
    for config_type, kinds in APPLIES_TO.items():
        if kind in kinds:
            return config_type()
    raise AssertionError(kind)


def to_dict(config: DeviceConfig) -> dict:
    """For the checkpoint: enough to rebuild the same edits after a reboot."""
    return {"kind": type(config).__name__, **{k: (dict(v) if isinstance(v, Mapping) else v)
                                              for k, v in asdict(config).items()}}


def from_dict(data: Mapping[str, Any]) -> DeviceConfig:
    data = dict(data)
    kind = data.pop("kind")
    return decode({"apiVersion": API_VERSION, "kind": kind, **data})


def decode(parameters: Any) -> DeviceConfig:
    """Parameters of one opaque config -> a config object, or ConfigDecodeError."""
    if not isinstance(parameters, dict):
        raise ConfigDecodeError("parameters must be a JSON object")
    size = len(json.dumps(parameters, separators=(",", ":")).encode())
    if size > MAX_PARAMETERS_BYTES:
        raise ConfigDecodeError(f"parameters are {size} bytes, the limit is {MAX_PARAMETERS_BYTES}")
    api_version = parameters.get("apiVersion")
    if api_version != API_VERSION:
        raise ConfigDecodeError(f"apiVersion must be {API_VERSION!r}, got {api_version!r}")
    kind = parameters.get("kind")
    if kind not in KINDS:
        raise ConfigDecodeError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    config_type = KINDS[kind]
    fields = {k: v for k, v in parameters.items() if k not in ("apiVersion", "kind")}
    allowed = set(config_type.__dataclass_fields__)
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ConfigDecodeError(f"{kind}: unknown field(s) {', '.join(unknown)}")
    if "env" in fields:
        fields["env"] = _env(kind, fields["env"])
    if "sharing" in fields:
        fields["sharing"] = _sharing(f"{kind}.sharing", fields["sharing"])
    if config_type is NicConfig:
        fields.update(_nic_network(fields))
    if config_type is FpgaConfig:
        fields.update(_fpga_function(fields))
    for name, value in fields.items():
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            raise ConfigDecodeError(f"{kind}.{name} must be true or false, got {value!r}")
        if name == "interfaceName" and value is not None and (
            not isinstance(value, str) or not _IFNAME.match(value)
        ):
            raise ConfigDecodeError(f"{kind}.interfaceName {value!r} is not an interface name")
    return config_type(**fields)


def _nic_network(fields: dict) -> dict:
    """addresses, mtu and routes of a NicConfig, checked; null means absent."""
    out: dict = {}
    addresses = fields.get("addresses")
    if addresses is not None:
        if not isinstance(addresses, (list, tuple)) or len(addresses) > MAX_ADDRESSES:
            raise ConfigDecodeError(f"NicConfig.addresses must be a list of at most "
                                    f"{MAX_ADDRESSES} addresses in CIDR form")
        for i, address in enumerate(addresses):
            if not isinstance(address, str) or not _is_cidr(address):
                raise ConfigDecodeError(f"NicConfig.addresses[{i}] {address!r} is not an address "
                                        "in CIDR form (for example 10.1.0.5/24)")
        out["addresses"] = tuple(addresses)
    else:
        out["addresses"] = ()
    mtu = fields.get("mtu")
    if mtu is not None and (isinstance(mtu, bool) or not isinstance(mtu, int)
                            or not MIN_MTU <= mtu <= MAX_MTU):
        raise ConfigDecodeError(f"NicConfig.mtu must be an integer from {MIN_MTU} to "
                                f"{MAX_MTU}, got {mtu!r}")
    out["mtu"] = mtu
    routes = fields.get("routes")
    out["routes"] = ()
    if routes is not None:
        if not isinstance(routes, (list, tuple)) or len(routes) > MAX_ROUTES:
            raise ConfigDecodeError(f"NicConfig.routes must be a list of at most {MAX_ROUTES} "
                                    "routes")
        out["routes"] = tuple(_route(f"NicConfig.routes[{i}]", r) for i, r in enumerate(routes))
    wanted = [name for name in ("addresses", "mtu", "routes")
              if fields.get(name) is not None and fields.get(name) != [] and fields.get(name) != ()]
    if wanted and fields.get("moveInterface") is not True:
        raise ConfigDecodeError(f"NicConfig.{wanted[0]} needs moveInterface: true (an interface "
                                "left in the host's namespace is not reconfigured)")
    return out


_UUID = re.compile(r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def _fpga_function(fields: dict) -> dict:
    """function as a canonical UUID (sysfs prints it with or without dashes), digest only
    beside it; null means absent."""
    function, digest = fields.get("function"), fields.get("digest")
    if function is not None:
        if not isinstance(function, str) or not _UUID.match(function):
            raise ConfigDecodeError(f"FpgaConfig.function {function!r} is not a UUID (the "
                                    "xclbin's UUID or the GBS's accelerator-type-uuid)")
        function = str(uuid.UUID(function))
    if digest is not None:
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise ConfigDecodeError(f"FpgaConfig.digest {digest!r} must be sha256: and 64 "
                                    "lower-case hex digits")
        if function is None:
            raise ConfigDecodeError("FpgaConfig.digest needs function: it checks the file "
                                    "that loads the function")
    return {"function": function, "digest": digest}


def _is_cidr(text: str) -> bool:
    if "/" not in text:
        return False
    try:
        ipaddress.ip_interface(text)
    except ValueError:
        return False
    return True


def _route(where: str, value: Any) -> NicRoute:
    if isinstance(value, NicRoute):
        value = {"destination": value.destination, "gateway": value.gateway}
    fields = _fields(where, value, NicRoute)
    destination = fields.get("destination")
    network = None
    if destination != "default":
        try:
            network = ipaddress.ip_network(destination) if isinstance(destination, str) \
                and "/" in destination else None
        except ValueError:
            network = None
        if network is None:
            raise ConfigDecodeError(f"{where}.destination {destination!r} must be \"default\" or "
                                    "a network in CIDR form with no host bits (10.2.0.0/16)")
    gateway = fields.get("gateway")
    if gateway is not None:
        try:
            ip = ipaddress.ip_address(gateway) if isinstance(gateway, str) else None
        except ValueError:
            ip = None
        if ip is None:
            raise ConfigDecodeError(f"{where}.gateway {gateway!r} is not an IP address")
        if network is not None and ip.version != network.version:
            raise ConfigDecodeError(f"{where}: gateway {gateway} is not of the destination's "
                                    f"IP version ({destination})")
    elif destination == "default":
        raise ConfigDecodeError(f"{where}: a default route needs a gateway")
    return NicRoute(destination, gateway)


def _env(kind: str, env: Any) -> dict[str, str]:
    if not isinstance(env, dict):
        raise ConfigDecodeError(f"{kind}.env must be a map of strings")
    if len(env) > MAX_ENV:
        raise ConfigDecodeError(f"{kind}.env has {len(env)} entries, at most {MAX_ENV}")
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ConfigDecodeError(f"{kind}.env: {key!r} is not an environment variable name")
        if not isinstance(value, str):
            raise ConfigDecodeError(f"{kind}.env.{key} must be a string")
        if key.startswith("DRA_"):
            raise ConfigDecodeError(f"{kind}.env.{key}: DRA_* variables are set by the driver")
        # A claim's env is applied after the driver's: NVIDIA_VISIBLE_DEVICES=all would
        # undo the `void` that keeps NVIDIA's container runtime from adding every GPU of
        # the node, and CUDA_MPS_* would replace a share's limits and its pipe directory.
        if key == "NVIDIA_VISIBLE_DEVICES" or key.startswith("CUDA_MPS_"):
            raise ConfigDecodeError(f"{kind}.env.{key}: set by the driver (NVIDIA_VISIBLE_DEVICES keeps "
                                    "NVIDIA's runtime to the claim's GPUs; CUDA_MPS_* carry an MPS "
                                    "share's limits)")
    return dict(env)


def _fields(where: str, value: Any, known: type) -> dict:
    """A nested object: a map with only the dataclass's fields; null means absent."""
    if not isinstance(value, dict):
        raise ConfigDecodeError(f"{where} must be an object, got {value!r}")
    unknown = sorted(set(value) - set(known.__dataclass_fields__))
    if unknown:
        raise ConfigDecodeError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    return {k: v for k, v in value.items() if v is not None}


def _sharing(where: str, value: Any) -> Sharing | None:
    if value is None:
        return None
    fields = _fields(where, value, Sharing)
    strategy = fields.get("strategy")
    if strategy not in STRATEGIES:
        raise ConfigDecodeError(f"{where}.strategy must be one of {', '.join(STRATEGIES)}, "
                                f"got {strategy!r}")
    time_slicing = mps = None
    if "timeSlicingConfig" in fields:
        if strategy != TIME_SLICING:
            raise ConfigDecodeError(f"{where}.timeSlicingConfig is set but strategy is {strategy}")
        config = _fields(f"{where}.timeSlicingConfig", fields["timeSlicingConfig"], TimeSlicingConfig)
        interval = config.get("interval", "Default")
        if interval not in INTERVALS:
            raise ConfigDecodeError(f"{where}.timeSlicingConfig.interval must be one of "
                                    f"{', '.join(INTERVALS)}, got {interval!r}")
        time_slicing = TimeSlicingConfig(interval)
    if "mpsConfig" in fields:
        if strategy != MPS:
            raise ConfigDecodeError(f"{where}.mpsConfig is set but strategy is {strategy}")
        mps = _mps(f"{where}.mpsConfig", fields["mpsConfig"])
    return Sharing(strategy, time_slicing, mps)


def _mps(where: str, value: Any) -> MpsConfig:
    config = _fields(where, value, MpsConfig)
    percentage = config.get("defaultActiveThreadPercentage")
    if percentage is not None and (isinstance(percentage, bool) or not isinstance(percentage, int)
                                   or not 1 <= percentage <= 100):
        raise ConfigDecodeError(f"{where}.defaultActiveThreadPercentage must be an integer "
                                f"from 1 to 100, got {percentage!r}")
    limit = config.get("defaultPinnedDeviceMemoryLimit")
    if limit is not None:
        text = str(limit) if isinstance(limit, (str, int)) and not isinstance(limit, bool) else None
        try:
            size = quantity.value(text) if text is not None else None
        except quantity.QuantityError:
            size = None
        if size is None:
            raise ConfigDecodeError(f"{where}.defaultPinnedDeviceMemoryLimit {limit!r} is not a "
                                    "quantity (for example 20Gi)")
        if size < MIN_PINNED_MEMORY:
            raise ConfigDecodeError(f"{where}.defaultPinnedDeviceMemoryLimit {limit!r} is below "
                                    "1Mi, the smallest limit MPS takes")
        limit = quantity.canonical(text)
    multi_user = config.get("multiUser", False)
    if not isinstance(multi_user, bool):
        raise ConfigDecodeError(f"{where}.multiUser must be true or false, got {multi_user!r}")
    return MpsConfig(percentage, limit, multi_user)
