"""Where the API server is and how to authenticate to it: the pod's service account, or a
kubeconfig file, read as kubectl and client-go read them.

We read both ourselves rather than through the `kubernetes` package: importing any part
of it imports all of its API models (~18 MiB of the driver's memory, ~0.2 s of its
start), and its per-request machinery (auth hooks, proxy lookups in the environment,
model serialization) cost more CPU than the requests we make. Only kubeconfig users with
an `exec` credential plugin or an `auth-provider` go through the package's own loader,
which runs plugins and renews what they return; the package is imported then, not before.

What a connection needs ends up in one `ApiConfig`; driver/kube/client.py makes the HTTP pool.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import os
import shutil
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

# The in-cluster service account, as the kubelet mounts it into every pod.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A token file (projected service account tokens rotate) is read again at most this often,
# as client-go does; a failed read keeps the token read last.
TOKEN_REREAD_SECONDS = 60.0
# Headers from the `kubernetes` package's hooks (exec plugins) are asked for at most this
# often: each call re-checks the credential's expiry and rebuilds settings.
HOOK_REREAD_SECONDS = 1.0


class ClientConfigError(Exception):
    """No usable API server configuration; the message says which file or why, with a hint."""


def unusable_kubeconfig(kubeconfig: Path, err: BaseException | str) -> str:
    """The one line for a kubeconfig file that cannot be used (preflight and the loader)."""
    detail = " ".join(str(err).split()) or type(err).__name__
    return f"kubeconfig {kubeconfig}: not a usable kubeconfig file: {detail}"


def not_in_cluster(why: object) -> str:
    """The one line for no kubeconfig outside a cluster (preflight and the loader)."""
    return (f"not in a cluster and no kubeconfig given ({why}); set --kubeconfig or "
            "$KUBECONFIG to run outside a cluster")


@dataclass
class ApiConfig:
    server: str  # scheme://host[:port], no trailing slash
    headers: Callable[[], dict[str, str]]  # the credentials of the next request
    ca_pem: str | None = None  # the CAs to trust, PEM; None: the system's
    ca_file: str | None = None
    verify: bool = True
    tls_server_name: str | None = None
    cert_file: str | None = None  # client certificate and key (files: ssl reads only files)
    key_file: str | None = None
    proxy: str | None = None
    source: str = ""  # "kubeconfig <path>" or "in-cluster service account", for messages
    # `headers` may run a credential plugin (seconds): never called on the event loop.
    headers_may_block: bool = False


def in_cluster(environ: Mapping[str, str] = os.environ,
               account: Path = SERVICE_ACCOUNT) -> ApiConfig:
    """The pod's service account; the messages are the ones preflight gives."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if host is None or port is None:
        raise ClientConfigError(not_in_cluster("Service host/port is not set."))
    if not host or not port:
        raise ClientConfigError(not_in_cluster("Service host/port is set but empty."))
    token, ca = account / "token", account / "ca.crt"
    if not token.is_file():
        raise ClientConfigError(not_in_cluster("Service token file does not exist."))
    if not ca.is_file():
        raise ClientConfigError(not_in_cluster("Service certification file does not exist."))
    tokens = TokenFile(token, TOKEN_REREAD_SECONDS)
    if not tokens.read():
        raise ClientConfigError(not_in_cluster(f"Service token file {token} is empty."))
    server = f"https://{_bracketed(host)}:{port}"
    return ApiConfig(server, tokens.headers, ca_file=str(ca),
                     proxy=_environment_proxy(server, environ),
                     source="in-cluster service account")


def check_kubeconfig(path: Path, environ: Mapping[str, str] = os.environ) -> None:
    """Every mistake `from_kubeconfig` would find, without its effects: no credential
    plugin runs and no inline key is written (preflight, before any socket is offered).
    A CA that is not a certificate is found here too; what only using the settings shows
    (a client certificate or key that is not PEM, a plugin that fails) is left to the
    client."""
    _load(path, environ, dry=True)


def from_kubeconfig(path: Path, environ: Mapping[str, str] = os.environ) -> ApiConfig:
    """The current context of a kubeconfig file. Relative file names in it are relative
    to the file, as kubectl reads them."""
    config = _load(path, environ, dry=False)
    assert config is not None
    return config


def _load(path: Path, environ: Mapping[str, str], dry: bool) -> ApiConfig | None:
    def fail(why: object) -> ClientConfigError:
        return ClientConfigError(unusable_kubeconfig(path, why))

    try:
        data = yaml.safe_load(path.read_bytes())
    except (OSError, yaml.YAMLError) as err:
        raise fail(err) from err
    if not isinstance(data, dict):
        raise fail(f"it holds a YAML {type(data).__name__}, not a mapping with clusters, "
                   "contexts and users")
    name = data.get("current-context")
    if not name:
        raise fail("it sets no current-context")
    context = _named(data, "contexts", "context", name, fail, f"current-context {name!r}")
    cluster_name = context.get("cluster")
    if not cluster_name:
        raise fail(f"context {name!r} names no cluster")
    cluster = _named(data, "clusters", "cluster", cluster_name, fail,
                     f"context {name!r} names cluster {cluster_name!r}, which")
    user_name = context.get("user")
    user = _named(data, "users", "user", user_name, fail,
                  f"context {name!r} names user {user_name!r}, which") if user_name else {}
    if user.get("exec") or user.get("auth-provider"):
        return None if dry else _by_kubernetes_package(path, environ)
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise fail(f"cluster {cluster_name!r} has no server URL (https://host:port)"
                   if not server else f"cluster {cluster_name!r}: server {server!r} is not an "
                   "http:// or https:// URL")
    base = path.parent

    def file(key: str, owner: dict, what: str) -> str | None:
        value = owner.get(key)
        if not value:
            return None
        resolved = base / str(value)
        if not resolved.is_file():
            raise fail(f"{what} {key} {resolved} does not exist")
        return str(resolved)

    def decoded(key: str, owner: dict, what: str) -> bytes | None:
        value = owner.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError) as err:
            raise fail(f"{what} {key} is not base64: {err}") from err

    who = f"user {user_name!r}"
    ca_data = decoded("certificate-authority-data", cluster, f"cluster {cluster_name!r}")
    cert_data = decoded("client-certificate-data", user, who)
    key_data = decoded("client-key-data", user, who)
    cert_file = file("client-certificate", user, who)
    key_file = file("client-key", user, who)
    if (cert_data is None and cert_file is None) != (key_data is None and key_file is None):
        raise fail(f"{who} has a client certificate without its key, or a key without its "
                   "certificate")
    headers = _credentials(user, base, who, fail)
    ca_file = file("certificate-authority", cluster, f"cluster {cluster_name!r}")
    _check_ca(ca_file, ca_data, f"cluster {cluster_name!r}", fail)
    if dry:
        return None
    if cert_data is not None or key_data is not None:
        cert_file, key_file = _private_files(cert_data, key_data, cert_file, key_file)
    return ApiConfig(
        server, headers,
        ca_pem=ca_data.decode(errors="replace") if ca_data is not None else None,
        ca_file=ca_file,
        verify=not cluster.get("insecure-skip-tls-verify", False),
        tls_server_name=cluster.get("tls-server-name") or None,
        cert_file=cert_file, key_file=key_file,
        proxy=cluster.get("proxy-url") or _environment_proxy(server, environ),
        source=f"kubeconfig {path}")


def _check_ca(ca_file: str | None, ca_data: bytes | None, what: str,
              fail: Callable[[object], ClientConfigError]) -> None:
    """A CA that is not a certificate fails here, as the client's TLS context would fail
    (loading certificates into a throw-away context has no other effect)."""
    import ssl

    for source, kwargs in (("certificate-authority", {"cafile": ca_file}),
                           ("certificate-authority-data", {"cadata": (ca_data or b"").decode(errors="replace")})):
        if not next(iter(kwargs.values())):
            continue
        try:
            ssl.create_default_context().load_verify_locations(**kwargs)
        except (ssl.SSLError, OSError, ValueError) as err:
            where = f" {ca_file}" if source == "certificate-authority" else ""
            raise fail(f"{what} {source}{where} is not a PEM certificate: "
                       f"{getattr(err, 'reason', None) or err}") from err


def _named(data: dict, section: str, key: str, name: object,
           fail: Callable[[object], ClientConfigError], reference: str) -> dict:
    for entry in data.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key)
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise fail(f"{key} {name!r} is not a mapping")
            return value
    raise fail(f"{reference} is not among its {section}")


def _credentials(user: dict, base: Path, who: str,
                 fail: Callable[[object], ClientConfigError]) -> Callable[[], dict[str, str]]:
    if user.get("token"):
        static = {"Authorization": f"Bearer {user['token']}"}
        return lambda: static
    if user.get("tokenFile"):
        tokens = TokenFile(base / str(user["tokenFile"]), TOKEN_REREAD_SECONDS)
        if not tokens.read():
            raise fail(f"{who}: tokenFile {tokens.path} cannot be read or is empty")
        return tokens.headers
    if user.get("username") is not None and user.get("password") is not None:
        basic = base64.b64encode(f"{user['username']}:{user['password']}".encode()).decode()
        static = {"Authorization": f"Basic {basic}"}
        return lambda: static
    return dict  # anonymous, or a client certificate alone


@dataclass
class TokenFile:
    """A bearer token in a file that may be replaced at any time (a projected service
    account token rotates): read again at most every TOKEN_REREAD_SECONDS."""

    path: Path
    reread: float
    _token: str = ""
    _read_at: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read(self) -> str:
        try:
            token = self.path.read_text().strip()
        except OSError:
            token = ""
        with self._lock:
            if token:
                self._token = token
            self._read_at = time.monotonic()
            return self._token

    def headers(self) -> dict[str, str]:
        if time.monotonic() - self._read_at >= self.reread:
            self.read()
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}


def _by_kubernetes_package(path: Path, environ: Mapping[str, str]) -> ApiConfig:
    """An `exec` or `auth-provider` user: the `kubernetes` package runs the plugin and
    renews its credential when it expires (its refresh hook runs when headers are asked for)."""
    from kubernetes import client as k8s  # noqa: PLC0415 - only for these users, see above
    from kubernetes import config as k8s_config  # noqa: PLC0415

    configuration = k8s.Configuration()
    try:
        k8s_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    except (k8s_config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError,
            AttributeError) as err:
        raise ClientConfigError(unusable_kubeconfig(path, err)) from err
    cache: dict[str, Any] = {"at": float("-inf"), "headers": {}}
    lock = threading.Lock()

    def headers() -> dict[str, str]:
        with lock:
            if time.monotonic() - cache["at"] >= HOOK_REREAD_SECONDS:
                # auth_settings() runs the package's refresh hook: an expired exec
                # credential is renewed there.
                bearer = configuration.auth_settings().get("BearerToken") or {}
                found = {"Authorization": bearer["value"]} if bearer.get("value") else {}
                cache.update(at=time.monotonic(), headers=found)
            return cache["headers"]

    server = configuration.host.rstrip("/")
    return ApiConfig(server, headers, ca_file=configuration.ssl_ca_cert,
                     verify=bool(configuration.verify_ssl),
                     tls_server_name=configuration.tls_server_name or None,
                     cert_file=configuration.cert_file, key_file=configuration.key_file,
                     proxy=configuration.proxy or _environment_proxy(server, environ),
                     source=f"kubeconfig {path}", headers_may_block=True)


def _private_files(cert: bytes | None, key: bytes | None, cert_file: str | None,
                   key_file: str | None) -> tuple[str | None, str | None]:
    """Inline client certificate and key as files only this process reads (Python's ssl
    loads a certificate chain from files alone), removed when the process exits."""
    directory = tempfile.mkdtemp(prefix="dra-driver-credentials-")
    atexit.register(shutil.rmtree, directory, True)

    def write(name: str, data: bytes) -> str:
        target = os.path.join(directory, name)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return target

    return (write("client.crt", cert) if cert is not None else cert_file,
            write("client.key", key) if key is not None else key_file)


def _environment_proxy(server: str, environ: Mapping[str, str]) -> str | None:
    """HTTPS_PROXY / HTTP_PROXY unless NO_PROXY covers the server, as client-go reads them."""
    lowered = {k.lower(): v for k, v in environ.items() if k.lower().endswith("_proxy") and v}
    scheme, _, rest = server.partition("://")
    proxy = lowered.get(f"{scheme}_proxy")
    if not proxy:
        return None
    host = rest.split("/", 1)[0]
    no_proxy = lowered.get("no_proxy", "")
    if no_proxy and urllib.request.proxy_bypass_environment(host, {"no": no_proxy}):
        return None
    return proxy


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
