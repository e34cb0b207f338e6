"""`dra-driver capacity`: options, inputs (explain's: a cluster, files, mock nodes), output.
Exit status: 0 answered, 2 usage error (a bad file, an unknown node or class, an
unreachable cluster)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driver import needs_demo_extra

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from driver.devices.mock import builtin_profiles

    parser.add_argument("-f", "--filename", "--slices", dest="files", action="append", type=Path, default=[],
                        metavar="FILE",
                        help="offline: ResourceSlices, allocated ResourceClaims, DeviceClasses, Nodes from this "
                             "YAML/JSON file (repeatable; e.g. kubectl get resourceslices,resourceclaims,"
                             "deviceclasses -A -o yaml)")
    parser.add_argument("--mock", action="append", default=[], metavar="PROFILE[xN]",
                        help=f"offline: N mock nodes of a profile ({', '.join(builtin_profiles())}), "
                             "repeatable, with the chart's DeviceClasses (h100x8x4: four h100x8 nodes)")
    parser.add_argument("--node", action="append", default=[], metavar="NODE",
                        help="only this node (repeatable)")
    parser.add_argument("--device-class", metavar="CLASS",
                        help="only requests of this DeviceClass (e.g. gpu.accel.dra.io)")
    parser.add_argument("--kubeconfig", type=Path, default=None,
                        help="read the cluster through this kubeconfig (default: $KUBECONFIG, "
                             "~/.kube/config, in-cluster)")
    parser.add_argument("--driver-name", default="accel.dra.io",
                        help="this driver's name: its classes are gpu.NAME, mig.NAME, nic.NAME, fpga.NAME")
    parser.add_argument("--gpu-sharing", choices=("exclusive", "consumable"), default="exclusive",
                        help="--mock: how whole GPUs are published (the driver's --gpu-sharing)")
    parser.add_argument("--mig-mode", choices=("static", "dynamic"), default="static",
                        help="--mock: the driver's --mig-mode")
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table",
                        help="table for people; json or yaml for tools (docs/capacity.md)")


def run(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    from driver.kube.client import ApiError

    try:
        from driver.explain import capacity, capacity_render, sources
        from driver.explain import world as w
    except ImportError as error:
        if error.name not in ("celpy", "lark"):
            raise
        print(needs_demo_extra("capacity", error.name), file=err)
        return EXIT_USAGE
    try:
        result = answer(args)
    except (sources.SourceError, w.WorldError) as error:
        print(f"dra-driver capacity: {error}", file=err)
        return EXIT_USAGE
    except ApiError as error:
        print(f"dra-driver capacity: the API server: {error}", file=err)
        return EXIT_USAGE
    render = {"json": capacity_render.as_json, "yaml": capacity_render.as_yaml}.get(args.output,
                                                                                  capacity_render.table)
    out.write(render(result))
    return EXIT_OK


def objects(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The objects capacity reads (explain's sources), and notes on what could not be read."""
    from driver.explain import capacity_inputs, sources

    found: list[dict] = []
    if args.mock:
        found += capacity_inputs.mock_nodes(args.mock, args.driver_name, args.gpu_sharing, args.mig_mode)
    for path in args.files:
        found += sources.read_objects(path, "-f")
    if args.mock or args.files:
        return found, []
    from driver.explain.command import _kube

    return sources.cluster_objects(_kube(args.kubeconfig), "default", nodes=True)


def answer(args: argparse.Namespace):
    from driver.explain import capacity, capacity_inputs, sources
    from driver.explain import world as w

    found, notes = objects(args)
    classes = {(o.get("metadata") or {}).get("name") for o in found if o.get("kind") == "DeviceClass"}
    if args.device_class and args.device_class not in classes:
        raise sources.SourceError(f"--device-class {args.device_class}: no such DeviceClass "
                                  f"(classes: {', '.join(sorted(c for c in classes if c)) or 'none'})")
    split = capacity_inputs.per_node(found)
    known = [item.node for item in split] if split is not None else None
    world = None
    if known is None:
        world = w.build(found)
        known = world.nodes()
    for node in args.node:
        if node not in known:
            raise sources.SourceError(f"--node {node}: no ResourceSlice names this node "
                                      f"(nodes: {', '.join(known[:10]) or 'none'}{' ...' if len(known) > 10 else ''})")
    if split is not None:
        chosen = [item for item in split if not args.node or item.node in args.node]
        result = capacity.capacity_per_node(chosen, args.driver_name, args.device_class)
    else:
        result = capacity.capacity(world, args.driver_name, args.node or None, args.device_class)
    result.notes += notes
    return result
