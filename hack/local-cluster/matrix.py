"""The cluster tier on every supported Kubernetes release, one after another: each release
is built (build.sh k8s; the other components are the same for all), the tier runs against
it (`pytest tests/cluster` with KUBERNETES_VERSION set, so the cluster fixture starts that
release with its own feature gates and API versions, cluster.py RELEASE_GATES), and a table
says, per case and release, passed, failed, or not applicable with the reason (a case
marked `@pytest.mark.release(minimum, why)` on a release older than that).

    hack/local-cluster/matrix                      every release in versions.env MATRIX_RELEASES
    hack/local-cluster/matrix --releases 1.32,1.37 two of them (newest patch of each)
    hack/local-cluster/matrix --markdown out.md -- -k slices    extra pytest arguments after --
    hack/local-cluster/matrix --releases 1.35 --rerun-failed   only the last run's failed cases

A rerun's outcomes replace those cases' in the table, marked "(rerun)"; the rest of the
release's run stands.

Results (JUnit XML per release and the table) go under --out (default
/var/lib/dra-local-cluster-matrix, outside the checkout); `--table-only` prints the table
of the last run again. Exit status 1 when any case failed on any release.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NOT_APPLICABLE = "not applicable"  # how tests/cluster/conftest.py starts such a skip's reason


@dataclass
class Outcome:
    result: str  # passed, failed, n/a, skipped
    reason: str = ""
    rerun: bool = False  # from a --rerun-failed run, not the release's whole run


@dataclass
class ReleaseRun:
    version: str
    seconds: float = 0.0
    build_seconds: float = 0.0
    error: str = ""  # the release could not be built or its tier did not run
    cases: dict[str, Outcome] = field(default_factory=dict)


def matrix_releases() -> list[str]:
    out = subprocess.run(["bash", "-c", f"set -a; . {HERE / 'versions.env'}; echo $MATRIX_RELEASES"],
                         check=True, capture_output=True, text=True).stdout.split()
    return out


def pick(releases: list[str], wanted: str | None) -> list[str]:
    """`1.32,1.37` (or full versions) -> the versions of MATRIX_RELEASES they name."""
    if not wanted:
        return releases
    chosen = []
    for item in (w.strip().lstrip("v") for w in wanted.split(",") if w.strip()):
        match = [r for r in releases if r.lstrip("v") == item or r.lstrip("v").startswith(item + ".")]
        if not match:
            raise SystemExit(f"matrix: --releases: {item} is not one of {', '.join(releases)} "
                             "(versions.env MATRIX_RELEASES)")
        chosen += match
    return chosen


def case_id(testcase: ET.Element) -> str:
    module = testcase.get("classname", "").removeprefix("tests.cluster.")
    return f"{module}::{testcase.get('name')}"


def parse_junit(path: Path) -> dict[str, Outcome]:
    cases: dict[str, Outcome] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        failed = next((e for e in (tc.find("failure"), tc.find("error")) if e is not None), None)
        skipped = tc.find("skipped")
        if failed is not None:
            outcome = Outcome("failed", ((failed.get("message") or "").splitlines() or [""])[0][:200])
        elif skipped is not None:
            message = skipped.get("message") or ""
            message = message.split(": ", 1)[1] if message.startswith("Skipped: ") else message
            outcome = Outcome("n/a" if message.startswith(NOT_APPLICABLE) else "skipped", message)
        else:
            outcome = Outcome("passed")
        # a teardown error is reported as a second entry of the same case
        if (case := case_id(tc)) not in cases or cases[case].result != "failed":
            cases[case] = outcome
    return cases


def rerun_files(out: Path, version: str) -> list[Path]:
    """The release's --rerun-failed results, oldest first."""
    return sorted(out.glob(f"{version}.rerun-*.xml"), key=lambda p: int(p.name.rsplit("-", 1)[1].split(".")[0]))


def outcomes(out: Path, version: str) -> dict[str, Outcome]:
    """The release's last whole run, with each later rerun's outcomes over it."""
    junit = out / f"{version}.xml"
    cases = parse_junit(junit) if junit.exists() else {}
    for rerun in rerun_files(out, version):
        cases.update({case: Outcome(o.result, o.reason, rerun=True) for case, o in parse_junit(rerun).items()})
    return cases


def node_id(case: str) -> str:
    """test_x::test_y[p] (a table row) -> tests/cluster/test_x.py::test_y[p] (pytest's)."""
    module, _, name = case.partition("::")
    return f"tests/cluster/{module.replace('.', '/')}.py::{name}"


def run_release(version: str, out: Path, pytest_args: list[str], rerun: bool = False) -> ReleaseRun:
    run = ReleaseRun(version)
    env = dict(os.environ, KUBERNETES_VERSION=version, CI="true")
    t0 = time.monotonic()
    build = subprocess.run([str(HERE / "build.sh"), "k8s"], env=env, capture_output=True, text=True)
    run.build_seconds = time.monotonic() - t0
    if build.returncode:
        run.error = f"build.sh k8s failed ({build.returncode}): " + (build.stderr.strip().splitlines() or [""])[-1]
        return run
    targets = ["tests/cluster"]
    if rerun:
        known = outcomes(out, version)
        targets = [node_id(c) for c, o in known.items() if o.result == "failed"]
        if not targets:
            run.cases = known
            return run
        junit = out / f"{version}.rerun-{len(rerun_files(out, version)) + 1}.xml"
    else:
        junit = out / f"{version}.xml"
        for stale in [junit, *rerun_files(out, version)]:  # a whole run starts the release afresh
            stale.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(out / f"{junit.stem}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets,
                        f"--junitxml={junit}", *pytest_args], cwd=REPO, env=env, stdout=log,
                       stderr=subprocess.STDOUT)
    run.seconds = time.monotonic() - t0
    if not junit.exists():
        run.error = f"the tier did not run (see {out / f'{junit.stem}.log'})"
        return run
    run.cases = outcomes(out, version)
    return run


MARK = {"passed": "passed", "failed": "FAILED", "n/a": "n/a", "skipped": "skipped"}


def table(runs: list[ReleaseRun], markdown: bool) -> str:
    cases = sorted({c for r in runs for c in r.cases})
    heads = [r.version for r in runs]
    reasons: dict[str, int] = {}
    rows = []
    for case in cases:
        cells = []
        for r in runs:
            o = r.cases.get(case)
            if o is None:
                cells.append("—" if not r.error else "not run")
                continue
            cell = MARK[o.result] + (" (rerun)" if o.rerun else "")
            if o.result in ("n/a", "skipped", "failed") and o.reason:
                n = reasons.setdefault(o.reason, len(reasons) + 1)
                cell += f" [{n}]"
            cells.append(cell)
        rows.append((case, cells))
    lines = []
    if markdown:
        lines.append("| case | " + " | ".join(heads) + " |")
        lines.append("|---|" + "---|" * len(heads))
        lines += [f"| `{case}` | " + " | ".join(cells) + " |" for case, cells in rows]
        lines.append("| **passed / failed / n/a** | " + " | ".join(totals(r) for r in runs) + " |")
        lines.append("| **tier time** | " + " | ".join(
            (f"{r.seconds / 60:.1f} min" if not r.error else r.error) for r in runs) + " |")
    else:
        width = max([len(c) for c in cases] + [10])
        lines.append(f"{'case':<{width}}  " + "  ".join(f"{h:<12}" for h in heads))
        lines += [f"{case:<{width}}  " + "  ".join(f"{c:<12}" for c in cells) for case, cells in rows]
        lines.append(f"{'passed/failed/n/a':<{width}}  " + "  ".join(f"{totals(r):<12}" for r in runs))
        lines.append(f"{'tier minutes':<{width}}  " + "  ".join(
            f"{r.seconds / 60:<12.1f}" if not r.error else f"{'error':<12}" for r in runs))
        for r in runs:
            if r.error:
                lines.append(f"{r.version}: {r.error}")
    if reasons:
        lines.append("")
        lines += [f"[{n}] {why}" for why, n in reasons.items()]
    return "\n".join(lines)


def totals(run: ReleaseRun) -> str:
    count = {k: sum(1 for o in run.cases.values() if o.result == k) for k in ("passed", "failed", "n/a")}
    return f"{count['passed']} / {count['failed']} / {count['n/a']}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="hack/local-cluster/matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--releases", help="comma-separated minors or versions (default: all of MATRIX_RELEASES)")
    p.add_argument("--out", type=Path, default=Path("/var/lib/dra-local-cluster-matrix"))
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    p.add_argument("--table-only", action="store_true", help="the table of the last run in --out, nothing run")
    p.add_argument("--rerun-failed", action="store_true",
                   help="run only the cases that failed in each release's last run; their outcomes replace those")
    args = p.parse_args(argv)
    releases = pick(matrix_releases(), args.releases)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = args.out / "runs.json"
    runs: list[ReleaseRun] = []
    if args.table_only:
        saved = json.loads(summary.read_text()) if summary.exists() else {}
        for version in releases:
            r = saved.get(version)
            if r is None:
                continue
            run = ReleaseRun(version, r["seconds"], r["build_seconds"], r["error"])
            run.cases = outcomes(args.out, version) if not run.error else {}
            runs.append(run)
    else:
        saved = json.loads(summary.read_text()) if summary.exists() else {}
        for version in releases:
            started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            print(f"matrix: {version}: building and running the "
                  f"{'failed cases' if args.rerun_failed else 'tier'} ...", flush=True)
            run = run_release(version, args.out, extra, rerun=args.rerun_failed)
            took = run.seconds
            if args.rerun_failed and version in saved:
                # the table keeps the whole run's time; the reruns are noted beside it
                previous = saved[version]
                previous.setdefault("reruns", []).append({"seconds": run.seconds, "started": started,
                                                          "error": run.error})
                run.seconds, run.error = previous["seconds"], run.error or previous["error"]
            else:
                saved[version] = {"seconds": run.seconds, "build_seconds": run.build_seconds,
                                  "error": run.error, "started": started, "pytest_args": extra}
            runs.append(run)
            summary.write_text(json.dumps(saved, indent=1))
            print(f"matrix: {version}: {totals(run)} (passed / failed / n/a) in {took / 60:.1f} min"
                  f"{', ' + run.error if run.error else ''}", flush=True)
    print(table(runs, markdown=False))
    if args.markdown:
        args.markdown.write_text(table(runs, markdown=True) + "\n")
    failed = any(r.error or any(o.result == "failed" for o in r.cases.values()) for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
