"""Command line: parse arguments, build the Config, hand over to the package.

    dra-driver discover [-o table|yaml|json]   what this node would publish, no cluster
    dra-driver run                             the kubelet plugin
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from driver import __version__, logs, report, slices
from driver.config import ConfigError, Config, add_arguments, build
from driver.devices.discovery import discover, log_result
from driver.node import open_node

EXIT_USAGE = 2


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dra-driver", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"dra-driver {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    disc = commands.add_parser("discover", help="print the devices this node would publish")
    disc.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table")
    add_arguments(disc)
    run = commands.add_parser("run", help="run the kubelet plugin (DaemonSet entry point)")
    add_arguments(run)
    clean = commands.add_parser("cleanup", help="delete this node's ResourceSlices on purpose")
    add_arguments(clean)
    demo = commands.add_parser("demo", help="run the driver end to end locally on mock devices")
    demo.add_argument("--profile", default="mixed", help="mock profile for the demo node")
    demo.add_argument("--claim", type=Path, default=None, metavar="FILE",
                      help="allocate and prepare the ResourceClaims / ResourceClaimTemplates of this "
                           "YAML file (e.g. examples/gpu-single/claim.yaml) instead of the built-in ones")
    demo.add_argument("--cdi-root", type=Path, default=None, metavar="DIR",
                      help="where the demo's CDI specs go (default: /var/run/cdi where podman can "
                           "start a container, else a temporary directory)")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from driver import demo

        return demo.main(args.profile, claim_file=args.claim, cdi_root=args.cdi_root)
    try:
        config = build(args)
    except ConfigError as err:
        print(f"dra-driver: configuration error: {err}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(config.log_format, config.log_level)
    if args.command == "discover":
        return run_discover(config, args.output)
    if args.command == "run":
        return run_plugin(config)
    if args.command == "cleanup":
        return run_cleanup(config)
    raise AssertionError(args.command)


def run_plugin(config: Config) -> int:
    import asyncio

    from kubernetes.config import ConfigException

    from driver.plugin import StartupError, serve

    try:
        return asyncio.run(serve(config))
    except StartupError as err:
        print(f"dra-driver: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigException as err:
        print(f"dra-driver: cannot reach the API server: {err} "
              "(set --kubeconfig outside a cluster)", file=sys.stderr)
        return 1


def run_cleanup(config: Config) -> int:
    from kubernetes.config import ConfigException

    from driver.devices.model import Inventory
    from driver.kube import ApiError, Kube, api_client
    from driver.publisher import Publisher

    try:
        kube = Kube(api_client(config.kubeconfig))
        deleted = Publisher(kube, config.driver_name, config.node_name, Inventory).delete_all()
    except (ConfigException, ApiError) as err:
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
        sys.stdout.write(report.table(result.inventory, result.excluded))
        return 0
    pool = slices.PoolIdentity(config.driver_name, config.node_name)
    objects = slices.build(result.inventory, pool, generation=1)
    sys.stdout.write(report.as_json(objects) if output == "json" else report.as_yaml(objects))
    return 0
