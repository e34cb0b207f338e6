"""dra-driver: a Kubernetes Dynamic Resource Allocation (DRA) driver for GPUs, FPGAs and
NICs. On each node it discovers the accelerators (NVML, sysfs), publishes them as
ResourceSlices and serves the kubelet's DRA gRPC API, turning allocated ResourceClaims
into CDI devices for containers.

Every option also reads an environment variable (flags win); `--mock PROFILE` runs on a
generated fake node. `dra-driver COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from driver import __version__, logs
from driver.service import preflight, report

from driver.publish import slices
from driver.service.config import CLEANUP, DISCOVER, RUN, STATUS, ConfigError, Config, add_arguments, build
from driver.devices.discovery import discover, log_result
from driver.service.node import open_node

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error of ours."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it has none (None) or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    from driver.devices.mock import builtin_profiles

    formatter = _Defaults
    top = _Parser(prog="dra-driver", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"dra-driver {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    profiles = ", ".join(builtin_profiles())
    run = commands.add_parser(RUN, help="the kubelet plugin (DaemonSet entry point)",
                              description="Run the kubelet plugin: discover, publish ResourceSlices, "
                                          "serve NodePrepareResources / NodeUnprepareResources.")
    add_arguments(run, RUN)
    disc = commands.add_parser(DISCOVER, help="print the devices this node would publish",
                               description="Print what this node would publish, without a cluster. "
                                           f"--mock PROFILE shows a mock node ({profiles}).")
    disc.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table",
                      help="table: one line per device, and what is not published and why; "
                           "yaml/json: the complete resource.k8s.io/v1 ResourceSlices (default: table)")
    add_arguments(disc, DISCOVER)
    status = commands.add_parser(STATUS, help="this node's devices: health, claim, utilization, idle time",
                                 description="Show every device of this node with its health, the claims "
                                             "that hold it, its utilization, memory and power, and how "
                                             "long it has been idle. Reads the driver's state directory "
                                             "and NVML/sysfs; needs no API server.")
    status.add_argument("-o", "--output", choices=("table", "json"), default="table",
                        help="table, or json: one object per device and claim (default: table)")
    add_arguments(status, STATUS)
    clean = commands.add_parser(CLEANUP, help="delete this node's ResourceSlices on purpose",
                                description="Delete this node's ResourceSlices of this driver (a normal "
                                            "shutdown keeps them for the next instance).")
    add_arguments(clean, CLEANUP)
    demo = commands.add_parser("demo", help="run the driver end to end locally on mock devices",
                               formatter_class=formatter,
                               description="Run the real driver process against an API server emulator "
                                           "and a fake kubelet on a mock node; prepare claims and, where "
                                           "podman can run, start containers with their CDI devices.")
    demo.add_argument("--profile", default="mixed", help=f"mock profile for the demo node: {profiles}, "
                                                         "or a profile YAML file")
    demo.add_argument("--claim", type=Path, default=None, metavar="FILE",
                      help="allocate and prepare the ResourceClaims / ResourceClaimTemplates of this "
                           "YAML file (e.g. examples/gpu-single/claim.yaml) instead of the built-in ones")
    demo.add_argument("--mig-mode", choices=("static", "dynamic"), default="static",
                      help="the driver's --mig-mode: dynamic publishes every MIG partition and "
                           "creates the allocated ones at prepare (e.g. examples/mig-dynamic)")
    demo.add_argument("--cdi-root", type=Path, default=None, metavar="DIR",
                      help="where the demo's CDI specs go (default: /var/run/cdi where podman can "
                           "start a container, else a temporary directory)")
    explain = commands.add_parser("explain", help="why a ResourceClaim is pending: each device and "
                                                  "the first reason it does not fit",
                                  description="Explain, node by node and device by device, why a "
                                              "ResourceClaim or ResourceClaimTemplate fits or does not: "
                                              "the selector that was false and what it saw, CEL errors, "
                                              "taints, other claims' allocations, capacity and counters, "
                                              "constraints. Reads a cluster (kubeconfig) or, offline, "
                                              "--slices FILE / --mock PROFILE. Exit status: 0 fits on "
                                              "some node, 1 fits nowhere, 2 usage error.")
    from driver.explain import command as explain_command

    explain_command.add_arguments(explain)
    capacity = commands.add_parser("capacity", help="the largest request of each kind that still fits, per "
                                                    "node and for the cluster (fragmentation)",
                                   description="Per node, the largest request that still fits for each kind: "
                                               "whole GPUs (with and without PCIe-root alignment), MIG "
                                               "profiles, shares of a GPU, GPU+NIC pairs, FPGAs by shell; "
                                               "and for the cluster, the largest anywhere and the free "
                                               "capacity it cannot use. Each answer is explain's allocation "
                                               "model run on a claim of that size. Reads a cluster "
                                               "(kubeconfig) or, offline, -f FILE / --mock PROFILE[xN].")
    from driver.explain import capacity_command

    capacity_command.add_arguments(capacity)
    daemon = commands.add_parser("mps-control-daemon",
                                 help="run a GPU's MPS control daemon (the driver's MPS pods run this)",
                                 description="Start the node's nvidia-cuda-mps-control for one GPU, "
                                             "apply the server defaults and stop it with `quit` on "
                                             "SIGTERM. The driver creates the pods that run it.")
    from driver.prepare import mps_daemon
    mps_daemon.add_arguments(daemon)
    return top


def usage_error(message: str) -> int:
    print(f"dra-driver: configuration error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C before anything started: nothing to clean up
        return 130
    if args.command == "demo":
        try:
            from driver import demo
            code = demo.main(args.profile, claim_file=args.claim, cdi_root=args.cdi_root,
                             mig_mode=args.mig_mode)
        except KeyboardInterrupt:  # before the demo's own handler: it had started nothing
            code = 130
        # The demo has cleaned up. Leave now: at interpreter exit a gRPC channel's __del__
        # or a thread of the emulator can block (seen after Ctrl-C), which nothing needs.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if args.command == "explain":
        from driver.explain import command as explain_command

        return explain_command.run(args)
    if args.command == "capacity":
        from driver.explain import capacity_command

        return capacity_command.run(args)
    if args.command == "mps-control-daemon":
        from driver.prepare import mps_daemon
        try:
            return mps_daemon.run(args)
        except mps_daemon.DaemonError as err:
            print(f"dra-driver mps-control-daemon: {err}", file=sys.stderr)
            return 1
    try:
        config = build(args, command=args.command)
        if args.command == RUN:
            preflight.for_run(config)
        elif args.command == DISCOVER:
            preflight.for_discover(config)
    except ConfigError as err:
        return usage_error(str(err))
    logs.configure(config.log_format, config.log_level)
    if args.command == DISCOVER:
        return run_discover(config, args.output)
    if args.command == RUN:
        return run_plugin(config)
    if args.command == CLEANUP:
        return run_cleanup(config)
    if args.command == STATUS:
        from driver.service import nodeview
        return nodeview.main(config, args.output)
    raise AssertionError(args.command)


def run_plugin(config: Config) -> int:
    import asyncio

    import structlog

    from driver.devices import sysread
    from driver.explain.capacitymetrics import CapacityCollector
    from driver.kube.client import Kube
    from driver.service.plugin import StartupError, serve

    # The client is made by the plugin, after it offered its registration socket (or
    # before, during an upgrade); preflight has seen the kubeconfig's common mistakes.
    kube = Kube.deferred(config.kubeconfig, connections=config.api_connections)
    # The health probe and the utilization sample keep every device's attribute files open
    # (driver/devices/sysread.py): 6,000 on a node of 2,048 VFs.
    before, after = sysread.raise_descriptor_limit()
    if after != before:
        structlog.get_logger(component="plugin").debug("descriptor_limit_raised", before=before,
                                                       after=after)
    try:
        # The fragmentation gauges run explain's model, which the service may not import:
        # it gets their collector's class from here (tests/test_layers.py).
        return asyncio.run(serve(config, kube, capacity_gauges=CapacityCollector))
    except StartupError as err:
        return usage_error(str(err))


def run_cleanup(config: Config) -> int:
    from driver.devices.model import Inventory
    from driver.kube.client import ApiError, ClientConfigError, Kube, api_client
    from driver.publish.publisher import Publisher

    try:
        kube = Kube(api_client(config.kubeconfig))
    except ClientConfigError as err:
        return usage_error(str(err))
    try:
        deleted = Publisher(kube, config.driver_name, config.node_name, Inventory).delete_all()
    except ApiError as err:
        print(f"dra-driver: cleanup failed: {err}", file=sys.stderr)
        return 1
    logs.get("cleanup").info("slices_deleted", node=config.node_name, count=deleted)
    return 0


def run_discover(config: Config, output: str) -> int:
    with tempfile.TemporaryDirectory(prefix="dra-mock-") as scratch:
        node = open_node(config, Path(scratch) / "mock")
        result = discover(node.sources(config))
    log_result(result, logs.get("discovery"))
    if output == "table":
        skipped = [(p.device, p.message) for p in result.problems if p.skipped]
        sys.stdout.write(report.table(result.inventory, result.excluded, skipped))
        return 0
    pool = slices.PoolIdentity(config.driver_name, config.node_name)
    objects = slices.build(result.inventory, pool, generation=1, sharing=config.gpu_sharing)
    sys.stdout.write(report.as_json(objects) if output == "json" else report.as_yaml(objects))
    return 0
