"""The driver's configuration: flags > environment > defaults, validated once, frozen.

Every option has a flag and an environment variable (the Helm chart sets the latter). An
invalid value stops start-up with one message naming the option, and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from driver.kube import names, quantity
from driver.devices.mock import Profile, ProfileError, builtin_profiles
from driver.devices.mock import load as load_profile
from driver.devices.net import NicFilter, NicSelector
from driver.kubelet import sockets
from driver.publish.slices import GPU_SHARING_MODES

DEFAULT_DRIVER = "accel.dra.io"


class ConfigError(ValueError):
    """Bad configuration: the message names the flag / variable and what is wrong."""


RUN, DISCOVER, CLEANUP, STATUS = "run", "discover", "cleanup", "status"
ALL = frozenset({RUN, DISCOVER, CLEANUP, STATUS})
NODE = frozenset({RUN, DISCOVER, STATUS})  # what reads the node's devices
STATE = frozenset({RUN, STATUS})  # what reads the state directory


@dataclass(frozen=True)
class Option:
    dest: str
    flag: str
    env: str
    default: Any
    help: str
    commands: frozenset[str] = frozenset({RUN})  # the subcommands that take it


OPTIONS: tuple[Option, ...] = (
    Option("node_name", "--node-name", "NODE_NAME", None,
           "Kubernetes node name; pool and slices are named after it (default: hostname)",
           commands=ALL),
    Option("driver_name", "--driver-name", "DRIVER_NAME", DEFAULT_DRIVER,
           "DRA driver name (DNS subdomain); DeviceClasses select on it", commands=ALL),
    Option("kubelet_registrar_dir", "--kubelet-registrar-dir", "KUBELET_REGISTRAR_DIR",
           "/var/lib/kubelet/plugins_registry", "directory the kubelet watches for plugins"),
    Option("kubelet_plugins_dir", "--kubelet-plugins-dir", "KUBELET_PLUGINS_DIR",
           "/var/lib/kubelet/plugins", "directory for the DRA service socket", commands=STATE),
    Option("cdi_root", "--cdi-root", "CDI_ROOT", "/var/run/cdi", "where CDI specs are written"),
    Option("state_dir", "--state-dir", "STATE_DIR", None,
           "checkpoint and lock directory (default: <kubelet-plugins-dir>/<driver-name>)",
           commands=STATE),
    Option("sysfs_root", "--sysfs-root", "SYSFS_ROOT", None, "what stands for /sys (default /sys)",
           commands=NODE),
    Option("dev_root", "--dev-root", "DEV_ROOT", None, "what stands for /dev (default /dev)"),
    Option("proc_root", "--proc-root", "PROC_ROOT", None, "what stands for /proc (default /proc)",
           commands=NODE),
    # discover and status load NVML from the installation too (driver/devices/nvml.py).
    Option("nvidia_driver_root", "--nvidia-driver-root", "NVIDIA_DRIVER_ROOT", None,
           "host path of the NVIDIA driver installation whose libraries GPU containers get "
           "and whose libnvidia-ml.so.1 the driver loads (default /; /run/nvidia/driver with "
           "the GPU operator)", commands=NODE),
    Option("nvidia_driver_root_mount", "--nvidia-driver-root-mount", "NVIDIA_DRIVER_ROOT_MOUNT", None,
           "where this process sees --nvidia-driver-root (default: the same path)",
           commands=NODE),
    Option("nvidia_driver_wait", "--nvidia-driver-wait", "NVIDIA_DRIVER_WAIT", "300",
           "seconds to wait at start, not ready, for libnvidia-ml.so.1 under the driver root "
           "where NVIDIA GPUs are on the PCI bus (the GPU operator installs it later); then "
           "start without GPUs, which rediscovery publishes once it appears; 0: no wait"),
    Option("mock", "--mock", "MOCK_PROFILE", None,
           f"mock devices: a built-in profile ({', '.join(builtin_profiles())}) or a profile YAML file",
           commands=NODE),
    Option("kubeconfig", "--kubeconfig", "KUBECONFIG", None,
           "kubeconfig file (default: in-cluster service account)",
           commands=frozenset({RUN, CLEANUP})),
    Option("metrics_port", "--metrics-port", "METRICS_PORT", "9400",
           "Prometheus metrics port, 0 disables"),
    Option("healthz_port", "--healthz-port", "HEALTHZ_PORT", "9401",
           "liveness/readiness HTTP port, 0 disables"),
    Option("log_format", "--log-format", "LOG_FORMAT", "auto",
           "json, console, or auto (console on a terminal, JSON otherwise)", commands=ALL),
    Option("log_level", "--log-level", "LOG_LEVEL", "info", "debug, info, warning or error",
           commands=ALL),
    Option("nic_include", "--nic-include", "NIC_INCLUDE", "",
           "comma-separated NIC selectors to publish (NAME-GLOB, vendor=0xVVVV, pci=GLOB); "
           "empty: all physical NICs", commands=NODE),
    Option("nic_exclude", "--nic-exclude", "NIC_EXCLUDE", "",
           "comma-separated NIC selectors never to publish", commands=NODE),
    Option("nic_allow_default_route", "--nic-allow-default-route", "NIC_ALLOW_DEFAULT_ROUTE",
           "false", "also publish the NIC that carries the default route (true/false)",
           commands=NODE),
    Option("rediscover_interval", "--rediscover-interval", "REDISCOVER_INTERVAL", "60",
           "seconds between periodic rediscoveries: a sysfs fingerprint, then what differs "
           "(uevents trigger one sooner)"),
    Option("health_interval", "--health-interval", "HEALTH_INTERVAL", "5",
           "seconds between device health probes (link state, GPU lost, device gone)"),
    Option("ignored_xids", "--ignored-xids", "IGNORED_XIDS", "13,31,43,45,68,109",
           "comma-separated NVML XIDs that do not make a GPU unhealthy (application errors)"),
    Option("extended_resource_names", "--extended-resource-names", "EXTENDED_RESOURCE_NAMES", "",
           "comma-separated extended resource names this driver's DeviceClasses serve "
           "(spec.extendedResourceName, e.g. nvidia.com/gpu; the chart sets them): at start "
           "the driver says if the node also advertises one (a device plugin still running)"),
    Option("xid_recovery_seconds", "--xid-recovery-seconds", "XID_RECOVERY_SECONDS", "0",
           "clear an XID condition this long after it began if the GPU answers; 0: keep it "
           "until the driver restarts"),
    Option("registration_timeout", "--registration-timeout", "REGISTRATION_TIMEOUT", "30",
           "seconds to wait for the kubelet to confirm a registration before offering a new "
           "registration socket (the kubelet never retries one by itself)"),
    Option("gpu_sharing", "--gpu-sharing", "GPU_SHARING", "exclusive",
           "how whole GPUs are published: exclusive (one claim each) or consumable (several "
           "claims, each taking part of the memory and compute; Kubernetes >= 1.34 with the "
           "DRAConsumableCapacity gate, on by default from 1.36)", commands=NODE),
    Option("mig_mode", "--mig-mode", "MIG_MODE", "static",
           "static: MIG devices as they exist; dynamic: every partition MIG-capable GPUs could "
           "hold, as partitionable devices with shared counters, created at prepare "
           "(Kubernetes 1.34+, gate DRAPartitionableDevices, on by default from 1.36)",
           commands=NODE),
    Option("mig_profiles", "--mig-profiles", "MIG_PROFILES", "",
           "with --mig-mode dynamic: the MIG profiles to offer, comma-separated (e.g. "
           "1g.10gb,3g.40gb,7g.80gb); empty: every profile of each GPU. Fewer placements "
           "make every node cheaper for the scheduler (docs/dynamic-mig.md)", commands=NODE),
    Option("namespace", "--namespace", "POD_NAMESPACE", "default",
           "the namespace this driver runs in; MPS control daemon pods are created there"),
    Option("mps_image", "--mps-image", "MPS_IMAGE", "",
           "container image of the MPS control daemon pods (the chart sets the driver's own "
           "image); empty: claims that need MPS fail with a message saying so"),
    Option("mps_start_timeout", "--mps-start-timeout", "MPS_START_TIMEOUT", "30",
           "seconds a prepare waits, holding no lock, for a new MPS control daemon to answer "
           "(at most 35: the kubelet gives up on a prepare after 45 s); then the claim fails "
           "with the daemon pod's state and the kubelet's retry finds the daemon"),
    Option("mps_shm_size", "--mps-shm-size", "MPS_SHM_SIZE", "",
           "size of the tmpfs each MPS-shared GPU's daemon and clients share as /dev/shm, a "
           "quantity of at least 1Mi (e.g. 8Gi); empty: half of the node's memory, as NVIDIA's "
           "driver sizes it"),
    Option("fpga_bitstreams", "--fpga-bitstreams", "FPGA_BITSTREAMS", None,
           "the node's bitstream store: .xclbin and .gbs files that FpgaConfig.function names "
           "by UUID (docs/fpga.md; default: none, a mock node's own store with --mock)"),
    Option("fpga_program_timeout", "--fpga-program-timeout", "FPGA_PROGRAM_TIMEOUT", "35",
           "seconds xbutil or fpgaconf may take to load a claim's bitstream before it is stopped "
           "and the claim fails (at most 40: the kubelet waits 45 s for a prepare)"),
    Option("sharing_reconcile_interval", "--sharing-reconcile-interval",
           "SHARING_RECONCILE_INTERVAL", "30",
           "seconds between checks that shared GPUs are set up as their claims need (a dead "
           "MPS daemon is restarted, an orphan one stopped)"),
    Option("claim_status", "--claim-status", "CLAIM_STATUS", "true",
           "write each prepared claim's devices to its status.devices (true/false; needs patch "
           "on resourceclaims/status, and from 1.36 associated-node:patch on resourceclaims/driver)"),
    Option("claim_workers", "--claim-workers", "CLAIM_WORKERS", "32",
           "claims prepared at once, in one request and across concurrent ones: as many claim "
           "GETs in flight (on the event loop) and as many threads for their file writes"),
    Option("utilization_interval", "--utilization-interval", "UTILIZATION_INTERVAL", "10",
           "seconds between utilization samples of the GPUs and MIG devices (metrics, idle "
           "detection; NIC counters are read at each metrics scrape); 0 turns sampling and "
           "utilization metrics off"),
    Option("idle_after", "--idle-after", "IDLE_AFTER", "1800",
           "seconds an allocated GPU or MIG device must stay idle before its claim gets an "
           "Event and an Idle condition; 0: never"),
    Option("idle_threshold", "--idle-threshold", "IDLE_THRESHOLD", "5",
           "the share of time a kernel ran (NVML's GPU utilization, not SM occupancy), in "
           "percent, below which a GPU counts as idle (every NVML sample since the previous "
           "one must be below it)", commands=STATE),
    Option("nri_socket", "--nri-socket", "NRI_SOCKET", "",
           "the container runtime's NRI socket (containerd 2.x: /var/run/nri/nri.sock): the "
           "driver moves NICs whose NicConfig sets moveInterface into their pods' network "
           "namespaces itself, as an NRI plugin; empty: the runtime moves them from the CDI "
           "spec's netDevices (containerd >= 2.2.1, CRI-O >= 1.35, runc >= 1.4)"),
    Option("pod_uid", "--pod-uid", "POD_UID", None,
           "this pod's UID: enables seamless upgrades (unique socket names, kubelet >= 1.33)"),
)


@dataclass(frozen=True)
class Config:
    node_name: str
    driver_name: str
    kubelet_registrar_dir: Path
    kubelet_plugins_dir: Path
    cdi_root: Path
    state_dir: Path
    sysfs_root: Path
    dev_root: Path
    proc_root: Path
    mock: Profile | None
    kubeconfig: Path | None
    metrics_port: int
    healthz_port: int
    log_format: str
    log_level: str
    nic_filter: NicFilter = field(default_factory=NicFilter)
    pod_uid: str | None = None
    nvidia_driver_root: Path = Path("/")
    nvidia_driver_root_mount: Path = Path("/")
    rediscover_interval: float = 60.0
    health_interval: float = 5.0
    ignored_xids: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
    extended_resource_names: tuple[str, ...] = ()
    xid_recovery_seconds: float = 0.0
    registration_timeout: float = 30.0
    gpu_sharing: str = "exclusive"
    mig_mode: str = "static"
    mig_profiles: frozenset[str] = frozenset()  # dynamic MIG: the profiles offered; empty: all
    namespace: str = "default"
    mps_image: str = ""
    mps_start_timeout: float = 30.0
    fpga_bitstreams: Path | None = None  # None: no store (a mock node's own with --mock)
    fpga_program_timeout: float = 35.0
    nvidia_driver_wait: float = 300.0  # 0: start at once
    mps_shm_size: int | None = None  # bytes; None: half of the node's memory
    sharing_reconcile_interval: float = 30.0
    claim_status: bool = True
    claim_workers: int = 32
    utilization_interval: float = 10.0  # 0: off
    idle_after: float = 1800.0  # 0: off
    idle_threshold: float = 0.05  # a ratio
    nri_socket: Path | None = None  # None: NRI off, CDI netDevices move NICs

    @property
    def api_connections(self) -> int:
        """Keep-alive API connections: one per claim worker, and some for the publisher's
        watch, the status writer and MPS daemon pods."""
        return self.claim_workers + 4

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_plugins_dir / self.driver_name

    @property
    def dra_socket(self) -> Path:
        candidates = sockets.dra_candidates(self.plugin_dir, self.pod_uid)
        return sockets.first_fitting(candidates) or candidates[0]

    @property
    def registration_socket(self) -> Path:
        candidates = sockets.registration_candidates(self.kubelet_registrar_dir, self.driver_name,
                                                     self.pod_uid)
        return sockets.first_fitting(candidates) or candidates[0]


def add_arguments(parser: argparse.ArgumentParser, command: str = RUN) -> None:
    """The flags `command` takes (each subcommand accepts only the options it uses)."""
    for option in OPTIONS:
        if command in option.commands:
            shown = "" if option.default is None or "default" in option.help else \
                f" (default: {option.default or 'empty'})"
            parser.add_argument(option.flag, dest=option.dest, default=None, metavar=option.env,
                                help=f"{option.help}{shown}; env {option.env}")


def _raw(args: argparse.Namespace, env: Mapping[str, str], option: Option,
         command: str) -> tuple[Any, str]:
    """The value and where it came from, for error messages. Options the command does not
    use keep their defaults: `discover` must not fail on a bad $CDI_ROOT it never reads."""
    if command not in option.commands:
        return option.default, f"{option.flag} default"
    value = getattr(args, option.dest, None)
    if value is not None:
        return value, option.flag
    if env.get(option.env, "") != "":
        return env[option.env], f"${option.env}"
    return option.default, f"{option.flag} default"


def _absolute(value: str, source: str) -> Path:
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError(f"{source}: {value!r} must be an absolute path")
    return path


def _kubeconfig(value: str | None, source: str, cwd: Path) -> Path | None:
    """As kubectl reads it: a relative path is relative to the working directory; the
    variable may list several files (`a:b`), of which the first that exists is used."""
    if not value:
        return None
    candidates = [cwd / p for p in str(value).split(os.pathsep) if p] if source.startswith("$") \
        else [cwd / str(value)]
    for path in candidates:
        if path.is_dir():
            raise ConfigError(f"{source}: {path} is a directory, not a kubeconfig file")
        if path.exists():
            return path
    if len(candidates) == 1:
        raise ConfigError(f"{source}: kubeconfig file not found: {candidates[0]}")
    raise ConfigError(f"{source}: none of the kubeconfig files exists: "
                      f"{', '.join(str(p) for p in candidates)}")


def _port(value: str, source: str) -> int:
    try:
        port = int(value)
    except ValueError as err:
        raise ConfigError(f"{source}: {value!r} is not a port number") from err
    if not 0 <= port <= 65535:
        raise ConfigError(f"{source}: {port} is not a port number (0-65535)")
    return port


def _bounded(value: str, source: str, convert: type, low: int, high: int, unit: str):
    """A number of `unit` in low..high; the message names the option and the unit."""
    try:
        number = convert(value)
    except ValueError as err:
        raise ConfigError(f"{source}: {value!r} is not a number of {unit}") from err
    if not low <= number <= high:
        raise ConfigError(f"{source}: {number} is outside {low}..{high} {unit}")
    return number


def _workers(value: str, source: str) -> int:
    return _bounded(value, source, int, 1, 256, "threads")


def _seconds(value: str, source: str) -> float:
    return _bounded(value, source, float, 1, 86400, "seconds")


def _mps_start_seconds(value: str, source: str) -> float:
    # The kubelet cancels NodePrepareResources after 45 s; the GET, the record and the CDI
    # spec need time too.
    return _bounded(value, source, float, 1, 35, "seconds (the kubelet waits 45 s for a prepare)")


def _fpga_program_seconds(value: str, source: str) -> float:
    return _bounded(value, source, float, 1, 40, "seconds (the kubelet waits 45 s for a prepare)")


def _shm_size(value: str, source: str) -> int:
    """Bytes of the MPS shm tmpfs (a quantity, at least 1Mi: MPS needs room for its
    segments, and the kernel takes sizes in pages)."""
    try:
        size = quantity.value(value)
    except quantity.QuantityError as err:
        raise ConfigError(f"{source}: {value!r} is not a quantity (for example 8Gi)") from err
    if size < 1 << 20:
        raise ConfigError(f"{source}: {value!r} is below 1Mi")
    return int(size)


def _seconds_or_off(value: str, source: str) -> float:
    """0 (off), or seconds as _seconds takes them; the message says that 0 is taken too."""
    try:
        if float(value) == 0:
            return 0.0
    except ValueError:
        pass
    try:
        return _seconds(value, source)
    except ConfigError as err:
        raise ConfigError(f"{err} (or 0 for off)") from None


def _percent(value: str, source: str) -> float:
    return _bounded(value, source, float, 0, 100, "percent") / 100.0


def _xids(value: str, source: str) -> frozenset[int]:
    try:
        xids = frozenset(int(p) for p in str(value).split(",") if p.strip())
    except ValueError as err:
        raise ConfigError(f"{source}: {value!r} is not a comma-separated list of XID numbers") from err
    if any(x <= 0 for x in xids):
        raise ConfigError(f"{source}: XIDs are positive numbers")
    return xids


MIG_PROFILE = re.compile(r"[1-9][0-9]*g\.[1-9][0-9]*gb(\+[a-z]+)*")  # 3g.40gb, 1g.10gb+me


def _mig_profiles(value: str, source: str) -> frozenset[str]:
    found = frozenset(p.strip().lower() for p in str(value).split(",") if p.strip())
    for profile in sorted(found):
        if not MIG_PROFILE.fullmatch(profile):
            raise ConfigError(f"{source}: {profile!r} is not a MIG GPU instance profile "
                              "(such as 1g.10gb, 3g.40gb or 1g.10gb+me)")
    return found


def _extended_resource_names(value: str, source: str) -> tuple[str, ...]:
    found = tuple(sorted({p.strip() for p in str(value).split(",") if p.strip()}))
    for name in found:
        domain = name.split("/", 1)[0] if "/" in name else ""
        if not domain or not names.is_qualified_name(name) or domain == "kubernetes.io" \
                or domain.endswith(".kubernetes.io") and domain != "deviceclass.resource.kubernetes.io":
            raise ConfigError(f"{source}: {name!r} is not an extended resource name (a domain-"
                              "prefixed name outside kubernetes.io, e.g. nvidia.com/gpu)")
    return found


def _bool(value: str, source: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{source}: {value!r} is not true or false")


def _selectors(value: str, source: str) -> tuple[NicSelector, ...]:
    try:
        return tuple(NicSelector.parse(p) for p in value.split(",") if p.strip())
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from err


def build(args: argparse.Namespace, env: Mapping[str, str] | None = None,
          command: str = RUN, cwd: Path | None = None) -> Config:
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    source: dict[str, str] = {}
    for option in OPTIONS:
        raw[option.dest], source[option.dest] = _raw(args, env, option, command)

    def get(dest: str, convert: Callable[[Any, str], Any] = lambda v, s: v) -> Any:
        return convert(raw[dest], source[dest]) if raw[dest] is not None else None

    driver = raw["driver_name"]
    if not (names.is_dns_subdomain(driver) and len(driver) <= names.DNS_LABEL_MAX):
        raise ConfigError(
            f"{source['driver_name']}: driver name {driver!r} must be a lower-case DNS "
            "subdomain of at most 63 characters, e.g. accel.example.com"
        )
    if not names.is_cdi_vendor_or_class(driver):
        # Valid for Kubernetes, but the driver name is also the CDI vendor of every spec we
        # write, and CDI requires a vendor to start with a letter: every prepare would fail.
        raise ConfigError(
            f"{source['driver_name']}: driver name {driver!r} is also the CDI vendor name, "
            "which must start with a letter (e.g. accel.example.com, not 1accel.example.com)"
        )
    node = raw["node_name"] or socket.gethostname().lower()
    if not names.is_dns_subdomain(node):
        raise ConfigError(f"{source['node_name']}: node name {node!r} is not a DNS subdomain")

    mock = None
    if raw["mock"]:
        try:
            mock = load_profile(raw["mock"])
        except ProfileError as err:
            raise ConfigError(f"{source['mock']}: {err}") from err
        for dest in ("sysfs_root", "dev_root", "proc_root", "nvidia_driver_root",
                     "nvidia_driver_root_mount"):
            if raw[dest] is not None:
                raise ConfigError(
                    f"{source[dest]}: mock mode generates its own sysfs, dev, proc and driver trees; "
                    f"do not combine it with --mock"
                )

    plugins_dir = get("kubelet_plugins_dir", _absolute)
    state_dir = get("state_dir", _absolute) or plugins_dir / driver
    log_format = raw["log_format"]
    if log_format not in ("auto", "json", "console"):
        raise ConfigError(f"{source['log_format']}: {log_format!r} is not auto, json or console")
    log_level = str(raw["log_level"]).lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{source['log_level']}: {log_level!r} is not debug, info, warning or error")
    metrics_port, healthz_port = get("metrics_port", _port), get("healthz_port", _port)
    if metrics_port and metrics_port == healthz_port:
        raise ConfigError(f"{source['metrics_port']} and {source['healthz_port']}: both are "
                          f"{metrics_port}; metrics and probes need two ports")
    gpu_sharing = str(raw["gpu_sharing"]).strip().lower()
    if gpu_sharing not in GPU_SHARING_MODES:
        raise ConfigError(f"{source['gpu_sharing']}: {raw['gpu_sharing']!r} is not one of "
                          f"{', '.join(GPU_SHARING_MODES)}")
    mig_mode = str(raw["mig_mode"]).strip().lower()
    if mig_mode not in ("static", "dynamic"):
        raise ConfigError(f"{source['mig_mode']}: {raw['mig_mode']!r} is not static or dynamic")
    mig_profiles = get("mig_profiles", _mig_profiles) or frozenset()
    if mig_profiles and mig_mode != "dynamic":
        raise ConfigError(f"{source['mig_profiles']}: chooses the profiles of dynamic MIG; "
                          f"{source['mig_mode']} is {mig_mode} (static MIG publishes the instances that exist)")
    namespace = str(raw["namespace"])
    if not names.is_dns_label(namespace):
        raise ConfigError(f"{source['namespace']}: {namespace!r} is not a namespace name")
    mps_image = str(raw["mps_image"] or "").strip()
    if any(c.isspace() for c in mps_image):
        raise ConfigError(f"{source['mps_image']}: {mps_image!r} is not an image reference")
    pod_uid = raw["pod_uid"]
    if pod_uid is not None and not names.is_dns_label(pod_uid.lower()):
        raise ConfigError(f"{source['pod_uid']}: {pod_uid!r} is not a pod UID")

    config = Config(
        node_name=node,
        driver_name=driver,
        kubelet_registrar_dir=get("kubelet_registrar_dir", _absolute),
        kubelet_plugins_dir=plugins_dir,
        cdi_root=get("cdi_root", _absolute),
        state_dir=state_dir,
        sysfs_root=get("sysfs_root", _absolute) or Path("/sys"),
        dev_root=get("dev_root", _absolute) or Path("/dev"),
        proc_root=get("proc_root", _absolute) or Path("/proc"),
        mock=mock,
        kubeconfig=_kubeconfig(raw["kubeconfig"], source["kubeconfig"], cwd or Path.cwd()),
        metrics_port=metrics_port,
        healthz_port=healthz_port,
        log_format=log_format,
        log_level=log_level,
        nic_filter=NicFilter(
            include=get("nic_include", _selectors),
            exclude=get("nic_exclude", _selectors),
            exclude_default_route=not get("nic_allow_default_route", _bool),
        ),
        pod_uid=pod_uid.lower() if pod_uid else None,
        nvidia_driver_root=get("nvidia_driver_root", _absolute) or Path("/"),
        nvidia_driver_root_mount=(get("nvidia_driver_root_mount", _absolute)
                                  or get("nvidia_driver_root", _absolute) or Path("/")),
        rediscover_interval=get("rediscover_interval", _seconds),
        health_interval=get("health_interval", _seconds),
        ignored_xids=get("ignored_xids", _xids),
        extended_resource_names=get("extended_resource_names", _extended_resource_names),
        xid_recovery_seconds=0.0 if str(raw["xid_recovery_seconds"]) == "0"
        else get("xid_recovery_seconds", _seconds),
        registration_timeout=get("registration_timeout", _seconds),
        gpu_sharing=gpu_sharing,
        mig_mode=mig_mode,
        mig_profiles=mig_profiles,
        namespace=namespace,
        mps_image=mps_image,
        mps_start_timeout=get("mps_start_timeout", _mps_start_seconds),
        fpga_bitstreams=get("fpga_bitstreams", _absolute),
        fpga_program_timeout=get("fpga_program_timeout", _fpga_program_seconds),
        nvidia_driver_wait=get("nvidia_driver_wait", _seconds_or_off),
        mps_shm_size=get("mps_shm_size", _shm_size) if raw["mps_shm_size"] else None,
        sharing_reconcile_interval=get("sharing_reconcile_interval", _seconds),
        claim_status=get("claim_status", _bool),
        claim_workers=get("claim_workers", _workers),
        utilization_interval=get("utilization_interval", _seconds_or_off),
        idle_after=get("idle_after", _seconds_or_off),
        idle_threshold=get("idle_threshold", _percent),
        nri_socket=get("nri_socket", _absolute) if raw["nri_socket"] else None,
    )
    for label, source_name, candidates in (
        ("registration socket", source["kubelet_registrar_dir"],
         sockets.registration_candidates(config.kubelet_registrar_dir, driver, config.pod_uid)),
        ("DRA socket", source["kubelet_plugins_dir"],
         sockets.dra_candidates(config.plugin_dir, config.pod_uid)),
    ):
        if sockets.first_fitting(candidates) is None:
            raise ConfigError(
                f"{source_name}: the {label} path {candidates[-1]} (its shortest form) is "
                f"longer than {sockets.UNIX_PATH_MAX} bytes, the unix socket limit; use a "
                "shorter directory or driver name"
            )
    return config
