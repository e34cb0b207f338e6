"""The driver on the local cluster's node, as the chart runs it, but as a host process:
the chart installed with helm (its RBAC, ValidatingAdmissionPolicies and DeviceClasses)
with the DaemonSet held off every node, a token of the chart's ServiceAccount, the
DaemonSet's environment with its host paths mapped to the cluster's kubelet folders.

For the tests that must kill or trace the driver's process or read its private state;
the others run the chart's pod (tests/cluster/driverpod.py, docs/testing.md says which)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO
from tests.helm_cli import Helm
from tests.test_chart import CHART

NAMESPACE = "dra-system"  # the release namespace tests/test_chart.render uses
RELEASE = "dra"  # and its release name (the objects' names follow from it)
DRIVER = "accel.dra.io"


def daemonset_env(objects: list[dict]) -> dict[str, str]:
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def service_account(objects: list[dict]) -> str:
    (sa,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    return sa["metadata"]["name"]


def install(cluster, values: dict) -> list[dict]:
    """`helm upgrade --install` of the chart with these values, its DaemonSet given a
    nodeSelector that no node matches, so that the host process started next never runs
    beside a driver pod (an earlier test's pod is waited out). Returns the objects as
    `helm template` renders them with `values` (what the host process's environment is
    taken from)."""
    from tests.cluster.driverpod import NO_NODE, helm_apply, merge, wait_no_driver_pod

    helm = Helm(cluster.helm, cluster.root / "helm")
    helm.home.mkdir(parents=True, exist_ok=True)
    objects = helm.objects(CHART, values, release=RELEASE, namespace=NAMESPACE)
    helm_apply(cluster, merge(values, {"nodeSelector": NO_NODE}))
    wait_no_driver_pod(cluster)
    return objects


def token(cluster, account: str, node: str, seconds: int = 7200) -> str:
    """A token of the chart's ServiceAccount bound to the node (TokenRequest with a Node
    bound object): it carries the node name the own-node-slices policy checks, as a
    DaemonSet pod's token does (that one is bound to the pod, which is bound to the node)."""
    p = cluster.kubectl("create", "token", account, "-n", NAMESPACE, "--bound-object-kind", "Node",
                        "--bound-object-name", node, "--duration", f"{seconds}s")
    return p.stdout.strip()


@dataclass
class HostDriver:
    """`dra-driver run` as a host process with the DaemonSet's settings."""
    cluster: object
    objects: list[dict]
    workdir: Path
    node: str
    extra_env: dict[str, str] = field(default_factory=dict)
    # True: the node's driver state (checkpoint, the mock node's tree) is removed first, as
    # on a node just set up; a test that changes the mock profile sees new hardware then
    fresh_node: bool = False
    pod_uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def env(self) -> dict[str, str]:
        c = self.cluster
        env = daemonset_env(self.objects)
        kubelet = c.kubelet_dir
        paths = {  # the DaemonSet's hostPath mounts, mapped to this kubelet's --root-dir
            "KUBELET_REGISTRAR_DIR": str(kubelet / "plugins_registry"),
            "KUBELET_PLUGINS_DIR": str(kubelet / "plugins"),
            "STATE_DIR": str(kubelet / "plugins" / DRIVER),
            "CDI_ROOT": str(c.cdi_dir),
        }
        for k in paths:
            assert k in env, f"the chart no longer sets {k}"
        env.update(paths)
        tokfile = self.workdir / "token"
        tokfile.write_text(token(c, service_account(self.objects), self.node))
        kubeconfig = self.workdir / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": c.server,
                                                   "certificate-authority": str(c.pki / "ca.crt")}}],
            "users": [{"name": "u", "user": {"tokenFile": str(tokfile)}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        }))
        env.update({
            "NODE_NAME": self.node, "POD_UID": self.pod_uid, "POD_NAMESPACE": NAMESPACE,
            "KUBECONFIG": str(kubeconfig), "METRICS_PORT": "0", "HEALTHZ_PORT": "0",
            "LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def start(self) -> "HostDriver":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.fresh_node:
            shutil.rmtree(self.cluster.kubelet_dir / "plugins" / DRIVER, ignore_errors=True)
        for d in ("plugins_registry", "plugins"):
            (self.cluster.kubelet_dir / d).mkdir(parents=True, exist_ok=True)
        self.cluster.cdi_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(self.cluster.logs.glob("driver-*.log")))
        self.log_path = self.cluster.logs / f"driver-{n}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "driver", "run"], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env()}, cwd=REPO)
        return self

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 90) -> None:
        """Slices published and the kubelet's registration done: a pod bound before the
        kubelet knows the driver fails its first prepare ("DRA driver ... is not registered")
        and waits out the kubelet's back-off."""
        self.wait_log("slices_in_sync", timeout)
        self.wait_log("kubelet_registration_succeeded", 30)

    def wait_log(self, needle: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log():
                return
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"driver exited ({self.proc.returncode}) before {needle!r}:\n{self.log()[-4000:]}")
            time.sleep(0.3)
        raise AssertionError(f"no {needle!r} in the driver's log after {timeout}s:\n{self.log()[-4000:]}")


def explain(cluster, *args: str) -> tuple[int, dict]:
    """`dra-driver explain … -o json` reading the live cluster as its admin; (exit, output)."""
    p = subprocess.run([sys.executable, "-m", "driver", "explain", *args, "--kubeconfig",
                        str(cluster.admin_kubeconfig), "-o", "json"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    # exit 1 is "fits nowhere", but also an uncaught exception's: no output says which
    assert p.returncode in (0, 1) and p.stdout.strip(), f"explain {args}: {p.returncode}\n{p.stderr}"
    return p.returncode, json.loads(p.stdout)
