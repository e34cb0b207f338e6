"""`dra-driver explain`: options, inputs, verdicts, exit status (0 fits on some node,
1 fits nowhere, 2 usage error: a bad file, an unknown claim, an unreachable cluster)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from driver import needs_demo_extra

if TYPE_CHECKING:
    from driver.explain import engine, extended, sources
    from driver.explain import pods as pod_claims
    from driver.explain import world as w

# The engine and its CEL evaluator (cel-python) are imported when explain runs, not when
# its options are added: the CLI builds every subcommand's parser, and an install without
# cel-python (before December 2026 the driver's image had none; it is a runtime dependency
# now, for the fragmentation gauges) stopped every `dra-driver` command with an import
# here, `run` and `mps-control-daemon` included (seen on the local cluster: the MPS daemon
# pod crashed with "No module named 'celpy'"). Without it explain says so in one line.

EXIT_FITS, EXIT_NOWHERE, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from driver.devices.mock import builtin_profiles

    parser.add_argument("claim", nargs="?", metavar="CLAIM",
                        help="a ResourceClaim name, else a ResourceClaimTemplate name (in the cluster, "
                             "the --slices files or -f FILE)")
    parser.add_argument("-f", "--filename", type=Path, metavar="FILE",
                        help="explain the ResourceClaims / ResourceClaimTemplates of this YAML file (those "
                             "a Pod or workload of it names together, allocated together as the scheduler "
                             "does, on the nodes its nodeSelector, affinity and tolerations allow), and "
                             "for its Pods and workloads asking for extended resources (nvidia.com/gpu: 1) "
                             "the claim the scheduler makes (DeviceClasses and Nodes in it are used too)")
    parser.add_argument("-n", "--namespace", default=None,
                        help="the claim's namespace (default: the claim's own, else default)")
    parser.add_argument("--node", action="append", default=[], metavar="NODE",
                        help="consider only this node (repeatable)")
    parser.add_argument("--kubeconfig", type=Path, default=None,
                        help="read the cluster through this kubeconfig (default: $KUBECONFIG, "
                             "~/.kube/config, in-cluster)")
    parser.add_argument("--slices", action="append", type=Path, default=[], metavar="FILE",
                        help="offline: ResourceSlices (and DeviceClasses, allocated ResourceClaims, "
                             "Namespaces, DeviceTaintRules) from this YAML/JSON file (repeatable)")
    parser.add_argument("--mock", metavar="PROFILE",
                        help=f"offline: the devices of a mock node ({', '.join(builtin_profiles())}) "
                             "with the chart's DeviceClasses")
    parser.add_argument("--driver-name", default="accel.dra.io",
                        help="this driver's name: --mock publishes under it, and the claim's opaque "
                             "configs for it are checked as the admission policy and prepare check them")
    parser.add_argument("--gpu-sharing", choices=("exclusive", "consumable"), default="exclusive",
                        help="--mock: how whole GPUs are published (the driver's --gpu-sharing)")
    parser.add_argument("--mig-mode", choices=("static", "dynamic"), default="static",
                        help="--mock: the driver's --mig-mode")
    parser.add_argument("--request", action="append", default=[], metavar="SPEC",
                        help="the request as a size instead of a claim: CLASS[=COUNT][,NAME=VALUE...], "
                             "e.g. gpu=4, gpu=1,memory=40Gi (a share), mig=1,profile=3g.40gb; CLASS is a "
                             "DeviceClass or the part of its name before the first dot (repeatable: the "
                             "requests of one claim)")
    parser.add_argument("--blocking", action="store_true",
                        help="what blocks it: per node, the smallest set of allocated claims (and the pods "
                             "that use them) whose removal lets it fit, found by the same model; nodes by "
                             "the size of their set")
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table",
                        help="table: per node, the verdict and why, for people; json, yaml: the same "
                             "for tools (the fields are in docs/explain.md)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colour the table (auto: on a terminal, unless NO_COLOR is set)")


def run(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    from driver.kube.client import ApiError

    try:
        from driver.explain import engine, render, sources
        from driver.explain import world as w
    except ImportError as error:
        if error.name not in ("celpy", "lark"):
            raise
        print(needs_demo_extra("explain", error.name), file=err)
        return EXIT_USAGE

    if args.blocking:
        return _run_blocking(args, out, err)
    try:
        explanations = _explanations(args)
    except (sources.SourceError, engine.ClaimError, w.WorldError) as error:
        print(f"dra-driver explain: {error}", file=err)
        return EXIT_USAGE
    except ApiError as error:  # a request that failed where no step above expected it
        print(f"dra-driver explain: the API server: {error}", file=err)
        return EXIT_USAGE
    if args.output == "json":
        out.write(render.as_json(explanations))
    elif args.output == "yaml":
        import json

        import yaml
        out.write(yaml.safe_dump(json.loads(render.as_json(explanations)), sort_keys=False, width=1000))
    else:
        colour = args.color == "always" or (args.color == "auto" and out.isatty()
                                            and not os.environ.get("NO_COLOR"))
        out.write(render.table(explanations, render.Style(colour)))
    return EXIT_FITS if all(e.fits for e in explanations) else EXIT_NOWHERE


def _explanations(args: argparse.Namespace) -> list[engine.Explanation]:
    claims, together, pods, world, nodes = _inputs(args)
    return ([_one(claim, world, nodes, args.driver_name) for claim in claims]
            + [e for pod in together for e in _pod(pod, world, nodes, args.driver_name)]
            + [_extended(pod, world, nodes) for pod in pods])


def _extended(pod: extended.PodResources, world: w.World, nodes: list[str] | None) -> engine.Explanation:
    from driver.explain import cluster_release, extended

    result = extended.explain_pod(pod, world, nodes)
    result.release = cluster_release.pod_line(pod, extended.class_mapping(world.classes), world.release)
    return result


def _run_blocking(args: argparse.Namespace, out, err) -> int:
    """`--blocking`: per node, what to remove for the claim (or each pod's claims together)."""
    from driver.explain import blocking, blocking_render, engine, render, sources
    from driver.explain import pods as pod_claims
    from driver.explain import world as w
    from driver.kube.client import ApiError

    try:
        claims, together, pods, world, nodes = _inputs(args)
        if pods and not claims and not together:
            raise sources.SourceError(f"-f {args.filename}: --blocking takes ResourceClaims, templates and pods "
                                      "that name them, not pods asking for extended resources (give the claim)")
        answers = [blocking.blocking([engine.PodClaim(c.ref, c.spec, c.namespace, c.uid)], world, nodes,
                                     "" if c.origin != "--request" else " ".join(f"--request {r}" for r in args.request),
                                     f"{c.kind} from {c.origin}" if c.origin != "--request" else "")
                   for c in claims]
        for pod in together:
            considered = nodes if nodes is not None else world.nodes()
            filtered = {n: why for n in considered if (why := pod_claims.node_filter(pod, n, world))}
            answers.append(blocking.blocking([engine.PodClaim(c.ref, c.spec, c.namespace, c.uid) for c in pod.claims],
                                             world, nodes, f"{pod.kind} {pod.ref}",
                                             f"its {len(pod.claims)} claims together, from {pod.claims[0].origin}",
                                             filtered))
    except (sources.SourceError, engine.ClaimError, w.WorldError) as error:
        print(f"dra-driver explain: {error}", file=err)
        return EXIT_USAGE
    except ApiError as error:
        print(f"dra-driver explain: the API server: {error}", file=err)
        return EXIT_USAGE
    if args.output == "json":
        out.write(blocking_render.as_json(answers))
    elif args.output == "yaml":
        out.write(blocking_render.as_yaml(answers))
    else:
        colour = args.color == "always" or (args.color == "auto" and out.isatty()
                                            and not os.environ.get("NO_COLOR"))
        out.write(blocking_render.table(answers, render.Style(colour)))
    return EXIT_FITS if any(a.fits for a in answers) else EXIT_NOWHERE


def _inputs(args: argparse.Namespace):
    """(claims judged alone, pods whose claims go together, pods asking for extended
    resources, the world, the nodes to consider or None for all)."""
    from driver.explain import blocking_request, extended, sources
    from driver.explain import pods as pod_claims
    from driver.explain import world as w

    if args.request and (args.claim is not None or args.filename is not None):
        raise sources.SourceError("--request gives the request: name no claim (CLAIM) and no -f FILE with it")
    if args.claim is None and args.filename is None and not args.request:
        raise sources.SourceError("name a claim (CLAIM) or give -f FILE (or the request's size: --request SPEC)")
    offline = bool(args.slices or args.mock)
    objects: list[dict] = []
    notes: list[str] = []
    kube = None
    if args.mock:
        objects += sources.mock_objects(args.mock, args.driver_name, args.gpu_sharing, args.mig_mode)
    for path in args.slices:
        objects += sources.read_objects(path, "--slices")
    namespace = args.namespace or "default"
    pods: list[extended.PodResources] = []
    together: list[pod_claims.PodClaims] = []
    if args.filename is not None:
        claim_objects = sources.read_objects(args.filename, "-f")
        file_claims = sources.claims_in(claim_objects, args.filename.name, namespace)
        if args.claim is None:
            try:
                pods = extended.pods_in(claim_objects, args.filename.name, namespace)
            except extended.ExtendedResourceError as error:
                raise sources.SourceError(f"-f {args.filename}: {error}") from None
        if not file_claims and not pods and args.claim is None:
            raise sources.SourceError(f"-f {args.filename}: no ResourceClaim, ResourceClaimTemplate or "
                                      "pod asking for extended resources in it")
        claims = file_claims if pods else sources.pick(file_claims, args.claim, args.namespace,
                                                       f"-f {args.filename}")
        if args.claim is None:
            # A pod's claims are allocated together: explained as its pod, not one by one.
            together = pod_claims.pods_with_claims(claim_objects, file_claims, f"-f {args.filename}", namespace)
            named = [c for pod in together for c in pod.named]
            claims = [c for c in claims if c not in named]
        # DeviceClasses and Nodes of the file take part; its claims are not allocations.
        objects += [o for o in claim_objects if o.get("kind") in ("DeviceClass", "Node")]
    elif args.request:
        claims = []
    elif offline:
        # Name what was searched: a mock node holds devices, never claims, and a user who
        # gave only --mock needs to hear that the claim comes with -f.
        searched = " and ".join(([f"--mock {args.mock}"] if args.mock else [])
                                + [f"--slices {p}" for p in args.slices])
        hint = ("" if args.slices else
                "; --mock gives devices only: name the claim's file with -f FILE "
                "(e.g. -f examples/gpu-single/claim.yaml)")
        claims = sources.pick(sources.claims_in(objects, "files", namespace), args.claim,
                              args.namespace, searched, hint=hint)
    else:
        kube = _kube(args.kubeconfig)
        claims = [sources.cluster_claim(kube, args.claim, namespace)]
    if not offline:
        kube = kube or _kube(args.kubeconfig)
        listed, notes = sources.cluster_objects(kube, (claims or pods)[0].namespace if claims or pods else namespace,
                                                nodes=bool(pods))
        objects += listed
    world = w.build(objects)
    world.notes += notes
    if kube is not None:
        world.release = sources.server_release(kube)
    for node in args.node:
        if node not in world.nodes():
            raise sources.SourceError(f"--node {node}: no ResourceSlice names this node "
                                      f"(nodes: {', '.join(world.nodes()) or 'none'})")
    nodes = args.node or None
    if args.request:
        try:
            spec = blocking_request.claim_spec(args.request, world)
        except blocking_request.RequestError as error:
            raise sources.SourceError(str(error)) from None
        claims = [sources.Claim("ResourceClaim", namespace, "request", spec, origin="--request")]
    return claims, together, pods, world, nodes


def _pod(pod: pod_claims.PodClaims, world: w.World, nodes: list[str] | None,
         driver: str) -> list[engine.Explanation]:
    from driver.explain import cluster_release, configs, engine

    from driver.explain import pods as pod_claims

    considered = nodes if nodes is not None else world.nodes()
    filtered = {node: why for node in considered if (why := pod_claims.node_filter(pod, node, world))}
    results = engine.explain_pod([engine.PodClaim(c.ref, c.spec, c.namespace, c.uid) for c in pod.claims],
                                 world, nodes, [f"{c.kind} from {c.origin}, claim {i + 1} of {len(pod.claims)} of "
                                                f"{pod.kind} {pod.ref}, allocated together"
                                                for i, c in enumerate(pod.claims)], filtered)
    unknown = [node for node in considered if node not in world.labels]
    for claim, result in zip(pod.claims, results):
        configs.check(result, claim.spec, driver, world)
        result.release = cluster_release.claim_line(claim.ref, claim.spec, world.release)
        if unknown and (pod.node_selector or pod.required_affinity is not None):
            result.notes.append(f"no Node object for {', '.join(unknown)}: the pod's nodeSelector and node "
                                "affinity are not checked there (give the Nodes with -f or --slices)")
    return results


def _one(claim: sources.Claim, world: w.World, nodes: list[str] | None,
         driver: str) -> engine.Explanation:
    from driver.explain import cluster_release, configs, engine

    source = f"{claim.kind} from {claim.origin}"
    result = engine.explain(claim.ref, claim.spec, world, claim.namespace, nodes,
                            skip_uid=claim.uid, source=source)
    configs.check(result, claim.spec, driver, world)
    result.release = cluster_release.claim_line(claim.ref, claim.spec, world.release)
    if world.namespaces is None and any(a.admin for _, alts in engine.requests(claim.ref, claim.spec)
                                        for a in alts):
        result.notes.append("namespace labels are unknown (no Namespace objects): the admin-access "
                            "label is not checked")
    if claim.allocated_on:
        result.notes.insert(0, f"the claim is allocated (on {claim.allocated_on}); this shows where "
                               "it could go without its own allocation")
    return result


def _kube(kubeconfig: Path | None):
    from driver.explain import sources
    from driver.kube.client import ClientConfigError, Kube, api_client

    path = kubeconfig
    if path is None and os.environ.get("KUBECONFIG"):
        path = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    if path is None and (Path.home() / ".kube" / "config").exists():
        path = Path.home() / ".kube" / "config"
    try:
        return Kube(api_client(path))
    except ClientConfigError as error:
        raise sources.SourceError(str(error)) from None
