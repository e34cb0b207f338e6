"""The cluster tier: the driver against upstream Kubernetes built from source and run on
this machine (hack/local-cluster). The cluster is started once per pytest session.

Runs only when asked for by path (`python3 -m pytest tests/cluster`): the default
`python3 -m pytest` deselects it, since it builds Kubernetes and needs root; .ci/run runs it
once. Without Go (or root) its tests are skipped with the reason, and fail instead under
CI=true. On a failure the report gets the last lines of every component's log (all of them
are in the cluster's logs/ folder).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

HACK = REPO / "hack" / "local-cluster"
CI = os.environ.get("CI") == "true"
HERE = Path(__file__).resolve().parent
TIMINGS: dict[str, float] = {}


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location("local_cluster", HACK / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = mod
    spec.loader.exec_module(mod)
    return mod


lc = _load_cluster_module()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "release(minimum, why): the case needs Kubernetes 1.<minimum> or newer, since "
        "what it checks does not exist before (`why`); on an older release it is reported not "
        "applicable (hack/local-cluster/matrix)")


@functools.cache
def release_minor() -> int:
    """The release the tier runs against (KUBERNETES_VERSION, versions.env)."""
    return lc.minor(lc.versions()["KUBERNETES_VERSION"])


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("release"):
        minimum, why = mark.args
        if release_minor() < minimum:
            pytest.skip(f"not applicable on 1.{release_minor()}: {why} (Kubernetes 1.{minimum}+)")


def _asked_for(config: pytest.Config) -> bool:
    """True when a command-line argument names this folder or something in it."""
    for arg in config.args:
        p = Path(arg.split("::")[0]).resolve()
        if p == HERE or HERE in p.parents:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked_for(config):
        return
    mine = [i for i in items if HERE in Path(str(i.fspath)).parents]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [i for i in items if i not in mine]


# The end-of-run check that the chart grants nothing the tier never used (tests/cluster/rbac.py)
# needs the whole tier: `pytest tests/cluster`, nothing deselected, every test passed.
PARTIAL: list[str] = []
UNUSED: list[str] = []
REDUNDANT: list[str] = []
CHECKED: list[int] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    PARTIAL.extend(i.nodeid for i in items if HERE in Path(str(i.fspath)).parents)


def _whole_tier(config: pytest.Config) -> bool:
    return not PARTIAL and any(Path(a).resolve() == HERE for a in config.args if "::" not in a)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails a whole, green run of the tier if the chart's ClusterRole or Role grants the
    driver a verb that no request of the driver's service account used (audit log)."""
    if "up" not in TIMINGS or exitstatus != 0 or not _whole_tier(session.config):
        return
    from tests.cluster import rbac
    from tests.cluster.driverhost import NAMESPACE, service_account
    from tests.test_chart import render

    objects = render({"mock": {"enabled": True}})
    account = f"system:serviceaccount:{NAMESPACE}:{service_account(objects)}"
    events = lc.Cluster().audit(account)
    left = rbac.unused(objects, events)
    CHECKED.append(len(rbac.grants(objects)))
    REDUNDANT.extend(str(g) for g in rbac.redundant(objects, events))
    if left:
        UNUSED.extend(str(g) for g in left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _unavailable(why: str):
    if CI:
        pytest.fail(f"cluster tier cannot run under CI=true: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def cluster():
    """The running cluster (hack/local-cluster/cluster.py's Cluster), built first if needed."""
    if shutil.which("go") is None:
        _unavailable("Go is not installed (the cluster tier builds Kubernetes from source)")
    if os.geteuid() != 0:
        _unavailable("the local cluster needs root (kubelet, containerd, mounts, cgroups)")
    t0 = time.monotonic()
    build = subprocess.run([str(HACK / "build.sh"), "all"], capture_output=True, text=True)
    TIMINGS["build"] = time.monotonic() - t0
    if build.returncode:
        pytest.fail(f"hack/local-cluster/build.sh failed ({build.returncode}):\n{build.stderr[-6000:]}",
                    pytrace=False)
    c = lc.Cluster()
    t0 = time.monotonic()
    try:
        c.up()
    except lc.ClusterError as e:
        logs = _all_logs(c)
        try:
            c.down()
        finally:
            pytest.fail(f"local cluster did not come up: {e}\n{logs}", pytrace=False)
    TIMINGS["up"] = time.monotonic() - t0
    yield c
    t0 = time.monotonic()
    c.down()
    TIMINGS["down"] = time.monotonic() - t0


@pytest.fixture(scope="session")
def driver_image(cluster) -> str:
    """The driver's image (hack/local-cluster/image.sh, built by build.sh all) imported into
    the node's containerd, for pods that run our code (the MPS control daemon)."""
    t0 = time.monotonic()
    try:
        name = cluster.import_driver_image()
    except lc.ClusterError as e:
        pytest.fail(f"the driver image: {e}", pytrace=False)
    TIMINGS["driver image import"] = time.monotonic() - t0
    return name


def _all_logs(c, lines: int = 30) -> str:
    out = []
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                 "containerd", "kubelet", "kube-proxy", "coredns"):
        out.append(f"----- {name} (last {lines} lines of {c.logs / (name + '.log')}) -----\n{c.tail(name, lines)}")
    for drv in sorted(c.logs.glob("driver-*.log")):
        out.append(f"----- {drv.name} -----\n{c.tail(drv.stem, lines)}")
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "cluster" in getattr(item, "fixturenames", ()):
        c = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
        if c is not None:
            rep.sections.append(("component logs", _all_logs(c)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TIMINGS:
        return
    terminalreporter.write_line(
        "local cluster: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))
    # Every API call the driver's service account made in this session (the audit log
    # outlives `down`), for comparing with what the chart grants.
    calls: dict[tuple[str, str, str], dict[int, int]] = {}
    for ev in lc.Cluster().audit():
        ref = ev.get("objectRef", {})
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        key = (ref.get("apiGroup", "") or "core", resource, ev["verb"])
        code = ev.get("responseStatus", {}).get("code", 0)
        calls.setdefault(key, {}).setdefault(code, 0)
        calls[key][code] += 1
    if calls:
        terminalreporter.write_line("driver API calls (group resource verb: answers):")
        for (group, resource, verb), codes in sorted(calls.items()):
            terminalreporter.write_line(f"  {group} {resource} {verb}: "
                                        + ", ".join(f"{c}x{n}" for c, n in sorted(codes.items())))
    if UNUSED:
        terminalreporter.write_line(
            f"FAILED: the chart grants the driver {len(UNUSED)} verb(s) that no request of the tier "
            "used (remove the grant, or make the tier exercise what needs it):", red=True)
        for line in UNUSED:
            terminalreporter.write_line(f"  {line}", red=True)
    elif CHECKED:
        terminalreporter.write_line(f"chart RBAC: each of the {CHECKED[0]} granted verbs was used in this run")
    for line in REDUNDANT:
        terminalreporter.write_line(f"  (used, but another role allowed each request first: {line})")
