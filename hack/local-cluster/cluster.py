#!/usr/bin/env python3
"""A single-node Kubernetes cluster of upstream components on this machine, no Docker.

    python3 hack/local-cluster/cluster.py up      (or hack/local-cluster/up)
    python3 hack/local-cluster/cluster.py down    (or hack/local-cluster/down)
    python3 hack/local-cluster/cluster.py env     prints KUBECONFIG=... for a shell

What runs, all built by build.sh at the versions in versions.env, all on 127.0.0.1:
etcd (embedded in the multi-call binary), kube-apiserver (Node,RBAC authorizers;
NodeRestriction and the default admission plugins, ValidatingAdmissionPolicy among them),
kube-controller-manager, kube-scheduler, containerd with runc, CNI bridge/host-local, and
the kubelet (cgroupfs driver; on a cgroup v1 host with failCgroupV1: false); for pods,
kube-proxy (iptables mode: Services, the `kubernetes` one to the API server, which listens
on NODE_IP as well and advertises it) and CoreDNS on NODE_IP:53 behind kube-dns. Certificates
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
# Cluster DNS: CoreDNS (build.sh coredns) on the host at NODE_IP:53, behind the
# selector-less Service kube-system/kube-dns at this ClusterIP, which the kubelet writes
# into every pod's resolv.conf (clusterDNS). kube-proxy makes the Service IPs work.
KUBE_DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
# CoreDNS's client certificate's user; a ClusterRole of this name lets it list and watch
# what its kubernetes plugin serves names from.
COREDNS_USER = "system:coredns"
# What kube-proxy (iptables mode) runs; Debian's `iptables` package (.ci/run installs it).
# It clears stale conntrack entries through netlink, not the conntrack CLI.
IPTABLES_COMMANDS = ("iptables", "iptables-save", "iptables-restore")
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
# What each release needs, as a user sets it, for DRA and for the features the driver
# uses (docs/compatibility.md): the gates that are off by default there, and the
# resource.k8s.io versions it does not serve by default. Only those: a gate a release does
# not know stops its components, and a default-on gate set again says nothing. From 1.36
# the features are beta and on, from 1.37 the rest (DeviceTaintRule) is GA.
RELEASE_GATES: dict[int, dict[str, bool]] = {
    # DRA itself is beta and off; device status (claim status) and admin access are alpha
    32: {"DynamicResourceAllocation": True, "DRAResourceClaimDeviceStatus": True, "DRAAdminAccess": True},
    # partitionable devices (dynamic MIG), device taints and prioritized lists arrive as alpha
    33: {"DynamicResourceAllocation": True, "DRAAdminAccess": True, "DRAPartitionableDevices": True,
         "DRADeviceTaints": True, "DRAPrioritizedList": True},
    # DRA is GA; consumable capacity, binding conditions, extended resources and the
    # kubelet's health stream for DRA arrive as alpha
    34: {"DRAConsumableCapacity": True, "DRAPartitionableDevices": True, "DRADeviceTaints": True,
         "DRADeviceBindingConditions": True, "DRAExtendedResource": True, "ResourceHealthStatus": True},
    35: {"DRAConsumableCapacity": True, "DRAPartitionableDevices": True, "DRADeviceTaints": True,
         "DRADeviceTaintRules": True, "DRADeviceBindingConditions": True, "DRAExtendedResource": True,
         "ResourceHealthStatus": True},
    # DeviceTaintRule is beta but off (its API, v1beta2, is off by default)
    36: {"DRADeviceTaintRules": True},
    37: {},
}
RELEASE_RUNTIME_CONFIG: dict[int, str] = {
    32: "resource.k8s.io/v1beta1=true",
    # DeviceTaintRule is served in v1alpha3 until 1.36
    33: "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true",
    34: "resource.k8s.io/v1alpha3=true,resource.k8s.io/v1beta2=true",
    35: "resource.k8s.io/v1alpha3=true,resource.k8s.io/v1beta2=true",
    36: "resource.k8s.io/v1beta2=true",
}
SUPPORTED_MINORS = tuple(sorted(RELEASE_GATES))
# The newest resource.k8s.io version each release serves with the runtime config above
# (v1 from 1.34): the tests' v1 objects are sent in it and read back as v1 (served.py).
RELEASE_RESOURCE_VERSION: dict[int, str] = {32: "v1beta1", 33: "v1beta2"}


def feature_gates(version: str) -> dict[str, bool]:
    """The release's gates (RELEASE_GATES), then DRA_LOCAL_CLUSTER_FEATURE_GATES="A=false,B=true",
    for every component (to see a test fail when a gate it relies on is off, or to try an
    alpha one)."""
    release = minor(version)
    if release not in RELEASE_GATES:
        raise ClusterError(f"KUBERNETES_VERSION={version}: the local cluster knows releases "
                           f"1.{SUPPORTED_MINORS[0]} to 1.{SUPPORTED_MINORS[-1]}")
    gates = dict(RELEASE_GATES[release])
    for kv in filter(None, os.environ.get("DRA_LOCAL_CLUSTER_FEATURE_GATES", "").split(",")):
        key, _, value = kv.partition("=")
        gates[key.strip()] = value.strip().lower() == "true"
    return gates


def _sibling(name: str):
    """A module beside this file (cluster.py is run as a script and loaded from a path)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"local_cluster_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the tests' v1 objects in the version an older release serves
served = _sibling("served")


def versions() -> dict[str, str]:
    """versions.env as the shell reads it (the environment may override each)."""
    out = subprocess.run(
        ["bash", "-c", f"set -a; . {HERE / 'versions.env'}; env -0"], check=True,
        capture_output=True, text=True).stdout
    env = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
    return {k: env[k] for k in ("KUBERNETES_VERSION", "CONTAINERD_VERSION", "RUNC_VERSION",
                                "CNI_PLUGINS_VERSION", "NVIDIA_CONTAINER_TOOLKIT_VERSION", "HELM_VERSION",
                                "KWOK_VERSION", "COREDNS_VERSION")}


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
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(service_ip),
        # what pods reach it at: the `kubernetes` Service's endpoint (--advertise-address)
        x509.IPAddress(ipaddress.ip_address(NODE_IP))])
    issue("admin", "kubernetes-admin", ["system:masters"])
    issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"])
    issue("controller-manager", "system:kube-controller-manager")
    issue("scheduler", "system:kube-scheduler")
    issue("kubelet", f"system:node:{NODE}", ["system:nodes"])
    # the default ClusterRoleBinding system:node-proxier grants this user what kube-proxy needs
    issue("kube-proxy", "system:kube-proxy")
    issue("coredns", COREDNS_USER)
    sa = ec.generate_private_key(ec.SECP256R1())
    (pki / "sa.key").write_bytes(key_pem(sa))
    os.chmod(pki / "sa.key", 0o600)
    (pki / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def dns_query(server: str, name: str, timeout: float = 2, port: int = 53) -> list[str]:
    """The IPv4 addresses a DNS server answers for name (one A query over UDP, no retries);
    raises OSError or ValueError when there is no usable answer."""
    query_id = int.from_bytes(os.urandom(2), "big")
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.rstrip(".").split(".")) + b"\0"
    packet = query_id.to_bytes(2, "big") + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + question + b"\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(packet, (server, port))
        reply = s.recv(4096)
    if int.from_bytes(reply[:2], "big") != query_id:
        raise ValueError("reply to another query")
    rcode, answers = reply[3] & 0x0F, int.from_bytes(reply[6:8], "big")
    if rcode:
        raise ValueError(f"rcode {rcode} for {name}")

    def skip_name(i: int) -> int:
        while reply[i]:
            if reply[i] & 0xC0 == 0xC0:  # a pointer ends the name
                return i + 2
            i += reply[i] + 1
        return i + 1

    i = skip_name(12) + 4
    out = []
    for _ in range(answers):
        i = skip_name(i)
        rtype, length = int.from_bytes(reply[i:i + 2], "big"), int.from_bytes(reply[i + 8:i + 10], "big")
        i += 10
        if rtype == 1 and length == 4:
            out.append(str(ipaddress.IPv4Address(reply[i:i + 4])))
        i += length
    return out


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
# checkout's package), for pods that run our code: the chart's DaemonSet and the MPS
# control daemon. Tagged with the checkout's version, as a user tags a build (never latest,
# so that the kubelet never tries to pull it: IfNotPresent).
def _checkout_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


DRIVER_IMAGE = f"localhost/dra-local-cluster/dra-accel-driver:{_checkout_version()}"
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


# Fake nodes (Cluster.add_fake_nodes): kwok manages the nodes with this annotation; the
# label finds them, the taint of the same key keeps pods that do not tolerate it off them.
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_LABEL = "type"
FAKE_NODE_VALUE = "kwok"
FAKE_NODE_TOLERATION = {"key": FAKE_NODE_ANNOTATION, "operator": "Exists", "effect": "NoSchedule"}


# --- the cluster ------------------------------------------------------------------------

@dataclass
class Cluster:
    root: Path = DEFAULT_DIR
    vers: dict[str, str] = field(default_factory=versions)
    ports: dict[str, int] = field(default_factory=dict)
    _lock_fd: int | None = None

    @property
    def resource_version(self) -> str:
        """resource.k8s.io's newest served version on this cluster's release."""
        return RELEASE_RESOURCE_VERSION.get(minor(self.vers["KUBERNETES_VERSION"]), "v1")

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
    def coredns(self) -> Path:
        return HERE / "bin" / f"coredns-{self.vers['COREDNS_VERSION']}" / "coredns"

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
    def netns_dir(self) -> Path:
        """Where containerd mounts pods' network namespaces (netns_mounts_under_state_dir:
        its CRI plugin's state dir), which NRI hands to the driver."""
        return self.root / "containerd" / "state" / "io.containerd.grpc.v1.cri" / "netns"

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
        version = self.resource_version
        if version != "v1":  # the tests' v1 in what this release serves (served.py)
            path, body = served.path(path, version), served.down(body, version)
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
                answer = json.loads(raw) if raw.strip().startswith(b"{") else {"raw": raw.decode()}
                return r.status, (served.up(answer) if version != "v1" else answer)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        version = self.resource_version
        if version != "v1" and "-f" in args and args[args.index("-f") + 1] != "-" and input is None:
            # a manifest file: sent on stdin, converted as one given there
            at = args.index("-f")
            input, args = Path(args[at + 1]).read_text(), (*args[:at + 1], "-", *args[at + 2:])
        if version != "v1" and input:  # the tests' v1 manifests in what this release serves
            import yaml
            input = yaml.safe_dump_all([served.down(d, version) for d in yaml.safe_load_all(input) if d])
        p = subprocess.run([str(self.k8s_bin / "kubectl"), "--kubeconfig", str(self.admin_kubeconfig), *args],
                           input=input, capture_output=True, text=True, timeout=timeout)
        if version != "v1" and p.returncode == 0 and p.stdout.lstrip().startswith("{"):
            try:  # `-o json`: read as v1
                p.stdout = json.dumps(served.up(json.loads(p.stdout)))
            except ValueError:
                pass
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
                self.runc, self.cni_bin / "bridge", self.cni_bin / "host-local", self.cni_bin / "loopback",
                self.k8s_bin / "kube-proxy", self.coredns]
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
        self._shared_root()
        _pki(self.pki)
        self.ports = {n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "kubelet",
                                                "kube-proxy-healthz", "kube-proxy-metrics",
                                                "coredns-health", "coredns-ready")}
        (self.root / "cluster.json").write_text(json.dumps({"ports": self.ports, "versions": self.vers,
                                                            "node": NODE}, indent=1))
        ca = self.pki / "ca.crt"
        kc = lambda n: kubeconfig(self.root / f"{n}.kubeconfig", self.server, ca,  # noqa: E731
                                  {"client-certificate": str(self.pki / f"{n}.crt"),
                                   "client-key": str(self.pki / f"{n}.key")})
        for n in ("admin", "controller-manager", "scheduler", "kubelet", "kube-proxy", "coredns"):
            kc(n)
        gates = self.gates_flag()
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
        runtime_config = RELEASE_RUNTIME_CONFIG.get(minor(self.vers["KUBERNETES_VERSION"]))
        runtime_config = [f"--runtime-config={runtime_config}"] if runtime_config else []
        self._start("kube-apiserver", self.apiserver_argv(gates, audit_policy, runtime_config))
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
        # Services for pods: kube-proxy, then cluster DNS behind a Service of its own
        self._start_kube_proxy(timeout)
        self._start_coredns(timeout)
        for name in ("kube-controller-manager", "kube-scheduler", "kube-proxy", "coredns"):
            if not self._alive(name):
                raise ClusterError(f"{name} exited:\n{self.tail(name)}")
        (self.root / "up-seconds").write_text(f"{time.monotonic() - t0:.1f}\n")
        return self

    def gates_flag(self) -> str:
        return ",".join(f"{k}={str(v).lower()}" for k, v in feature_gates(self.vers["KUBERNETES_VERSION"]).items())

    def gates_yaml(self) -> str:
        """The gates as a component config's `featureGates:` block ({} when there are none)."""
        gates = feature_gates(self.vers["KUBERNETES_VERSION"])
        return "\n".join(f"  {k}: {str(v).lower()}" for k, v in gates.items()) or "  {}"

    def apiserver_argv(self, gates: str, audit_policy: Path, runtime_config: list[str]) -> list[str]:
        ca = self.pki / "ca.crt"
        k8s = str(self.k8s_bin / "k8s")
        return [
            k8s, "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            # Every address: the tools' kubeconfigs say 127.0.0.1, pods reach it at NODE_IP
            # (the bridge), through the `kubernetes` Service (kube-proxy). One bind address
            # only, so not both.
            "--bind-address=0.0.0.0", f"--advertise-address={NODE_IP}",
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
            # The `kubernetes` Service's endpoints are NODE_IP:<secure port>, kept by the API
            # server (a lease per API server): pods (the driver's DaemonSet) reach it there.
            "--endpoint-reconciler-type=lease",
            f"--feature-gates={gates}",
            f"--audit-policy-file={audit_policy}", f"--audit-log-path={self.logs / 'audit.log'}",
            "--audit-log-mode=blocking", "--audit-log-maxsize=0",
            *runtime_config,
        ]

    # -- Services and DNS for pods -----------------------------------------------------------
    def kube_proxy_config(self) -> str:
        """kube-proxy's KubeProxyConfiguration (iptables mode), written by `up`."""
        gates = self.gates_yaml()
        return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: {self.root / 'kube-proxy.kubeconfig'}
hostnameOverride: {NODE}
# Traffic from this range is the pods' own (detectLocalMode ClusterCIDR); the rest that
# goes to a Service is masqueraded.
clusterCIDR: {POD_CIDR}
# Health and metrics on loopback, on ports of this run: the defaults (0.0.0.0:10256,
# 127.0.0.1:10249) are fixed ports that something else on a test machine may hold.
healthzBindAddress: 127.0.0.1:{self.ports['kube-proxy-healthz']}
metricsBindAddress: 127.0.0.1:{self.ports['kube-proxy-metrics']}
# NodePorts on the node's address only. With the default (every address, 127.0.0.1
# included) kube-proxy sets net.ipv4.conf.all.route_localnet=1 for the whole host.
nodePortAddresses: [{NODE_IP}/32]
iptables:
  localhostNodePorts: false
  masqueradeAll: false
# Host-wide kernel settings stay as the host has them (0 = leave alone). By default
# kube-proxy raises nf_conntrack_max (32768 per CPU) and the conntrack hash size and sets
# the TCP established/close-wait timeouts: sysctls of the whole machine, every connection
# of every process on it, not only the cluster's, and they outlive `down`. A one-node
# cluster with a few pods needs none of it.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
  tcpBeLiberal: false
  udpTimeout: 0s
  udpStreamTimeout: 0s
# Its default -999 needs CAP_SYS_RESOURCE, which this machine's root lacks (see
# restrict_oom_score_adj in containerd's config); 0 is what it inherits.
oomScoreAdj: 0
featureGates:
{gates}
"""

    def _iptables_path(self) -> str:
        """PATH for kube-proxy: iptables lives in /usr/sbin, which a non-login PATH may lack."""
        return ":".join(dict.fromkeys(os.environ.get("PATH", "/usr/bin:/bin").split(":") + ["/usr/sbin", "/sbin"]))

    def _start_kube_proxy(self, timeout: float) -> None:
        path = self._iptables_path()
        missing = [c for c in IPTABLES_COMMANDS if shutil.which(c, path=path) is None]
        if missing:
            raise ClusterError(f"kube-proxy needs {', '.join(missing)} (apt-get install iptables)")
        config = self.root / "kube-proxy.yaml"
        config.write_text(self.kube_proxy_config())
        self._start("kube-proxy", [str(self.k8s_bin / "k8s"), "kube-proxy", f"--config={config}"],
                    env={"PATH": path})
        self.note("started kube-proxy")
        # Its rules in place, as pods will use them: the API server through the `kubernetes`
        # Service from this host (nat OUTPUT; pods come through nat PREROUTING, same chains).
        service_ip = next(ipaddress.ip_network(SERVICE_CIDR).hosts())
        self._wait(f"the kubernetes Service ({service_ip}:443) to reach the API server",
                   lambda: self._get(f"https://{service_ip}:443/readyz") == 200, timeout, "kube-proxy")
        self.note("kube-proxy: the kubernetes Service answers")

    def _get(self, url: str) -> int:
        # a short timeout: before kube-proxy's first sync a SYN to a Service IP goes
        # unanswered, and waiting long for it would only delay `up`
        with urllib.request.urlopen(url, context=self.ssl_context(), timeout=1) as r:
            return r.status

    def corefile(self) -> str:
        """CoreDNS's configuration: names of Services (and their endpoints) in
        CLUSTER_DOMAIN and reverse names of Service IPs, from the API server; nothing else
        (no upstream to forward to: the cluster has no internet)."""
        return f""".:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{self.ports['coredns-health']}
    ready 127.0.0.1:{self.ports['coredns-ready']}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.root / 'coredns.kubeconfig'}
        pods disabled
        ttl 5
    }}
    cache 5
}}
"""

    def dns_objects(self) -> list[tuple[str, dict]]:
        """(collection path, object) for what cluster DNS needs in the API: CoreDNS's RBAC,
        the kube-dns Service without a selector (CoreDNS is no pod) and its EndpointSlice,
        which points at CoreDNS on the node."""
        ports = [{"name": "dns", "port": 53, "protocol": "UDP"},
                 {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        return [
            (f"{rbac}/clusterroles", {
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": COREDNS_USER},
                "rules": [{"apiGroups": [""], "resources": ["services", "namespaces"], "verbs": ["list", "watch"]},
                          {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                           "verbs": ["list", "watch"]}]}),
            (f"{rbac}/clusterrolebindings", {
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": COREDNS_USER},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": COREDNS_USER},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS_USER}]}),
            ("/api/v1/namespaces/kube-system/services", {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "kube-dns", "namespace": "kube-system",
                             "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}},
                "spec": {"clusterIP": KUBE_DNS_IP,
                         "ports": [dict(p, targetPort=53) for p in ports]}}),
            ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", {
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                             "labels": {"kubernetes.io/service-name": "kube-dns",
                                        "endpointslice.kubernetes.io/managed-by": "dra-local-cluster"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}, "nodeName": NODE}],
                "ports": ports}),
        ]

    def _start_coredns(self, timeout: float) -> None:
        for collection, obj in self.dns_objects():
            code, answer = self.api("POST", collection, obj)
            if code not in (201, 409):
                raise ClusterError(f"creating {obj['kind']} {obj['metadata']['name']} for cluster DNS failed "
                                   f"({code}): {answer.get('message', answer)}")
        corefile = self.root / "Corefile"
        corefile.write_text(self.corefile())
        self._start("coredns", [str(self.coredns), "-conf", str(corefile)])
        self.note("started coredns")
        self._wait("coredns /ready", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{self.ports['coredns-ready']}/ready", timeout=2).status == 200, timeout, "coredns")
        name = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"
        service_ip = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
        self._wait(f"kube-dns ({KUBE_DNS_IP}) to answer {name} with {service_ip}",
                   lambda: dns_query(KUBE_DNS_IP, name, timeout=1) == [service_ip], timeout, "coredns")
        self.note("coredns: kube-dns answers")

    def _kube_proxy_cleanup(self) -> None:
        """kube-proxy --cleanup: its iptables chains and rules go (they are the host's, and
        outlive the process). Run by `down` whether or not it was running."""
        proxy = self.k8s_bin / "kube-proxy"
        if not proxy.exists():
            return
        try:
            p = subprocess.run([str(proxy), "--cleanup"], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PATH=self._iptables_path()))
        except (OSError, subprocess.TimeoutExpired) as e:
            self.note(f"kube-proxy --cleanup failed: {e}")
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.logs / "kube-proxy-cleanup.log").write_text(p.stdout + p.stderr)
        # what is left of its Service rules (KUBE-SERVICES and the chains it jumps to), in cluster.log
        try:
            save = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                                  env=dict(os.environ, PATH=self._iptables_path())).stdout
        except OSError as e:  # no iptables: kube-proxy never ran here either
            save = str(e)
        left = sum("KUBE-SERVICES" in line or "KUBE-SVC-" in line for line in save.splitlines())
        self.note(f"kube-proxy --cleanup: exit {p.returncode}, {left} Service rules left in nat")

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

    # -- fake nodes (KWOK): Node objects without a kubelet, for the fleet benchmark ---------
    @property
    def kwok_bin(self) -> Path:
        """kwok and its stages (build.sh kwok; not part of `all`)."""
        return HERE / "bin" / f"kwok-{self.vers['KWOK_VERSION']}"

    def fake_node_names(self) -> list[str]:
        code, nodes = self.api("GET", f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3D{FAKE_NODE_VALUE}")
        if code != 200:
            raise ClusterError(f"listing fake nodes failed ({code}): {nodes}")
        return sorted(n["metadata"]["name"] for n in nodes.get("items") or [])

    def _start_kwok(self) -> None:
        if self._alive("kwok"):
            return
        if not (self.kwok_bin / "kwok").exists():
            raise ClusterError(f"kwok is not built (run hack/local-cluster/build.sh kwok): {self.kwok_bin}")
        # Only nodes with our annotation: the real node stays the kubelet's. Leases of 40 s,
        # renewed every 10 s, are what a kubelet does (the node lifecycle controller's
        # grace period is 40 s); pods on fake nodes get addresses from a range of their own.
        self._start("kwok", [str(self.kwok_bin / "kwok"), f"--kubeconfig={self.admin_kubeconfig}",
                             f"--config={self.kwok_bin / 'stages.yaml'}", "--manage-all-nodes=false",
                             f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}={FAKE_NODE_VALUE}",
                             "--node-lease-duration-seconds=40", "--cidr=10.244.0.0/16",
                             "--node-ip=10.243.0.1"])
        self.note("started kwok")

    def add_fake_nodes(self, count: int, prefix: str = "fake-node", labels: dict[str, str] | None = None,
                       workers: int = 8, timeout: float = 300) -> list[str]:
        """`count` Node objects (prefix-0000, prefix-0001, ...) beside the real node, kept
        Ready by kwok, which marks their pods Running. They carry the taint
        kwok.x-k8s.io/node=fake:NoSchedule, so only pods that tolerate it land there, and
        the label FAKE_NODE_LABEL. Returns their names once all are Ready."""
        from concurrent.futures import ThreadPoolExecutor

        self._start_kwok()
        names = [f"{prefix}-{i:04d}" for i in range(count)]

        def create(name: str) -> None:
            body = {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name,
                "labels": {FAKE_NODE_LABEL: FAKE_NODE_VALUE, "kubernetes.io/hostname": name,
                           "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", **(labels or {})},
                "annotations": {FAKE_NODE_ANNOTATION: FAKE_NODE_VALUE}},
                "spec": {"taints": [{"key": FAKE_NODE_ANNOTATION, "value": FAKE_NODE_VALUE,
                                     "effect": "NoSchedule"}]}}
            code, answer = self.api("POST", "/api/v1/nodes", body)
            if code not in (201, 409):
                raise ClusterError(f"creating fake node {name} failed ({code}): {answer.get('message', answer)}")

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(create, names))
        self.note(f"created {count} fake nodes ({prefix}-*)")
        wanted = set(names)

        def all_ready() -> bool:
            code, nodes = self.api("GET", f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3D{FAKE_NODE_VALUE}",
                                   timeout=60)
            ready = {n["metadata"]["name"] for n in nodes.get("items") or []
                     if any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in (n.get("status") or {}).get("conditions") or [])}
            return code == 200 and wanted <= ready
        self._wait(f"{count} fake nodes Ready", all_ready, timeout, "kwok")
        self.note(f"{count} fake nodes Ready")
        return names

    def remove_fake_nodes(self, timeout: float = 300) -> None:
        """Deletes every fake node and stops kwok. What hangs off a node by an owner
        reference (its Lease, the ResourceSlices a driver published for it) goes with it
        through the garbage collector; its pods through the pod GC."""
        names = self.fake_node_names() if self._alive("kube-apiserver") else []
        if names:
            # one DELETE of the collection (kubectl deletes node by node)
            self.api("DELETE", f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3D{FAKE_NODE_VALUE}",
                     timeout=timeout)
            self._wait("fake nodes deleted", lambda: not self.fake_node_names(), timeout)
            self.note(f"deleted {len(names)} fake nodes")
        self._stop("kwok")

    def stop_scheduler(self) -> None:
        """No scheduler for a while: pods made now wait, and a restart_scheduler places them
        all at once (the fleet benchmark's throughput is the scheduler's, not our client's)."""
        self._stop("kube-scheduler")

    def restart_scheduler(self, qps: int, wait: bool = True) -> int:
        """kube-scheduler again, with client QPS/burst `qps` (the default of 50 would bound
        every workload alike at ~25 pods/s: a binding and a claim status write per pod) and
        its /metrics served on a port of its own, which this returns. wait=False returns
        at once (the caller scrapes /metrics from before the first pod is placed)."""
        port = free_port()
        config = self.root / "scheduler-config.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.root / "scheduler.kubeconfig"), "qps": qps, "burst": qps},
            "leaderElection": {"leaderElect": False}}))
        self._stop("kube-scheduler")
        gates = self.gates_flag()
        self._start("kube-scheduler", [
            str(self.k8s_bin / "k8s"), "kube-scheduler", f"--config={config}",
            f"--authentication-kubeconfig={self.root / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={self.root / 'scheduler.kubeconfig'}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--feature-gates={gates}"])
        if not wait:
            return port
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its self-signed serving cert
        self._wait("kube-scheduler /readyz", lambda: urllib.request.urlopen(
            f"https://127.0.0.1:{port}/readyz", context=ctx, timeout=3).status == 200, 60, "kube-scheduler")
        self.note(f"restarted kube-scheduler (qps {qps}, metrics on {port})")
        return port

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
                    ["ip", "link", "set", BRIDGE, "up"],
                    # Service IPs from this host (up's checks, hostNetwork pods) go out by the
                    # bridge, from NODE_IP, rather than by whatever default route the host has
                    # (none on an offline machine: "Network is unreachable" before kube-proxy's
                    # rules are looked at); the route goes with the bridge in `down`.
                    ["ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE, "src", NODE_IP]):
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
        gates = self.gates_yaml()
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
clusterDomain: {CLUSTER_DOMAIN}
# CoreDNS behind kube-dns (up starts it); without it the kubelet warns MissingClusterDNS
# on every pod and gives pods the host's resolv.conf.
clusterDNS: [{KUBE_DNS_IP}]
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
        self._stop("kwok")  # fake nodes' kwok (add_fake_nodes), if one runs
        for name in ("coredns", "kube-proxy", "kubelet", "kube-scheduler", "kube-controller-manager",
                     "containerd", "kube-apiserver", "etcd"):
            self._stop(name)
        self._kube_proxy_cleanup()
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

    def _shared_root(self) -> None:
        """The cluster's folder a shared mount of its own (a bind mount onto itself, made
        rshared), as / is on a systemd host: containerd refuses a Bidirectional mount from
        a non-shared one and HostToContainer from a private one, and mounts made later
        under it (pods' network namespaces, the MPS shm tmpfs) reach the driver's pod only
        through shared propagation. _unmount_all takes it away again."""
        # /var/run/netns too, as `ip netns add` leaves it: the driver pod's mock keeps its
        # own namespace there (a HostToContainer mount, which containerd refuses from a
        # private mount). Left mounted by `down`, as iproute2 leaves it.
        Path("/var/run/netns").mkdir(parents=True, exist_ok=True)
        for path in (str(self.root), str(Path("/var/run/netns").resolve())):
            mounted = any(line.split()[4] == path for line in Path("/proc/self/mountinfo").read_text().splitlines())
            if not mounted:
                subprocess.run(["mount", "--bind", path, path], check=True, capture_output=True)
            subprocess.run(["mount", "--make-rshared", path], check=True, capture_output=True)

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
                print(f"imported {c.import_driver_image()} (the driver's image: the chart's pod, the MPS control daemons)")
            os.close(c._lock_fd)  # the running cluster keeps the lock file; `down` cleans up
            print(f"cluster up in {(c.root / 'up-seconds').read_text().strip()}s; logs in {c.logs}\n"
                  f"export KUBECONFIG={c.admin_kubeconfig} PATH={c.k8s_bin}:{c.helm.parent}:$PATH")
        elif args.command == "down":
            c.lock()
            c.down()
            print(f"cluster down; logs kept in {c.logs}")
        else:
            print(f"export KUBECONFIG={c.admin_kubeconfig} PATH={c.k8s_bin}:{c.helm.parent}:$PATH")
    except ClusterError as e:
        print(f"local-cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
