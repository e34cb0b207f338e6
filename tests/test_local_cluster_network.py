"""hack/local-cluster's Service and DNS wiring as `up` writes it, without starting anything:
kube-proxy's configuration, the kubelet's cluster DNS, the API server's flags (reachable
from pods, endpoints kept), the serving certificate's names, CoreDNS's Corefile and the
objects behind kube-dns. The cluster tier (tests/cluster/test_cluster_network.py) checks
that a pod really resolves and reaches the API server with them."""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO


def _load():
    # the tier's conftest registers the same module under this name; reuse it if loaded
    if "local_cluster" in sys.modules:
        return sys.modules["local_cluster"]
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "hack" / "local-cluster" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = mod
    spec.loader.exec_module(mod)
    return mod


lc = _load()
PORTS = {"etcd": 2379, "etcd-peer": 2380, "apiserver": 6443, "kubelet": 10250, "kube-proxy-healthz": 31001,
         "kube-proxy-metrics": 31002, "coredns-health": 31003, "coredns-ready": 31004}


@pytest.fixture
def cluster(tmp_path: Path):
    c = lc.Cluster(tmp_path)
    c.ports = dict(PORTS)
    return c


def test_kube_proxy_config_is_iptables_mode_and_leaves_host_sysctls_alone(cluster):
    config = yaml.safe_load(cluster.kube_proxy_config())
    assert config["kind"] == "KubeProxyConfiguration"
    assert config["mode"] == "iptables"
    assert config["clusterCIDR"] == lc.POD_CIDR == "10.88.0.0/24"
    assert config["hostnameOverride"] == lc.NODE
    assert config["clientConnection"]["kubeconfig"] == str(cluster.root / "kube-proxy.kubeconfig")
    # no conntrack sysctl is set: every knob at 0 ("leave as is")
    conntrack = config["conntrack"]
    assert conntrack["maxPerCore"] == 0 and conntrack["min"] == 0
    assert all(conntrack[k] == "0s" for k in ("tcpEstablishedTimeout", "tcpCloseWaitTimeout",
                                              "udpTimeout", "udpStreamTimeout"))
    assert conntrack["tcpBeLiberal"] is False
    # no route_localnet: NodePorts only on the node's address, none on 127.0.0.1
    assert config["iptables"]["localhostNodePorts"] is False
    assert config["nodePortAddresses"] == [f"{lc.NODE_IP}/32"]
    # loopback ports of this run, not kube-proxy's fixed defaults
    assert config["healthzBindAddress"] == f"127.0.0.1:{PORTS['kube-proxy-healthz']}"
    assert config["metricsBindAddress"] == f"127.0.0.1:{PORTS['kube-proxy-metrics']}"
    assert config["featureGates"] == lc.feature_gates(cluster.vers["KUBERNETES_VERSION"])


def test_kubelet_gives_pods_cluster_dns(cluster):
    (cluster.root / "kubelet").mkdir()
    cluster._kubelet_config()
    config = yaml.safe_load((cluster.root / "kubelet" / "config.yaml").read_text())
    assert config["clusterDNS"] == [lc.KUBE_DNS_IP] == ["10.96.0.10"]
    assert config["clusterDomain"] == "cluster.local"
    assert ipaddress.ip_address(lc.KUBE_DNS_IP) in ipaddress.ip_network(lc.SERVICE_CIDR)


def test_apiserver_is_reachable_from_pods_and_keeps_its_endpoints(cluster):
    argv = cluster.apiserver_argv("A=true", cluster.root / "audit.yaml", [])
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
    assert flags["endpoint-reconciler-type"] == "lease"
    assert flags["advertise-address"] == lc.NODE_IP
    # pods come from the bridge to NODE_IP, the tools to 127.0.0.1: both must be bound
    assert flags["bind-address"] in ("0.0.0.0", "::")
    assert flags["secure-port"] == str(PORTS["apiserver"])
    assert flags["service-cluster-ip-range"] == lc.SERVICE_CIDR
    assert argv[:2] == [str(cluster.k8s_bin / "k8s"), "kube-apiserver"]


def test_certificates_name_every_address_and_give_kube_proxy_and_coredns_their_users(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    lc._pki(tmp_path)
    cert = x509.load_pem_x509_certificate((tmp_path / "apiserver.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(i) for i in sans.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", lc.NODE_IP, "10.96.0.1"} <= ips
    assert {"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"} <= set(sans.get_values_for_type(x509.DNSName))

    def cn(name: str) -> str:
        c = x509.load_pem_x509_certificate((tmp_path / f"{name}.crt").read_bytes())
        return c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value

    # system:kube-proxy is the user of the default ClusterRoleBinding system:node-proxier
    assert cn("kube-proxy") == "system:kube-proxy"
    assert cn("coredns") == lc.COREDNS_USER


def test_corefile_serves_the_cluster_domain_on_the_node_address(cluster):
    text = cluster.corefile()
    assert f"bind {lc.NODE_IP}" in text
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa {" in text
    assert f"kubeconfig {cluster.root / 'coredns.kubeconfig'}" in text
    assert f"ready 127.0.0.1:{PORTS['coredns-ready']}" in text
    assert "forward" not in text  # no upstream: the cluster has no internet


def test_kube_dns_service_points_at_coredns_on_the_node(cluster):
    objects = {obj["kind"]: obj for _, obj in cluster.dns_objects()}
    service, slice_ = objects["Service"], objects["EndpointSlice"]
    assert service["metadata"] == {"name": "kube-dns", "namespace": "kube-system",
                                   "labels": service["metadata"]["labels"]}
    assert service["spec"]["clusterIP"] == lc.KUBE_DNS_IP
    assert "selector" not in service["spec"]  # no pods behind it: the EndpointSlice is ours
    assert {(p["protocol"], p["port"]) for p in service["spec"]["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert slice_["endpoints"][0]["addresses"] == [lc.NODE_IP]
    # the slice's port names are the Service's, or kube-proxy matches no endpoint to a port
    assert {p["name"] for p in slice_["ports"]} == {p["name"] for p in service["spec"]["ports"]}
    rules = objects["ClusterRole"]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(g, r, v) for g, r in (("", "services"), ("", "namespaces"),
                                              ("discovery.k8s.io", "endpointslices"))
                       for v in ("list", "watch")}
    assert objects["ClusterRoleBinding"]["subjects"][0]["name"] == lc.COREDNS_USER


def test_dns_query_reads_the_a_records_of_an_answer():
    """cluster.py's DNS client (up's check that kube-dns answers) against a fake server
    that answers with a compressed name, as CoreDNS does."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        query, peer = server.recvfrom(512)
        header = query[:2] + b"\x84\x00\x00\x01\x00\x02\x00\x00\x00\x00"
        record = lambda ip: b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04" + ipaddress.IPv4Address(ip).packed  # noqa: E731
        server.sendto(header + query[12:] + record("10.96.0.1") + record("10.96.0.2"), peer)

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert lc.dns_query("127.0.0.1", "kubernetes.default.svc.cluster.local", port=port) == ["10.96.0.1", "10.96.0.2"]
    finally:
        t.join(5)
        server.close()


def test_each_release_gets_only_its_own_gates_and_api_versions(monkeypatch):
    """A gate a release does not know stops its components: 1.32 gets DRA's own gate and
    v1beta1, 1.37 none at all (its DRA features are on by default), and the override
    applies on top."""
    monkeypatch.delenv("DRA_LOCAL_CLUSTER_FEATURE_GATES", raising=False)
    assert lc.feature_gates("v1.32.13")["DynamicResourceAllocation"] is True
    assert lc.feature_gates("v1.37.2") == {}
    assert "DRAConsumableCapacity" not in lc.feature_gates("v1.33.13"), "consumable capacity is 1.34's"
    assert lc.RELEASE_RUNTIME_CONFIG[32] == "resource.k8s.io/v1beta1=true"
    assert 37 not in lc.RELEASE_RUNTIME_CONFIG
    monkeypatch.setenv("DRA_LOCAL_CLUSTER_FEATURE_GATES", "DRAConsumableCapacity=false,X=true")
    assert lc.feature_gates("v1.37.2") == {"DRAConsumableCapacity": False, "X": True}
    with pytest.raises(lc.ClusterError, match="KUBERNETES_VERSION=v1.31.0: the local cluster knows releases 1.32 to 1.37"):
        lc.feature_gates("v1.31.0")


def test_a_release_without_gates_writes_an_empty_feature_gates_block(cluster, monkeypatch):
    monkeypatch.delenv("DRA_LOCAL_CLUSTER_FEATURE_GATES", raising=False)
    cluster.vers = dict(cluster.vers, KUBERNETES_VERSION="v1.37.2")
    (cluster.root / "kubelet").mkdir()
    cluster._kubelet_config()
    assert yaml.safe_load((cluster.root / "kubelet" / "config.yaml").read_text())["featureGates"] == {}
    cluster.vers = dict(cluster.vers, KUBERNETES_VERSION="v1.32.13")
    cluster._kubelet_config()
    gates = yaml.safe_load((cluster.root / "kubelet" / "config.yaml").read_text())["featureGates"]
    assert gates["DynamicResourceAllocation"] is True
