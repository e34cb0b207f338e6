#!/usr/bin/env python3
"""A single-node Kubernetes cluster of upstream components on this machine, no Docker.

    python3 hack/local-cluster/cluster.py up      (or hack/local-cluster/up)
    python3 hack/local-cluster/cluster.py down    (or hack/local-cluster/down)
    python3 hack/local-cluster/cluster.py env     prints KUBECONFIG=... for a shell

What runs, all built by build.sh at the versions in versions.env, all on 127.0.0.1:
etcd (embedded in the multi-call binary), kube-apiserver (Node,RBAC authorizers;
NodeRestriction and the default admission plugins, ValidatingAdmissionPolicy among them),
kube-controller-manager, kube-scheduler, containerd with runc, CNI bridge/host-local, and
the kubelet (cgroupfs driver; on a cgroup v1 host with failCgroupV1: false). Certificates
are made here with `cryptography`. Everything lives in one state folder (default
/var/lib/dra-local-cluster, env DRA_LOCAL_CLUSTER_DIR), the logs of every component in its
logs/ folder. One cluster per machine: the kubelet owns host-wide things (its cgroup root,
the bridge, kernel sysctls it sets as on any node), so `up` takes a lock the `down` frees.

Needs root. The tests (tests/cluster/) use the Cluster class directly.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import hashlib
import io
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NODE = "lc-node"
DEFAULT_DIR = Path(os.environ.get("DRA_LOCAL_CLUSTER_DIR", "/var/lib/dra-local-cluster"))
# The kubelet's cgroup root (cgroupfs driver): pods go under <root>/kubepods in every v1
# hierarchy, not under the host's /kubepods.
CGROUP_ROOT = "dra-local-cluster"
BRIDGE = "lc-cni0"
POD_CIDR = "10.88.0.0/24"
# The node's address: the pod bridge's gateway address, local to this machine. The kubelet
# refuses a loopback node IP ("nodeIP can't be loopback address", and then publishes no
# address, so the API server cannot reach it for `kubectl logs`), and this kernel has no
# dummy interfaces; the bridge is made by `up` before the CNI plugin would make it.
NODE_IP = "10.88.0.1"
SERVICE_CIDR = "10.96.0.0/24"
# Images for the workloads, built here from busybox-static (no registry): the sandbox
# ("pause") image and the examples' busybox.
PAUSE_IMAGE = "localhost/dra-local-cluster/pause:busybox"
BUSYBOX_IMAGES = ["docker.io/library/busybox:1.36", "localhost/dra-local-cluster/busybox:latest"]
# Stand-ins: the same busybox image under the names of the vendor images that examples/
# use with plain `sh -c` commands (env, ls of device nodes, the mock's nvidia-smi that the
# CDI spec mounts). Their contents are NOT the vendors' images; what the examples test is
# allocation, preparation and CDI injection, which does not depend on the image.
STAND_IN_IMAGES = ["docker.io/xilinx/xilinx_runtime_base:alveo-2023.2-ubuntu-22.04"]
# NVIDIA's images under the same terms, with their environment: they put
# /usr/local/nvidia/bin on PATH and /usr/local/nvidia/lib{,64} on LD_LIBRARY_PATH, where
# the driver's CDI specs mount nvidia-smi and the libraries (driver/devices/nvlibs.py), so
# `nvidia-smi -L` in an example runs the node's (here the mock's) nvidia-smi.
NVIDIA_STAND_IN_IMAGES = ["nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
                          # gpu-nic-aligned runs `sh -c "env | grep ^DRA_; ls /dev/infiniband"`
                          # in it; the examples that run `python -c "import torch…"` in it
                          # cannot use a stand-in
                          "nvcr.io/nvidia/pytorch:24.05-py3",
                          # gpu-shared's first container: `sh -c "nvidia-smi -L; sleep infinity"`
                          "nvcr.io/nvidia/tritonserver:24.05-py3"]
NVIDIA_ENV = ["PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
              # What every CUDA image sets; nvidia-container-runtime injects every GPU of
              # the node for it unless a CDI spec says `void` (tests/cluster/test_nvidia_runtime.py).
              "NVIDIA_VISIBLE_DEVICES=all"]
# The runtime handler `nvidia`: NVIDIA's nvidia-container-runtime (build.sh nvidia-toolkit)
# in CDI mode over our runc, as the GPU operator configures containerd on a GPU node.
NVIDIA_RUNTIME_HANDLER = "nvidia"
# The beta DRA features the driver uses, on explicitly (on by default in 1.37; alpha in
# 1.34). The GA ones (DynamicResourceAllocation, DRAResourceClaimDeviceStatus, ...) are on
# by default and locked.
FEATURE_GATES = {
    "DRAConsumableCapacity": True,
    "DRAPartitionableDevices": True,
    "DRADeviceTaints": True,
    "DRADeviceBindingConditions": True,
    # KEP-4680: the kubelet puts our DRAResourceHealth stream into the pod's
    # allocatedResourcesStatus (beta and on by default from 1.36, alpha in 1.34)
    "ResourceHealthStatus": True,
}
# DRA_LOCAL_CLUSTER_FEATURE_GATES="A=false,B=true" overrides some, for every component (to
# see a test fail when a gate it relies on is off, or to try an alpha one).
for _kv in filter(None, os.environ.get("DRA_LOCAL_CLUSTER_FEATURE_GATES", "").split(",")):
    _k, _, _v = _kv.partition("=")
    FEATURE_GATES[_k.strip()] = _v.strip().lower() == "true"


def versions() -> dict[str, str]:
    """versions.env as the shell reads it (the environment may override each)."""
    out = subprocess.run(
        ["bash", "-c", f"set -a; . {HERE / 'versions.env'}; env -0"], check=True,
        capture_output=True, text=True).stdout
    env = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
    return {k: env[k] for k in ("KUBERNETES_VERSION", "CONTAINERD_VERSION", "RUNC_VERSION",
                                "CNI_PLUGINS_VERSION", "NVIDIA_CONTAINER_TOOLKIT_VERSION", "HELM_VERSION")}


def minor(version: str) -> int:
    return int(version.lstrip("v").split(".")[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterError(Exception):
    pass


# --- certificates -----------------------------------------------------------------------

def _pki(pki: Path) -> None:
    """CA, API server serving cert, client certs per component, service account key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    later = now + datetime.timedelta(days=30)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def write(name: str, cert, key) -> None:
        (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (pki / f"{name}.key").write_bytes(key_pem(key))
        os.chmod(pki / f"{name}.key", 0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dra-local-cluster-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(later)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                         critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca, ca_key)

    def issue(name: str, cn: str, orgs: list[str] = (), server: bool = False,
              sans: list = ()) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        subject = x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(later)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False),
                            critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                            critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        write(name, b.sign(ca_key, hashes.SHA256()), key)

    service_ip = next(ipaddress.ip_network(SERVICE_CIDR).hosts())
    issue("apiserver", "kube-apiserver", server=True, sans=[
        x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"), x509.DNSName("kubernetes.default.svc.cluster.local"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(service_ip)])
    issue("admin", "kubernetes-admin", ["system:masters"])
    issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"])
    issue("controller-manager", "system:kube-controller-manager")
    issue("scheduler", "system:kube-scheduler")
    issue("kubelet", f"system:node:{NODE}", ["system:nodes"])
    sa = ec.generate_private_key(ec.SECP256R1())
    (pki / "sa.key").write_bytes(key_pem(sa))
    os.chmod(pki / "sa.key", 0o600)
    (pki / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def kubeconfig(path: Path, server: str, ca: Path, user: dict) -> Path:
    doc = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(doc, indent=1))
    os.chmod(path, 0o600)
    return path


# --- the workload images ----------------------------------------------------------------

def oci_archive(path: Path, names: list[str], entrypoint: list[str] | None, cmd: list[str],
                env: list[str] | None = None) -> Path:
    """An OCI image layout tarball with one layer: Debian's busybox-static as /bin/busybox
    and a symlink per applet in /bin, plus the folders a container expects."""
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        raise ClusterError("/bin/busybox missing: apt-get install busybox-static")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        def add_dir(name: str, mode: int = 0o755) -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, mode, 0
            t.addfile(ti)
        for d in ("bin", "dev", "etc", "proc", "sys", "var", "var/run", "root", "usr", "usr/bin"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        data = busybox.read_bytes()
        ti = tarfile.TarInfo("bin/busybox")
        ti.size, ti.mode, ti.mtime = len(data), 0o755, 0
        t.addfile(ti, io.BytesIO(data))
        for applet in sorted(set(applets) - {"busybox"}):
            ti = tarfile.TarInfo(f"bin/{applet}")
            ti.type, ti.linkname, ti.mtime = tarfile.SYMTYPE, "busybox", 0
            t.addfile(ti)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"),
                           ("etc/group", "root:x:0:\nnobody:x:65534:\n")):
            b = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(b), 0o644, 0
            t.addfile(ti, io.BytesIO(b))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": env or ["PATH=/bin:/usr/bin"], "Cmd": cmd,
                   **({"Entrypoint": entrypoint} if entrypoint else {})},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media, "digest": digest, "size": len(data)}

    cfg_desc = blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    layer_desc = blob(layer_bytes, "application/vnd.oci.image.layer.v1.tar")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cfg_desc, "layers": [layer_desc]}
    man_desc = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [dict(man_desc, annotations={"io.containerd.image.name": n,
                                                        "org.opencontainers.image.ref.name": n})
                           for n in names]}
    with tarfile.open(path, "w") as t:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            t.addfile(ti, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.split(':')[1]}", data)
    return path


# The driver's own image (hack/local-cluster/image.sh: debootstrap + /opt/dra + this
# checkout's package), for pods that run our code: the MPS control daemon. Not latest, so
# that the kubelet never tries to pull it (IfNotPresent).
DRIVER_IMAGE = "localhost/dra-local-cluster/dra-accel-driver:local"
IMAGE_CACHE = Path(os.environ.get("DRA_LOCAL_CLUSTER_CACHE", str(Path.home() / ".cache" / "dra-local-cluster"))) / "driver-image"


def driver_image_archive(cache: Path = IMAGE_CACHE) -> Path:
    """The OCI archive of the driver's image, assembled from image.sh's two layer tars
    (kept beside them until a layer changes)."""
    layers = [cache / "base.tar", cache / "top.tar"]
    stamps = [cache / "base.stamp", cache / "top.stamp"]
    if not all(p.exists() for p in layers + stamps):
        raise ClusterError(f"the driver image is not built ({cache} has no layers): "
                           "run hack/local-cluster/build.sh image")
    stamp = "-".join(p.read_text().strip() for p in stamps)
    archive = cache / "image.oci.tar"
    if archive.exists() and (cache / "image.stamp").exists() and (cache / "image.stamp").read_text() == stamp:
        return archive

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return "sha256:" + h.hexdigest()

    diff_ids = [digest(p) for p in layers]
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/opt/dra/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                           "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"],
                   "Entrypoint": ["dra-driver"], "Cmd": ["run"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    small: dict[str, bytes] = {}

    def blob(data: bytes, media: str) -> dict:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        small[d] = data
        return {"mediaType": media, "digest": d, "size": len(data)}

    cfg = blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cfg,
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                            "size": p.stat().st_size} for d, p in zip(diff_ids, layers)]}
    man = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [dict(man, annotations={"io.containerd.image.name": DRIVER_IMAGE,
                                                   "org.opencontainers.image.ref.name": DRIVER_IMAGE})]}
    tmp = archive.with_suffix(".new")
    with tarfile.open(tmp, "w") as t:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            t.addfile(ti, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for d, data in small.items():
            add(f"blobs/sha256/{d.split(':')[1]}", data)
        for d, p in zip(diff_ids, layers):
            t.add(str(p), arcname=f"blobs/sha256/{d.split(':')[1]}")
    tmp.rename(archive)
    (cache / "image.stamp").write_text(stamp)
    return archive


# Our sandbox ("pause") image: busybox's sh as PID 1, exiting on SIGTERM/SIGINT (PID 1 has
# no default handlers) and reaping nothing else (the pod's containers have their own PID
# namespaces, as with the upstream pause image).
PAUSE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


# Every request by a service account of the driver's namespace: the metadata (who, verb,
# resource, answer) and, for ResourceSlices, the body as sent (the tests compare it with
# what the API server stored). Nothing else (the components' own traffic would drown it).
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Request
    userGroups: ["system:serviceaccounts:dra-system"]
    resources: [{group: resource.k8s.io, resources: [resourceslices]}]
  - level: Metadata
    userGroups: ["system:serviceaccounts:dra-system"]
  - level: None
"""


# --- the cluster ------------------------------------------------------------------------

@dataclass
class Cluster:
    root: Path = DEFAULT_DIR
    vers: dict[str, str] = field(default_factory=versions)
    ports: dict[str, int] = field(default_factory=dict)
    _lock_fd: int | None = None

    # paths
    @property
    def k8s_bin(self) -> Path:
        return HERE / "bin" / self.vers["KUBERNETES_VERSION"]

    @property
    def containerd_bin(self) -> Path:
        return HERE / "bin" / f"containerd-{self.vers['CONTAINERD_VERSION']}"

    @property
    def runc(self) -> Path:
        return HERE / "bin" / f"runc-{self.vers['RUNC_VERSION']}" / "runc"

    @property
    def cni_bin(self) -> Path:
        return HERE / "bin" / f"cni-{self.vers['CNI_PLUGINS_VERSION']}"

    @property
    def nvidia_toolkit_bin(self) -> Path:
        return HERE / "bin" / f"nvidia-container-toolkit-{self.vers['NVIDIA_CONTAINER_TOOLKIT_VERSION']}"

    @property
    def helm(self) -> Path:
        """The helm CLI (build.sh helm) that renders the chart for the tier."""
        return HERE / "bin" / f"helm-{self.vers['HELM_VERSION']}" / "helm"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def containerd_sock(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def load(self) -> "Cluster":
        """The ports of a running cluster (`up` wrote them)."""
        state = json.loads((self.root / "cluster.json").read_text())
        self.ports = state["ports"]
        return self

    # processes
    def _start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            log.write(f"== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=dict(os.environ, **(env or {})))
        (self.root / "pids").mkdir(exist_ok=True)
        (self.root / "pids" / name).write_text(str(proc.pid))
        return proc

    def _alive(self, name: str) -> bool:
        try:
            pid = int((self.root / "pids" / name).read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        # a zombie of ours counts as dead
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    def _wait(self, what: str, check, timeout: float, proc_name: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except Exception as e:  # noqa: BLE001 - reported on timeout
                last = e
            if proc_name and not self._alive(proc_name):
                raise ClusterError(f"{proc_name} exited while waiting for {what}; "
                                   f"last lines of its log:\n{self.tail(proc_name)}")
            time.sleep(0.5)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last}); "
                           f"log:\n{self.tail(proc_name) if proc_name else ''}")

    def note(self, what: str) -> None:
        """A line in logs/cluster.log: what up/down did when (where the time goes)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / "cluster.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {what}\n")

    def tail(self, name: str, lines: int = 40) -> str:
        p = self.logs / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else "(no log)"

    # API access as the cluster admin
    def ssl_context(self, cert: str | None = "admin") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if cert:
            ctx.load_cert_chain(str(self.pki / f"{cert}.crt"), str(self.pki / f"{cert}.key"))
        return ctx

    def audit(self, user_prefix: str = "system:serviceaccount:dra-system:") -> list[dict]:
        """The audit events of the users whose name starts with user_prefix."""
        path = self.logs / "audit.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("user", {}).get("username", "").startswith(user_prefix):
                out.append(ev)
        return out

    def api(self, method: str, path: str, body: object = None, *, token: str | None = None,
            content_type: str = "application/json", timeout: float = 30) -> tuple[int, dict]:
        """One request as the admin (client certificate) or with a bearer token; returns
        (status, decoded body) and never raises on an HTTP error status."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        ctx = self.ssl_context(None if token else "admin")
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw.strip().startswith(b"{") else {"raw": raw.decode()})
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        p = subprocess.run([str(self.k8s_bin / "kubectl"), "--kubeconfig", str(self.admin_kubeconfig), *args],
                           input=input, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n{p.stderr}{p.stdout}")
        return p

    # up / down
    def lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root.parent / f".{self.root.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ClusterError(f"another local cluster in {self.root} is in use (lock held); "
                               "`hack/local-cluster/down` stops it")
        self._lock_fd = fd

    def check_built(self) -> None:
        need = [self.k8s_bin / "k8s", self.containerd_bin / "containerd",
                self.containerd_bin / "containerd-shim-runc-v2", self.containerd_bin / "ctr",
                self.runc, self.cni_bin / "bridge", self.cni_bin / "host-local", self.cni_bin / "loopback"]
        missing = [str(p) for p in need if not p.exists()]
        if missing:
            raise ClusterError("not built (run hack/local-cluster/build.sh): " + ", ".join(missing))

    def up(self, timeout: float = 180) -> "Cluster":
        if os.geteuid() != 0:
            raise ClusterError("the local cluster needs root (kubelet, containerd, mounts, cgroups)")
        self.check_built()
        t0 = time.monotonic()
        self.lock()
        self.down(release=False)  # whatever a killed run left
        if self.logs.exists():  # the last run's logs stay one run longer
            shutil.rmtree(self.root / "logs-previous", ignore_errors=True)
            self.logs.rename(self.root / "logs-previous")
        for d in ("logs", "pids", "etcd", "cdi", "kubelet", "containerd", "cni/net.d", "manifests"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        _pki(self.pki)
        self.ports = {n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "kubelet")}
        (self.root / "cluster.json").write_text(json.dumps({"ports": self.ports, "versions": self.vers,
                                                            "node": NODE}, indent=1))
        ca = self.pki / "ca.crt"
        kc = lambda n: kubeconfig(self.root / f"{n}.kubeconfig", self.server, ca,  # noqa: E731
                                  {"client-certificate": str(self.pki / f"{n}.crt"),
                                   "client-key": str(self.pki / f"{n}.key")})
        for n in ("admin", "controller-manager", "scheduler", "kubelet"):
            kc(n)
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        k8s = str(self.k8s_bin / "k8s")

        # etcd
        self._start("etcd", [k8s, "etcd", "--data-dir", str(self.root / "etcd"),
                             "--listen-client-url", f"http://127.0.0.1:{self.ports['etcd']}",
                             "--listen-peer-url", f"http://127.0.0.1:{self.ports['etcd-peer']}"])
        self.note("started etcd")
        self._wait("etcd", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{self.ports['etcd']}/health", timeout=2).status == 200, 60, "etcd")

        # kube-apiserver, with an audit log of what service accounts and nodes do (the tests
        # read every API call the driver made from it: verbs, resources, answers)
        audit_policy = self.root / "audit-policy.yaml"
        audit_policy.write_text(AUDIT_POLICY)
        runtime_config = []
        if minor(self.vers["KUBERNETES_VERSION"]) < 36:
            # 1.34/1.35: DeviceTaintRule is served in resource.k8s.io/v1alpha3 only.
            runtime_config = ["--runtime-config=resource.k8s.io/v1alpha3=true,resource.k8s.io/v1beta2=true"]
        self._start("kube-apiserver", [
            k8s, "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--tls-cert-file={self.pki / 'apiserver.crt'}", f"--tls-private-key-file={self.pki / 'apiserver.key'}",
            f"--client-ca-file={ca}",
            f"--kubelet-client-certificate={self.pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={self.pki / 'apiserver-kubelet-client.key'}",
            f"--service-account-key-file={self.pki / 'sa.pub'}",
            f"--service-account-signing-key-file={self.pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # the node's name resolves nowhere; its InternalIP is NODE_IP
            "--kubelet-preferred-address-types=InternalIP",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            # 127.0.0.1 is not a valid Endpoints address; nothing here needs the
            # `kubernetes` Service's endpoints (the driver runs on the host).
            "--endpoint-reconciler-type=none",
            f"--feature-gates={gates}",
            f"--audit-policy-file={audit_policy}", f"--audit-log-path={self.logs / 'audit.log'}",
            "--audit-log-mode=blocking", "--audit-log-maxsize=0",
            *runtime_config,
        ])
        self.note("started kube-apiserver")
        self._wait("kube-apiserver /readyz", lambda: self.api("GET", "/readyz", timeout=3)[0] == 200,
                   120, "kube-apiserver")

        self.note("kube-apiserver ready")
        # kube-controller-manager, kube-scheduler
        self._start("kube-controller-manager", [
            k8s, "kube-controller-manager",
            f"--kubeconfig={self.root / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={self.root / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={self.root / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            f"--root-ca-file={ca}",
            f"--cluster-signing-cert-file={ca}", f"--cluster-signing-key-file={self.pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--feature-gates={gates}",
        ])
        self._start("kube-scheduler", [
            k8s, "kube-scheduler",
            f"--kubeconfig={self.root / 'scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={self.root / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={self.root / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
            f"--feature-gates={gates}",
        ])

        # containerd
        self._containerd_config()
        path = f"{self.containerd_bin}:{self.runc.parent}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self._start("containerd", [str(self.containerd_bin / "containerd"),
                                   "--config", str(self.root / "containerd" / "config.toml")],
                    env={"PATH": path})
        self._wait("containerd socket", self.containerd_sock.exists, 60, "containerd")
        self._import_images()
        self.note("containerd up, images imported")

        # kubelet
        self._bridge()
        self._cgroup_root(create=True)
        self._kubelet_config()
        self._start_kubelet()
        self._wait(f"node {NODE} Ready", self.node_ready, timeout, "kubelet")
        self.note(f"node {NODE} Ready")
        # pods need their namespace's default ServiceAccount (the controller-manager makes it)
        self._wait("ServiceAccount default/default", lambda: self.api(
            "GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=5)[0] == 200,
            60, "kube-controller-manager")
        for name in ("kube-controller-manager", "kube-scheduler"):
            if not self._alive(name):
                raise ClusterError(f"{name} exited:\n{self.tail(name)}")
        (self.root / "up-seconds").write_text(f"{time.monotonic() - t0:.1f}\n")
        return self

    def _start_kubelet(self) -> None:
        path = f"{self.containerd_bin}:{self.runc.parent}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self._start("kubelet", [
            str(self.k8s_bin / "k8s"), "kubelet",
            f"--config={self.root / 'kubelet' / 'config.yaml'}",
            f"--kubeconfig={self.root / 'kubelet.kubeconfig'}",
            f"--root-dir={self.kubelet_dir}",
            f"--hostname-override={NODE}", f"--node-ip={NODE_IP}",
        ], env={"PATH": path})
        self.note("started kubelet")

    def stop_kubelet(self) -> None:
        """SIGTERM to the kubelet only: pods and containerd go on (a kubelet restart or
        upgrade on a node)."""
        self._stop("kubelet")

    def start_kubelet(self, timeout: float = 120) -> None:
        """The kubelet again, with the configuration `up` wrote; returns once it renewed
        the node's Lease (the Ready condition would still read True from before)."""
        started = datetime.datetime.now(datetime.timezone.utc)
        self._start_kubelet()

        def renewed() -> bool:
            code, lease = self.api("GET", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}",
                                   timeout=5)
            renew = (lease.get("spec") or {}).get("renewTime") if code == 200 else None
            return bool(renew) and datetime.datetime.fromisoformat(renew.replace("Z", "+00:00")) >= started
        self._wait(f"node {NODE}'s Lease renewed by the new kubelet", renewed, timeout, "kubelet")
        self._wait(f"node {NODE} Ready", self.node_ready, timeout, "kubelet")

    def node_ready(self) -> bool:
        code, node = self.api("GET", f"/api/v1/nodes/{NODE}", timeout=5)
        if code != 200:
            return False
        conds = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
        return conds.get("Ready", {}).get("status") == "True"

    def _nvidia_runtime(self) -> str:
        """containerd's `nvidia` handler, where build.sh built the toolkit: a wrapper that
        points nvidia-container-runtime at its own config (CDI mode, this cluster's CDI
        folder, our runc underneath) rather than /etc's."""
        runtime = self.nvidia_toolkit_bin / "nvidia-container-runtime"
        if not runtime.exists():
            return ""
        d = self.root / "nvidia-container-runtime"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.toml").write_text(f"""[nvidia-container-runtime]
debug = '{self.logs / "nvidia-container-runtime.log"}'
log-level = 'debug'
mode = 'cdi'
runtimes = ['{self.runc}']
[nvidia-container-runtime.modes.cdi]
default-kind = 'nvidia.com/gpu'
spec-dirs = ['{self.cdi_dir}']
annotation-prefixes = ['cdi.k8s.io/']
[nvidia-ctk]
path = '{self.nvidia_toolkit_bin / "nvidia-ctk"}'
""")
        wrapper = d / "nvidia-container-runtime"
        wrapper.write_text(f"#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH='{d / 'config.toml'}' exec '{runtime}' \"$@\"\n")
        wrapper.chmod(0o755)
        table = f"plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{NVIDIA_RUNTIME_HANDLER}"
        return (f"      [{table}]\n        runtime_type = 'io.containerd.runc.v2'\n"
                f"        [{table}.options]\n          BinaryName = '{wrapper}'\n"
                f"          SystemdCgroup = false\n")

    def _containerd_config(self) -> None:
        c = self.root / "containerd"
        (c / "config.toml").write_text(f"""version = 3
root = '{c / "root"}'
state = '{c / "state"}'

[grpc]
  address = '{self.containerd_sock}'

[ttrpc]
  address = '{c / "containerd.sock.ttrpc"}'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'

  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    netns_mounts_under_state_dir = true
    # This machine's root lacks CAP_SYS_RESOURCE (bounding set 0x1fffeffffff): no process
    # may lower its oom_score_adj, and runc fails the kubelet's -998 for the sandbox with
    # "nsexec: failed to update /proc/self/oom_score_adj: Permission denied". containerd's
    # knob for such hosts keeps every container's score at or above containerd's own.
    restrict_oom_score_adj = true
    cdi_spec_dirs = ['{self.cdi_dir}']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{self.runc}'
          SystemdCgroup = false
{self._nvidia_runtime()}    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{self.cni_bin}']
      conf_dir = '{self.root / "cni" / "net.d"}'

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'

  # NRI's default validator, on with nothing required node-wide: a pod annotated
  # required-plugins.noderesource.dev/pod = '["dra-accel-driver"]' gets no container while
  # the driver's NRI plugin is not registered (tests/cluster/test_nri_required.py); every
  # other pod (the tier's driver runs without NRI in most cases) is not held up.
  [plugins.'io.containerd.nri.v1.nri'.default_validator]
    enable = true
""")
        (self.root / "cni" / "net.d" / "10-local.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "dra-local-cluster",
            "plugins": [{"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                                  "dataDir": str(self.root / "cni" / "ipam"),
                                  "routes": [{"dst": "0.0.0.0/0"}]}},
                        {"type": "loopback"}],
        }, indent=1))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(self.containerd_bin / "ctr"), "--address", str(self.containerd_sock),
                            "-n", "k8s.io", *args], capture_output=True, text=True, timeout=120)
        if check and p.returncode:
            raise ClusterError(f"ctr {' '.join(args)} failed:\n{p.stderr}{p.stdout}")
        return p

    def _import_images(self) -> None:
        images = self.root / "images"
        images.mkdir(exist_ok=True)
        oci_archive(images / "pause.tar", [PAUSE_IMAGE], None, PAUSE_CMD)
        oci_archive(images / "busybox.tar", BUSYBOX_IMAGES + STAND_IN_IMAGES, None, ["sh"])
        oci_archive(images / "nvidia.tar", NVIDIA_STAND_IN_IMAGES, None, ["sh"], env=NVIDIA_ENV)
        for tar in ("pause.tar", "busybox.tar", "nvidia.tar"):
            # --local: no content fetch from anywhere; the archive holds every blob.
            self.ctr("images", "import", "--local", str(images / tar))
        # The CRI plugin keeps the sandbox image from being garbage collected by the kubelet
        # (pinned); the busybox images are labelled pinned too, as there is no registry to
        # pull them again from.
        for name in [PAUSE_IMAGE, *BUSYBOX_IMAGES, *STAND_IN_IMAGES, *NVIDIA_STAND_IN_IMAGES]:
            self.ctr("images", "label", name, "io.cri-containerd.pinned=pinned")

    def import_driver_image(self) -> str:
        """Imports the driver's image (built by `build.sh image`) into the node's containerd;
        returns its name. Not part of `up` for the tests: unpacking ~400 MB costs seconds that
        only the tests of pods running our code need (`cluster.py up` imports it if built)."""
        archive = driver_image_archive()
        t0 = time.monotonic()
        self.ctr("images", "import", "--local", str(archive))
        self.ctr("images", "label", DRIVER_IMAGE, "io.cri-containerd.pinned=pinned")
        self.note(f"driver image imported in {time.monotonic() - t0:.1f}s")
        return DRIVER_IMAGE

    def _bridge(self) -> None:
        prefix = ipaddress.ip_network(POD_CIDR).prefixlen
        for cmd in (["ip", "link", "add", BRIDGE, "type", "bridge"],
                    ["ip", "addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE],
                    ["ip", "link", "set", BRIDGE, "up"]):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode and "File exists" not in p.stderr:
                raise ClusterError(f"{' '.join(cmd)}: {p.stderr.strip()}")

    def _cgroup_root(self, create: bool) -> None:
        base = Path("/sys/fs/cgroup")
        for h in sorted(base.iterdir()):
            if not h.is_dir() or h.is_symlink() or h.name == "unified":
                continue
            d = h / CGROUP_ROOT
            if create:
                d.mkdir(exist_ok=True)
                continue
            if d.is_dir():
                # depth first; a cgroup with processes stays (and says so in EBUSY)
                for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                try:
                    d.rmdir()
                except OSError:
                    pass

    def _kubelet_config(self) -> None:
        gates = "\n".join(f"  {k}: {str(v).lower()}" for k, v in FEATURE_GATES.items())
        (self.root / "kubelet" / "config.yaml").write_text(f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This host has cgroup v1 (hybrid); the 1.35+ kubelet refuses it unless told not to.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{CGROUP_ROOT}
address: {NODE_IP}
port: {self.ports['kubelet']}
readOnlyPort: 0
healthzPort: 0
containerRuntimeEndpoint: unix://{self.containerd_sock}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {self.pki / 'ca.crt'}}}
authorization:
  mode: Webhook
registerNode: true
podCIDR: {POD_CIDR}
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
failSwapOn: false
# A test machine's disk and memory: evict only when really short.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
featureGates:
{gates}
""")

    def down(self, release: bool = True) -> None:
        """Stops every component that `up` started (by the pids it recorded), the pods'
        shims, unmounts what the kubelet mounted, removes the bridge and cgroups. Keeps the
        logs; removes the rest of the state."""
        pids = self.root / "pids"
        # pods first, while the kubelet and containerd still run: their shims are not our
        # children (containerd daemonizes them); ctr stops them by task id.
        if (pids / "containerd").exists() and self._alive("containerd"):
            if self._alive("kubelet") and self._alive("kube-apiserver") and (self.root / "cluster.json").exists():
                # as a user would: delete the pods, the kubelet stops their sandboxes
                # (CNI DEL included); what is left after 30 s is killed below
                self.load()
                self.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=0",
                             "--force", "--wait=false", check=False)
                self.note("deleted all pods")
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                    time.sleep(1)
                self.note(f"containers left: {self.ctr('tasks', 'ls', '-q', check=False).stdout.split()}")
            if self._alive("kubelet"):
                self._stop("kubelet")
            tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
            for t in tasks:
                self.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
            for t in tasks:
                self.ctr("tasks", "delete", "-f", t, check=False)
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "containerd",
                     "kube-apiserver", "etcd"):
            self._stop(name)
        # shims left by a killed containerd: their pid files are in containerd's state
        for pidfile in (self.root / "containerd" / "state").glob("io.containerd.runtime.v2.task/*/*/shim.pid"):
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        self._unmount_all()
        self.note("unmounted")
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        self._cgroup_root(create=False)
        self.note("bridge and cgroups removed")
        if self.root.exists():
            for child in self.root.iterdir():
                if child.name not in ("logs", "logs-previous", "up-seconds"):
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
            self.note("state removed")
        if release and self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _stop(self, name: str, timeout: float = 20) -> None:
        pidfile = self.root / "pids" / name
        try:
            pid = int(pidfile.read_text())
        except (OSError, ValueError):
            return
        # only if it is still ours: its command line is the one we started
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pidfile.unlink(missing_ok=True)
            return
        if str(HERE).encode() not in cmdline:
            pidfile.unlink(missing_ok=True)
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            try:
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    os.waitpid(pid, os.WNOHANG)
                    break
            except (OSError, ChildProcessError):
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        pidfile.unlink(missing_ok=True)
        self.note(f"stopped {name}")

    def _unmount_all(self) -> None:
        root = str(self.root)
        for _ in range(3):
            mounts = [line.split()[1].encode().decode("unicode_escape")
                      for line in Path("/proc/self/mounts").read_text().splitlines()]
            mine = sorted({m for m in mounts if m == root or m.startswith(root + "/")},
                          key=lambda m: -len(m))
            if not mine:
                return
            for m in mine:
                subprocess.run(["umount", "-l", m], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "env"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state folder (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=180)
    args = ap.parse_args(argv)
    c = Cluster(args.dir)
    try:
        if args.command == "up":
            c.up(args.timeout)
            if (IMAGE_CACHE / "top.tar").exists():
                print(f"imported {c.import_driver_image()} (the MPS control daemon's image)")
            os.close(c._lock_fd)  # the running cluster keeps the lock file; `down` cleans up
            print(f"cluster up in {(c.root / 'up-seconds').read_text().strip()}s; logs in {c.logs}\n"
                  f"export KUBECONFIG={c.admin_kubeconfig} PATH={c.k8s_bin}:$PATH")
        elif args.command == "down":
            c.lock()
            c.down()
            print(f"cluster down; logs kept in {c.logs}")
        else:
            print(f"export KUBECONFIG={c.admin_kubeconfig} PATH={c.k8s_bin}:$PATH")
    except ClusterError as e:
        print(f"local-cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
