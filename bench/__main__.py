"""Benchmarks of the real driver process in mock mode, against the API server emulator and
a fake kubelet. Prints median and p99 per figure, and ratios against the primitives the
driver cannot avoid, measured in the same run on the same machine.

    python -m bench [--runs 200] [--idle-seconds 30] [--quick] [--startup-only] [--idle-large 600]
    python -m bench --against OTHER_CHECKOUT [--runs 200]
    python -m bench fleet [--nodes 100,500] [--pods 200]   (bench/fleet.py: fake nodes, the real scheduler)
    python -m bench alloccost [--nodes 20] [--fill 0.5]    (bench/alloccost.py: one node's cost to the real allocator)

One module per measured concern: `startup`, `prepare` (latency, throughput, scaling and
its A/Bs), `sharing` (MPS shares, dynamic MIG), `fpga` (programming at prepare), `idle` (idle CPU, utilization sampling),
`large` (the sriov-large node), `publish`, `against` (another checkout side by side); the
driver process and claims they use are in `harness`, the floor in `floor`, the printed
table in `table`.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

from bench.against import bench_against
from bench.floor import Floor
from bench.fpga import bench_fpga
from bench.harness import NODE, file_system
from bench.idle import bench_utilization, idle_large
from bench.large import bench_large_node
from bench.prepare import bench_prepare
from bench.publish import bench_publish
from bench.sharing import bench_dynamic_mig, bench_sharing
from bench.startup import bench_startup
from bench.table import Table
from driver import logs
from driver.sim.apiserver import ApiServer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--runs", type=int, default=200,
                        help="prepares measured for each latency figure (and its floor); more "
                             "runs steady the p99 (default: 200)")
    parser.add_argument("--idle-seconds", type=float, default=30.0,
                        help="how long the idle driver's CPU is sampled (default: 30)")
    parser.add_argument("--quick", action="store_true", help="fewer runs, 5 s idle (smoke test)")
    parser.add_argument("--startup-only", action="store_true", help="the baselines and start-up alone")
    parser.add_argument("--idle-large", type=float, metavar="SECONDS", default=0.0,
                        help="only the idle CPU of a driver on sriov-large over SECONDS (issue 17: 600)")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="only prepare latency, throughput, CPU and RSS, alternating with the driver "
                             "of another source tree (git worktree add /tmp/old REV)")
    return parser


def main() -> int:
    import sys

    if sys.argv[1:2] == ["alloccost"]:  # its own command line: bench/alloccost.py
        from bench.alloccost import main as alloccost_main
        return alloccost_main(sys.argv[2:])
    if sys.argv[1:2] == ["fleet"]:  # its own command line: bench/fleet.py
        from bench.fleet import main as fleet_main
        return fleet_main(sys.argv[2:])
    if sys.argv[1:2] == ["capacity"]:  # its own command line: bench/capacity.py
        from bench.capacity import main as capacity_main
        return capacity_main(sys.argv[2:])
    parser = build_parser()
    args = parser.parse_args()
    logs.configure("console", "warning")
    if args.quick:
        args.runs, args.idle_seconds = 30, 5.0
    runs = args.runs
    table = Table()
    scratch = Path(tempfile.mkdtemp(prefix="dra-bench-base-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.platform()}; runs={runs}", flush=True)
    print(f"driver directories under {scratch.parent}: {file_system(scratch)} "
          "(TMPDIR chooses; a node has /var/run/cdi on tmpfs and its state on a journaled disk)",
          flush=True)

    if args.against:
        if not (args.against / "driver" / "__main__.py").is_file():
            parser.error(f"--against {args.against}: not a checkout of this driver (no driver/__main__.py)")
        bench_against(args.against.resolve(), runs)
        return 0
    if args.idle_large:
        with ApiServer() as api:
            api.add_node(NODE)
            idle_large(api, args.idle_large)
        return 0
    with ApiServer() as api:
        api.add_node(NODE)
        # -- baselines (again between the prepares below, for their ratios) ------------------
        base = Floor(api, scratch)
        for _ in range(runs):
            base.sample()
        base.rows(table)
        base.close()

        # -- start-up ---------------------------------------------------------------------------
        bench_startup(table, api, scratch, 5 if args.quick else 10)
        if args.startup_only:
            table.print()
            return 0
        # -- prepare: latency, throughput, scaling and the A/Bs of this run -------------------
        p = bench_prepare(table, api, scratch, runs, args.idle_seconds, base)

    # -- utilization sampling: CPU per sample -------------------------------------------------
    bench_utilization(table, scratch, max(20, runs // 4))

    # -- GPU sharing: shares of consumable capacity under the GPU's MPS daemon ------------------
    bench_sharing(table, max(10, runs // 10), p)
    # -- dynamic MIG: publish 8 H100s' partitions, create one at each prepare -------------------
    bench_dynamic_mig(table, max(10, runs // 5), p)
    # -- FPGAs: a prepare that loads the claim's function, one that finds it loaded --------------
    bench_fpga(table, max(10, runs // 10))

    # -- where a large node's publish time goes (in-process) ------------------------------------
    bench_large_node(table, scratch, runs)

    # -- publish -------------------------------------------------------------------------------
    bench_publish(table)
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
