"""driver/kube/kubeconfig.py and the HTTP layer of driver/kube/client.py against the API emulator over
HTTPS: server CAs, client certificates, in-cluster service accounts whose tokens rotate,
exec credential plugins, and the messages for kubeconfigs that cannot work.

Certificates come from `trustme` (a throwaway CA per test)."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme

import driver
import driver.kube.client

from driver.kube import kubeconfig
from driver.kube.client import ApiError, ClientConfigError, Kube, api_client
from driver.sim.apiserver import TOKEN, ApiServer

DISCOVERY = "/apis/resource.k8s.io"


def server_context(ca: trustme.CA, *names: str, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*(names or ("127.0.0.1",))).configure_cert(context)
    if client_ca is not None:  # ask for a client certificate, and accept it alone
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(directory: Path, server: str, cluster: dict | None = None,
                     user: dict | None = None, name: str = "kubeconfig") -> Path:
    path = directory / name
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server, **(cluster or {})}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "users": [{"name": "u", "user": user if user is not None else {"token": TOKEN}}],
    }))
    return path


def get(path: Path) -> dict:
    return Kube(api_client(path)).request("GET", DISCOVERY)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def test_https_with_the_clusters_ca_inline_and_as_a_file(ca, tmp_path):
    with ApiServer(tls=server_context(ca)) as api:
        inline = write_kubeconfig(tmp_path, api.url,
                                  {"certificate-authority-data": b64(ca.cert_pem.bytes())})
        assert get(inline)["name"] == "resource.k8s.io"
        (agent,) = api.state.user_agents  # named in the server's audit log, as client-go is
        assert agent.startswith(f"dra-driver/{driver.__version__} (linux/")
        (tmp_path / "certs").mkdir()
        ca.cert_pem.write_to_path(str(tmp_path / "certs" / "ca.crt"))
        relative = write_kubeconfig(tmp_path, api.url, {"certificate-authority": "certs/ca.crt"},
                                    name="relative")  # relative to the kubeconfig, as kubectl reads it
        assert get(relative)["name"] == "resource.k8s.io"
        assert api.state.unauthorized == 0


def test_a_token_file_relative_to_the_kubeconfig(tmp_path):
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    with ApiServer() as api:
        path = write_kubeconfig(tmp_path, api.url, user={"tokenFile": "token"})
        assert get(path)["name"] == "resource.k8s.io"
        assert api.state.unauthorized == 0


def test_a_server_certificate_that_does_not_verify_is_an_api_error_that_says_so(ca, tmp_path):
    other = trustme.CA()
    with ApiServer(tls=server_context(ca)) as api:
        path = write_kubeconfig(tmp_path, api.url,
                                {"certificate-authority-data": b64(other.cert_pem.bytes())})
        with pytest.raises(ApiError) as failed:
            get(path)
        assert failed.value.status == 0
        assert f"GET {DISCOVERY}" in str(failed.value)
        assert "CERTIFICATE_VERIFY_FAILED" in str(failed.value)
        # insecure-skip-tls-verify trusts any certificate, as kubectl does
        insecure = write_kubeconfig(tmp_path, api.url, {"insecure-skip-tls-verify": True},
                                    name="insecure")
        assert get(insecure)["name"] == "resource.k8s.io"


def test_tls_server_name_checks_the_certificate_against_another_name(ca, tmp_path):
    with ApiServer(tls=server_context(ca, "kubernetes.default.svc")) as api:
        trusted = {"certificate-authority-data": b64(ca.cert_pem.bytes())}
        path = write_kubeconfig(tmp_path, api.url, trusted)
        with pytest.raises(ApiError, match="127.0.0.1"):
            get(path)  # the certificate is not for the address we dial
        named = write_kubeconfig(tmp_path, api.url,
                                 {**trusted, "tls-server-name": "kubernetes.default.svc"},
                                 name="named")
        assert get(named)["name"] == "resource.k8s.io"


def test_a_client_certificate_authenticates_alone_and_its_inline_key_stays_private(ca, tmp_path):
    clients = trustme.CA()
    cert = clients.issue_cert("node-a.example", common_name="system:node:node-a")
    with ApiServer(tls=server_context(ca, client_ca=clients)) as api:
        user = {"client-certificate-data": b64(cert.cert_chain_pems[0].bytes()),
                "client-key-data": b64(cert.private_key_pem.bytes())}
        path = write_kubeconfig(tmp_path, api.url,
                                {"certificate-authority-data": b64(ca.cert_pem.bytes())}, user)
        client = api_client(path)
        assert Kube(client).request("GET", DISCOVERY)["name"] == "resource.k8s.io"
        assert api.state.unauthorized == 0
        key = Path(client.config.key_file)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
        # without the certificate the same server says 401, as the real one does
        anonymous = write_kubeconfig(tmp_path, api.url,
                                     {"certificate-authority-data": b64(ca.cert_pem.bytes())},
                                     {}, name="anonymous")
        with pytest.raises(ApiError) as failed:
            get(anonymous)
        assert failed.value.status == 401 and "Unauthorized" in str(failed.value)
        assert api.state.unauthorized == 1


def test_in_cluster_reads_the_service_account_and_a_rotated_token(ca, tmp_path, monkeypatch):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    ca.cert_pem.write_to_path(str(account / "ca.crt"))
    (account / "token").write_text("first\n")
    with ApiServer(tls=server_context(ca)) as api:
        api.state.tokens = {"first"}
        port = api.url.rsplit(":", 1)[1]
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
        config = kubeconfig.in_cluster(environ, account)
        assert config.server == f"https://127.0.0.1:{port}"
        monkeypatch.setattr(driver.kube.client, "in_cluster", lambda: config)
        kube = Kube(api_client(None))
        assert kube.request("GET", DISCOVERY)["name"] == "resource.k8s.io"
        # The kubelet rotates the projected token; the server takes only the new one.
        (account / "token").write_text("second\n")
        api.state.tokens = {"second"}
        with pytest.raises(ApiError) as failed:  # read again only once a minute
            kube.request("GET", DISCOVERY)
        assert failed.value.status == 401
        config.headers.__self__.reread = 0.0
        assert kube.request("GET", DISCOVERY)["name"] == "resource.k8s.io"
        # a token file that is briefly unreadable keeps the token read last
        (account / "token").unlink()
        assert kube.request("GET", DISCOVERY)["name"] == "resource.k8s.io"


def test_in_cluster_messages_name_what_is_missing(tmp_path, monkeypatch):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    cases = [({}, "Service host/port is not set."),
             ({"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "443"},
              "Service host/port is set but empty."),
             (environ, "Service token file does not exist.")]
    for env, why in cases:
        with pytest.raises(ClientConfigError) as failed:
            kubeconfig.in_cluster(env, account)
        assert str(failed.value) == kubeconfig.not_in_cluster(why)
    (account / "token").write_text("t")
    with pytest.raises(ClientConfigError, match="Service certification file does not exist"):
        kubeconfig.in_cluster(environ, account)
    (account / "ca.crt").write_text("not a certificate")
    (account / "token").write_text("")
    with pytest.raises(ClientConfigError, match="token .* is empty"):
        kubeconfig.in_cluster(environ, account)
    (account / "token").write_text("t")
    config = kubeconfig.in_cluster({**environ, "KUBERNETES_SERVICE_HOST": "fd00::1"}, account)
    assert config.server == "https://[fd00::1]:443"
    monkeypatch.setattr(driver.kube.client, "in_cluster", lambda: config)
    with pytest.raises(ClientConfigError, match="^in-cluster service account: cannot use its TLS"):
        api_client(None)  # ca.crt is not a certificate


EXEC_PLUGIN = """
import json, os, sys
info = json.loads(os.environ.get("KUBERNETES_EXEC_INFO") or "{}")
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": {"token": "from-exec"}}))
"""


def test_an_exec_credential_plugin_runs_through_the_kubernetes_package(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    with ApiServer() as api:
        api.state.tokens = {"from-exec"}
        path = write_kubeconfig(tmp_path, api.url, user={"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
            "args": [str(plugin)], "interactiveMode": "Never"}})
        assert get(path)["name"] == "resource.k8s.io"
        assert api.state.unauthorized == 0


def jwt(claims: dict) -> str:
    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part(claims)}.signature"


def test_an_oidc_auth_provider_is_left_to_the_kubernetes_package_too(tmp_path):
    token = jwt({"exp": int(time.time()) + 3600, "iss": "https://issuer.example"})
    with ApiServer() as api:
        api.state.tokens = {token}
        path = write_kubeconfig(tmp_path, api.url, user={"auth-provider": {
            "name": "oidc", "config": {"client-id": "k", "id-token": token,
                                       "idp-issuer-url": "https://issuer.example"}}})
        assert get(path)["name"] == "resource.k8s.io"


def test_a_static_kubeconfig_never_imports_the_kubernetes_package(tmp_path):
    """The point of reading kubeconfigs ourselves: ~18 MiB and ~0.2 s saved."""
    with ApiServer() as api:
        path = api.kubeconfig(tmp_path)
        code = ("import sys; from driver.kube.client import Kube, api_client; import driver.service.plugin; "
                f"print(Kube(api_client({str(path)!r})).request('GET', {DISCOVERY!r})['name'], "
                "'kubernetes' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["resource.k8s.io", "False"]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("current-context"), "it sets no current-context"),
    (lambda d: d.update({"current-context": "elsewhere"}), "current-context 'elsewhere' is not among its contexts"),
    (lambda d: d["contexts"][0]["context"].update({"cluster": "gone"}), "context 'c' names cluster 'gone', which is not among its clusters"),
    (lambda d: d["contexts"][0]["context"].update({"user": "gone"}), "context 'c' names user 'gone', which is not among its users"),
    (lambda d: d["clusters"][0]["cluster"].pop("server"), "cluster 'k' has no server URL"),
    (lambda d: d["clusters"][0]["cluster"].update({"server": "10.0.0.1:6443"}),
     "server '10.0.0.1:6443' is not an http:// or https:// URL"),
    (lambda d: d["clusters"][0]["cluster"].update({"certificate-authority": "nope.crt"}),
     "certificate-authority"),
    (lambda d: d["clusters"][0]["cluster"].update({"certificate-authority-data": "%%%"}),
     "certificate-authority-data is not base64"),
    (lambda d: d["users"][0]["user"].update({"client-certificate": "c.crt"}), "client-certificate"),
    (lambda d: d["users"][0].update({"user": {"tokenFile": "missing-token"}}),
     "tokenFile .*missing-token cannot be read"),
    (lambda d: d["contexts"][0].update({"context": "text"}), "context 'c' is not a mapping"),
])
def test_kubeconfig_mistakes_are_one_line_that_names_the_file(tmp_path, change, message):
    path = write_kubeconfig(tmp_path, "https://10.0.0.1:6443")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ClientConfigError) as failed:
        api_client(path)
    text = str(failed.value)
    assert text.startswith(f"kubeconfig {path}: not a usable kubeconfig file: ")
    assert "\n" not in text
    assert re.search(message, text), text


def test_a_client_certificate_without_its_key_is_refused(ca, tmp_path):
    cert = ca.issue_cert("someone")
    path = write_kubeconfig(tmp_path, "https://10.0.0.1:6443", user={
        "client-certificate-data": b64(cert.cert_chain_pems[0].bytes())})
    with pytest.raises(ClientConfigError, match="certificate without its key"):
        api_client(path)


def test_proxies_come_from_the_kubeconfig_or_the_environment_unless_no_proxy_covers_it(tmp_path):
    path = write_kubeconfig(tmp_path, "https://api.example:6443")
    assert kubeconfig.from_kubeconfig(path, {}).proxy is None
    assert kubeconfig.from_kubeconfig(path, {"HTTPS_PROXY": "http://proxy:3128"}).proxy == "http://proxy:3128"
    assert kubeconfig.from_kubeconfig(path, {"https_proxy": "http://proxy:3128",
                                             "NO_PROXY": ".example"}).proxy is None
    assert kubeconfig.from_kubeconfig(path, {"HTTP_PROXY": "http://proxy:3128"}).proxy is None
    pinned = write_kubeconfig(tmp_path, "https://api.example:6443",
                              {"proxy-url": "http://other:8080"}, name="pinned")
    assert kubeconfig.from_kubeconfig(pinned, {"HTTPS_PROXY": "http://proxy:3128"}).proxy == "http://other:8080"


def test_the_preflight_check_runs_no_plugin_and_writes_no_key(ca, tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    plugin = tmp_path / "plugin.py"
    plugin.write_text(f"open({str(ran)!r}, 'w').write('x')\n" + EXEC_PLUGIN)
    exec_user = write_kubeconfig(tmp_path, "https://10.0.0.1:6443", user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
        "args": [str(plugin)]}}, name="exec")
    kubeconfig.check_kubeconfig(exec_user)
    assert not ran.exists()
    cert = ca.issue_cert("someone")
    inline = write_kubeconfig(tmp_path, "https://10.0.0.1:6443", user={
        "client-certificate-data": b64(cert.cert_chain_pems[0].bytes()),
        "client-key-data": b64(cert.private_key_pem.bytes())}, name="inline")
    monkeypatch.setattr(kubeconfig, "_private_files", lambda *a: pytest.fail("wrote a key"))
    kubeconfig.check_kubeconfig(inline)
    with pytest.raises(ClientConfigError, match="certificate without its key"):
        kubeconfig.check_kubeconfig(write_kubeconfig(tmp_path, "https://10.0.0.1:6443", user={
            "client-key-data": b64(cert.private_key_pem.bytes())}, name="keyonly"))


def test_preflight_checks_the_service_account_with_the_clients_own_loader(tmp_path):
    from driver.service import preflight
    from driver.service.config import ConfigError

    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("t")
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError) as failed:
        preflight.api_configuration(None, environ, account)
    assert str(failed.value) == kubeconfig.not_in_cluster("Service certification file does not exist.")
    (account / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    preflight.api_configuration(None, environ, account)
