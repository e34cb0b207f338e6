"""Pods on the local cluster reach the API server through the `kubernetes` Service and get
cluster DNS (kube-proxy and CoreDNS, hack/local-cluster/cluster.py): what the driver's
DaemonSet pod needs to publish its ResourceSlices as any in-cluster client does."""

from __future__ import annotations

import json
import sys

from tests.cluster import workloads

# hack/local-cluster/cluster.py, as conftest.py loaded it (the module of the `cluster` fixture)
lc = sys.modules["local_cluster"]

# Runs in the driver's image (its Python): what an in-cluster client does, with the pod's
# own resolv.conf (the kubelet's clusterDNS) and service account token.
PROBE = r"""
import json, socket, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
token = open(sa + "/token").read()

def get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        return [e.code, None]

out = {"resolv.conf": open("/etc/resolv.conf").read()}
out["addresses"] = sorted({a[4][0] for a in socket.getaddrinfo(
    "kubernetes.default.svc.cluster.local", 443, socket.AF_INET, socket.SOCK_STREAM)})
out["by name"] = get("https://kubernetes.default.svc:443/api", token)
out["by name, no token"] = get("https://kubernetes.default.svc:443/api")
out["by IP"] = get("https://10.96.0.1:443/api", token)
print(json.dumps(out))
"""


def test_a_pod_resolves_and_reaches_the_api_server_with_its_token(cluster, driver_image):
    ns = workloads.namespace(cluster, "net")
    try:
        workloads.wait(f"ServiceAccount {ns}/default", lambda: cluster.api(
            "GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")[0] == 200, 60)
        workloads.apply(cluster, ns, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "probe", "image": driver_image,
                                     "command": ["python3", "-c", PROBE]}]}})
        pod = workloads.wait(
            "pod probe finished",
            lambda: (p := workloads.get(cluster, ns, "pod", "probe")) and
            p.get("status", {}).get("phase") in ("Succeeded", "Failed") and p,
            120, explain=lambda: f"\nevents:\n{workloads.events(cluster, ns)}")
        log = cluster.kubectl("logs", "-n", ns, "probe").stdout
        assert pod["status"]["phase"] == "Succeeded", log
        out = json.loads(log.strip().splitlines()[-1])

        assert f"nameserver {lc.KUBE_DNS_IP}" in out["resolv.conf"]
        assert "search " + ns + ".svc.cluster.local svc.cluster.local cluster.local" in out["resolv.conf"]
        assert out["addresses"] == ["10.96.0.1"]
        # the API server answered: with the token as the pod's service account, without as anonymous
        code, body = out["by name"]
        assert code == 200 and body["kind"] == "APIVersions"
        # what it advertises to clients is the address pods reach it at
        assert [a["serverAddress"] for a in body["serverAddressByClientCIDRs"]] == \
            [f"{lc.NODE_IP}:{cluster.ports['apiserver']}"]
        assert out["by name, no token"][0] in (401, 403)
        assert out["by IP"][0] == 200

        def reasons() -> set[str]:
            code, events = cluster.api("GET", f"/api/v1/namespaces/{ns}/events")
            assert code == 200, events
            return {e.get("reason") for e in events["items"]}

        # the kubelet's events for the pod are in (they are sent in the background); one
        # about DNS would have come before the container started
        seen = workloads.wait("the kubelet's event Started for pod probe",
                              lambda: (r := reasons()) and "Started" in r and r, 30)
        assert "MissingClusterDNS" not in seen, workloads.events(cluster, ns)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_kubernetes_service_endpoints_are_the_node_address(cluster):
    code, slice_ = cluster.api("GET", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes")
    assert code == 200, slice_
    assert [a for e in slice_["endpoints"] for a in e["addresses"]] == [lc.NODE_IP]
    assert [p["port"] for p in slice_["ports"]] == [cluster.ports["apiserver"]]
    code, service = cluster.api("GET", "/api/v1/namespaces/kube-system/services/kube-dns")
    assert code == 200 and service["spec"]["clusterIP"] == lc.KUBE_DNS_IP
    # from the node as well: kube-dns answers through kube-proxy's rules
    assert lc.dns_query(lc.KUBE_DNS_IP, "kube-dns.kube-system.svc.cluster.local") == [lc.KUBE_DNS_IP]
