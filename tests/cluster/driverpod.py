"""The driver on the local cluster as users run it: the chart installed with the real
`helm` CLI (`helm upgrade --install`, build.sh builds it) into its own namespace, labelled
with the Pod Security level the chart's README tells users to set, the DaemonSet's pod
running the driver's image (image.sh, imported by Cluster.import_driver_image and tagged
with this checkout's version) in the chart's mock mode (`mock.enabled`, "for CI and
laptops").

Ready is judged from three sides, not from the driver's own word: the DaemonSet's pod is
Ready; the kubelet's plugin manager lists this pod's registration socket in its actual
state of the world (its `plugin_manager_total_plugins` metric names the socket path, which
carries the pod's UID); and the API server's audit log has ResourceSlice writes by the
driver's service account from this pod (`authentication.kubernetes.io/pod-name`).

    drv = PodDriver(cluster, image).install(profile="mixed", values={...})
    drv.pod, drv.log(), drv.wait_log("claim_prepared"), drv.upgrade({...}), drv.uninstall()
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field

from tests.cluster.driverhost import DRIVER, NAMESPACE, RELEASE, service_account
from tests.helm_cli import Helm
from tests.test_chart import CHART

# What the chart's README tells users to label the release namespace with: the driver and
# the MPS control daemons are privileged and use host paths.
POD_SECURITY = {"pod-security.kubernetes.io/enforce": "privileged"}
# The DaemonSet's selector labels; the MPS control daemon pods share the name label and
# carry a component label, the driver's pods none.
SELECTOR = "app.kubernetes.io/name=dra-accel-driver,app.kubernetes.io/instance=dra,!app.kubernetes.io/component"
# A nodeSelector that no node has: the DaemonSet stays at 0 pods, so that a test running
# the driver as a host process has the chart's other objects from the same helm release
# and never a driver pod beside it.
NO_NODE = {"dra.accel.io/tier-host-process": "no-node-has-this"}


class PodDriverError(AssertionError):
    """The chart's pod did not get where a test needs it; the message has the pod's
    status, events and log."""


def merge(base: dict, extra: dict) -> dict:
    """Chart values as `-f a -f b` combines them: maps merged key by key, the rest replaced."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def chart_values(cluster, image: str, profile: str = "mixed", values: dict | None = None) -> dict:
    """The values a user of this cluster would pass: the image, mock mode, and the paths
    where this node's kubelet, CDI folder and runtime's network namespaces are."""
    repository, _, tag = image.rpartition(":")
    base = {
        "image": {"repository": repository, "tag": tag},
        "mock": {"enabled": True, "profile": profile},
        "deviceClasses": {"apiVersion": "resource.k8s.io/v1"},
        "kubelet": {"rootDir": str(cluster.kubelet_dir)},
        "cdiRoot": str(cluster.cdi_dir),
        # containerd runs with netns_mounts_under_state_dir (cluster.py): its pods'
        # namespaces are there; /var/run/netns holds the mock's own.
        "nri": {"netnsDirs": ["/var/run/netns", str(cluster.netns_dir)]},
    }
    return merge(base, values or {})


def helm(cluster) -> Helm:
    h = Helm(cluster.helm, cluster.root / "helm")
    h.home.mkdir(parents=True, exist_ok=True)
    return h


def helm_apply(cluster, values: dict, timeout: float = 120) -> None:
    """`helm upgrade --install` of the release into the labelled namespace, as a user runs
    it (the namespace made and labelled first, as the chart's README says)."""
    ns = cluster.kubectl("get", "namespace", NAMESPACE, check=False)
    if ns.returncode:
        cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("label", "namespace", NAMESPACE, "--overwrite",
                    *(f"{k}={v}" for k, v in POD_SECURITY.items()))
    classes = values.get("deviceClasses") or {}
    if cluster.resource_version != "v1" and classes.get("apiVersion") == "resource.k8s.io/v1":
        # a release without v1 (1.32, 1.33): installed as its users install it, the chart
        # choosing the version the cluster serves
        values = {**values, "deviceClasses": {k: v for k, v in classes.items() if k != "apiVersion"}}
    h = helm(cluster)
    h.run("upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE,
          "--kubeconfig", str(cluster.admin_kubeconfig), "-f", str(h.values_file(values)),
          "--timeout", f"{int(timeout)}s")


def driver_pods(cluster) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", NAMESPACE, "-l", SELECTOR, "-o", "json").stdout
    return json.loads(out)["items"]


def wait_no_driver_pod(cluster, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while driver_pods(cluster):
        if time.monotonic() > deadline:
            raise PodDriverError(f"driver pods still there after {timeout}s: "
                                 f"{[p['metadata']['name'] for p in driver_pods(cluster)]}")
        time.sleep(1)


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


@dataclass
class PodDriver:
    """The chart's DaemonSet pod on the node, installed and changed through helm."""
    cluster: object
    image: str
    profile: str = "mixed"
    values: dict = field(default_factory=dict)  # chart values beyond chart_values()
    pod: str | None = None  # the serving pod's name once ready
    uid: str | None = None
    # the audit log's length when this pod was asked for, so that its checks read only
    # what came after
    _audit_from: int = 0
    _account: str | None = None

    # --- install / change / remove -----------------------------------------------------
    def all_values(self) -> dict:
        return chart_values(self.cluster, self.image, self.profile, self.values)

    def install(self, profile: str | None = None, values: dict | None = None,
                fresh_node: bool = True, timeout: float = 120,
                slices_written: bool = True) -> "PodDriver":
        """The release with this config and a new pod: the old pod (if any) stops first
        and, with fresh_node, the node's driver state (checkpoint, mock tree) is removed, as
        on a node just set up; so two pods with different mock nodes never share it.
        slices_written=False (with fresh_node=False): the node's slices are still there
        and equal, so the new pod writes none (a reinstall after `helm uninstall`)."""
        self.pod = self.uid = None  # until the new one is ready
        if profile is not None:
            self.profile = profile
        if values is not None:
            self.values = values
        if driver_pods(self.cluster):
            helm_apply(self.cluster, merge(self.all_values(), {"nodeSelector": NO_NODE}))
            wait_no_driver_pod(self.cluster)
        if fresh_node:
            shutil.rmtree(self.cluster.kubelet_dir / "plugins" / DRIVER, ignore_errors=True)
            # and no slices of an earlier instance: the new pod must write them (the
            # audit check below), not find an equal set and write nothing
            self.cluster.kubectl("delete", "resourceslices", "--field-selector",
                                 f"spec.driver={DRIVER},spec.nodeName={self._node()}", "--wait=true")
        self._audit_from = self._audit_size()
        helm_apply(self.cluster, self.all_values())
        return self.wait_ready(timeout, slices_written=slices_written)

    def upgrade(self, values: dict | None = None, timeout: float = 180,
                slices_written: bool = True) -> "PodDriver":
        """`helm upgrade` with these values (merged over the current ones), the chart's
        update strategy doing the rest; waits until the new pod serves and the old one is
        gone. slices_written=False: the inventory is unchanged, so the new pod must find
        the slices as they are and write none (tests/cluster/test_driver_pod.py counts)."""
        old = self.uid
        if values:
            self.values = merge(self.values, values)
        self._audit_from = self._audit_size()
        helm_apply(self.cluster, self.all_values())
        return self.wait_ready(timeout, not_uid=old, slices_written=slices_written)

    def rollback(self, values: dict, timeout: float = 180, slices_written: bool = True) -> "PodDriver":
        """`helm rollback` to the previous revision, whose values the caller names (they
        become this driver's again); waits as upgrade() does."""
        old = self.uid
        self._audit_from = self._audit_size()
        helm(self.cluster).run("rollback", RELEASE, "--namespace", NAMESPACE,
                               "--kubeconfig", str(self.cluster.admin_kubeconfig),
                               "--timeout", f"{int(timeout)}s")
        self.values = values
        return self.wait_ready(timeout, not_uid=old, slices_written=slices_written)

    def uninstall(self, timeout: float = 90) -> None:
        """`helm uninstall`; waits until the driver pod is gone."""
        helm(self.cluster).run("uninstall", RELEASE, "--namespace", NAMESPACE,
                               "--kubeconfig", str(self.cluster.admin_kubeconfig), "--wait",
                               "--timeout", f"{int(timeout)}s")
        wait_no_driver_pod(self.cluster, timeout)
        self.pod = self.uid = None

    # --- ready ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 120, not_uid: str | None = None,
                   slices_written: bool = True) -> "PodDriver":
        """One pod of the current revision, Ready, alone (an old one gone); registered
        with the kubelet and (unless slices_written is False: a pod taking over an
        unchanged inventory writes none) its slices written, each seen from the kubelet's
        and the API server's side."""
        deadline = time.monotonic() + timeout
        pod: dict | None = None
        while True:
            ds = json.loads(self.cluster.kubectl("get", "daemonset", "-n", NAMESPACE, "-l", SELECTOR,
                                                 "-o", "json").stdout)["items"]
            pods = driver_pods(self.cluster)
            if len(ds) == 1 and len(pods) == 1:
                st, pod = ds[0].get("status", {}), pods[0]
                if (st.get("observedGeneration") == ds[0]["metadata"]["generation"]
                        and st.get("updatedNumberScheduled") == st.get("desiredNumberScheduled") == 1
                        and _ready(pod) and pod["metadata"]["uid"] != not_uid
                        and not pod["metadata"].get("deletionTimestamp")):
                    break
            elif pods:
                pod = pods[-1]
            if time.monotonic() > deadline:
                raise PodDriverError(f"the driver's DaemonSet pod is not Ready alone after {timeout}s\n"
                                     + self.describe(pod))
            time.sleep(1)
        self.pod, self.uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        self._wait_for(self.registered, lambda: "the kubelet's plugin manager has no registration socket of "
                       f"pod UID {self.uid} (metric plugin_manager_total_plugins: {self.registrations()})", deadline)
        if slices_written:
            self._wait_for(lambda: bool(self.slice_writes()), "no ResourceSlice write by this pod in the "
                           "API server's audit log", deadline)
        return self

    def _wait_for(self, check, what, deadline: float) -> None:
        while not check():
            if time.monotonic() > deadline:
                raise PodDriverError(f"{what() if callable(what) else what}\n" + self.describe())
            time.sleep(1)

    def registrations(self) -> dict[str, float]:
        """The kubelet's own view: registration socket path -> count, of the sockets its
        plugin manager has registered (actual state of the world), from its /metrics."""
        p = self.cluster.kubectl("get", "--raw", f"/api/v1/nodes/{self._node()}/proxy/metrics", check=False)
        out = {}
        for line in p.stdout.splitlines():
            if line.startswith("plugin_manager_total_plugins{") and 'state="actual_state_of_world"' in line:
                labels, value = line.rsplit(" ", 1)
                path = labels.split('socket_path="', 1)[1].split('"', 1)[0]
                out[path] = float(value)
        return out

    def registered(self) -> bool:
        """This pod's registration socket is one the kubelet registered: its name carries
        the pod's UID (or the hash of it, driver/kubelet/sockets.py)."""
        from driver.kubelet.sockets import registration_candidates

        registry = self.cluster.kubelet_dir / "plugins_registry"
        # without seamless upgrades (the chart on a cluster before 1.33) the pod gets no
        # POD_UID and its socket has the driver's fixed name
        pod = json.loads(self.cluster.kubectl("get", "pod", "-n", NAMESPACE, self.pod, "-o", "json").stdout)
        seamless = any(e.get("name") == "POD_UID" for c in pod["spec"]["containers"] for e in c.get("env") or [])
        mine = {str(p) for p in registration_candidates(registry, DRIVER, self.uid if seamless else None)}
        return any(path in mine and n > 0 for path, n in self.registrations().items())

    def slice_writes(self, since: int | None = None) -> list[dict]:
        """Audit events of ResourceSlice writes made from this pod (its service account's
        token, bound to this pod)."""
        account = f"system:serviceaccount:{NAMESPACE}:{self._service_account()}"
        out = []
        for ev in self.cluster.audit(account)[self._audit_from if since is None else since:]:
            ref = ev.get("objectRef", {})
            extra = ev.get("user", {}).get("extra", {})
            if (ref.get("resource") == "resourceslices" and ev.get("verb") in ("create", "update", "patch")
                    and ev.get("stage", "ResponseComplete") == "ResponseComplete"
                    and self.pod in extra.get("authentication.kubernetes.io/pod-name", [])
                    and ev.get("responseStatus", {}).get("code", 0) < 300):
                out.append(ev)
        return out

    def _audit_size(self) -> int:
        account = f"system:serviceaccount:{NAMESPACE}:{self._service_account()}"
        return len(self.cluster.audit(account))

    def _service_account(self) -> str:
        # the chart's ServiceAccount, as the release names it (rendered once: the wait
        # loops ask every second)
        if self._account is None:
            self._account = service_account(helm(self.cluster).objects(
                CHART, self.all_values(), release=RELEASE, namespace=NAMESPACE))
        return self._account

    def _node(self) -> str:
        import local_cluster

        return local_cluster.NODE

    # --- logs ------------------------------------------------------------------------------
    def log(self, previous: bool = False) -> str:
        if not self.pod:
            return ""
        args = ["logs", "-n", NAMESPACE, self.pod, "-c", "plugin"] + (["--previous"] if previous else [])
        return self.cluster.kubectl(*args, check=False).stdout

    def wait_log(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if needle in text:
                return text
            if time.monotonic() > deadline:
                raise PodDriverError(f"no {needle!r} in the driver pod's log after {timeout}s\n" + self.describe())
            time.sleep(0.5)

    def env(self) -> dict[str, str]:
        """The plugin container's environment as the live pod has it (plain values)."""
        pod = json.loads(self.cluster.kubectl("get", "pod", "-n", NAMESPACE, self.pod, "-o", "json").stdout)
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "plugin"]
        return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}

    def restarts(self) -> int:
        p = self.cluster.kubectl("get", "pod", "-n", NAMESPACE, self.pod, "-o", "json", check=False)
        if p.returncode:
            return 0
        return sum(c.get("restartCount", 0) for c in json.loads(p.stdout)["status"].get("containerStatuses", []))

    def describe(self, pod: dict | None = None) -> str:
        """The pods' status, the namespace's events and the pod's log, for a failure message."""
        pods = driver_pods(self.cluster)
        lines = [f"driver pods: {[(p['metadata']['name'], p.get('status', {}).get('phase')) for p in pods]}"]
        for p in pods or ([pod] if pod else []):
            lines.append(f"--- {p['metadata']['name']} status:\n{json.dumps(p.get('status'), indent=1)[-3000:]}")
            logs = self.cluster.kubectl("logs", "-n", NAMESPACE, p["metadata"]["name"], "-c", "plugin",
                                        "--tail", "40", check=False)
            lines.append(f"--- its log (last 40 lines):\n{logs.stdout}{logs.stderr}")
        ev = self.cluster.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)
        lines.append(f"--- events in {NAMESPACE}:\n{ev.stdout[-3000:]}")
        ds = self.cluster.kubectl("get", "daemonset", "-n", NAMESPACE, "-o", "wide", check=False)
        lines.append(f"--- daemonset:\n{ds.stdout}")
        return "\n".join(lines)

    # --- claims ----------------------------------------------------------------------------
    def claims_in(self, ns: str) -> tuple[set[str], set[str]]:
        """(uids prepared, uids unprepared) of the claims of namespace ns, from the log."""
        prepared, unprepared = set(), set()
        for line in self.log().splitlines():
            if f'"{ns}"' not in line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("claim_namespace") != ns:
                continue
            if ev.get("event") == "claim_prepared":
                prepared.add(ev.get("claim_uid"))
            elif ev.get("event") == "claim_unprepared":
                unprepared.add(ev.get("claim_uid"))
        return prepared, unprepared

    def wait_unprepared(self, ns: str, timeout: float = 60) -> None:
        """Every claim of ns that this pod prepared is unprepared again (before the pod's
        config changes: a claim left to a replaced pod hangs its namespace's deletion)."""
        deadline = time.monotonic() + timeout
        while True:
            prepared, unprepared = self.claims_in(ns)
            if prepared <= unprepared:
                return
            if time.monotonic() > deadline:
                raise PodDriverError(f"claims of {ns} still prepared after {timeout}s: {prepared - unprepared}")
            time.sleep(1)


def image_name() -> str:
    """The driver image the tier builds, as cluster.py tags it (this checkout's version)."""
    import local_cluster

    return local_cluster.DRIVER_IMAGE


__all__ = ["PodDriver", "PodDriverError", "chart_values", "helm_apply", "driver_pods",
           "wait_no_driver_pod", "NO_NODE", "POD_SECURITY", "merge", "image_name"]
