"""A small JSON layer over urllib3 for the API server.

We talk to three resource.k8s.io versions whose typed models differ (v1beta1 nests device
fields under `basic`), so bodies stay plain dicts that look like the YAML users read, and
a request is one urllib3 call on a keep-alive pool: its URL, the credentials of the
moment (driver/kube/kubeconfig.py) and JSON. Where the API server is and how we authenticate
is read once, when a client is made (`Kube.deferred`: after the plugin offered its
registration socket).
"""

from __future__ import annotations

import json
import platform
import ssl
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog
import urllib3

from driver import __version__
from driver.kube.kubeconfig import ApiConfig, ClientConfigError, from_kubeconfig, in_cluster

# Longer than API Priority and Fairness may hold a request in its queue (a quarter of the
# server's 60 s request timeout: 15 s) and then some for the request itself: a fleet whose
# drivers start together is queued by APF, and a client that gave up sooner (10 s before)
# abandoned its place and failed the pass (13 of 1,000 nodes, bench/RESULTS.md).
DEFAULT_TIMEOUT = 30.0
# What the API server's audit log and its rate limiting (APF) see of us, as client-go's
# "<program>/<version> (<os>/<arch>)".
USER_AGENT = f"dra-driver/{__version__} ({platform.system().lower()}/{platform.machine()})"


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status  # 0: no answer (connection refused, timeout)
        # The server's Retry-After in seconds (a 429 of API Priority and Fairness says 1):
        # the soonest a throttled caller may try again. None: it said nothing.
        self.retry_after = retry_after


class NotFound(ApiError):
    pass


class NoResourceApi(ApiError):
    """The server answers but serves no resource.k8s.io version we speak (before 1.32)."""


API_GROUP = "resource.k8s.io"
API_VERSIONS = ("v1", "v1beta2", "v1beta1")  # the resource.k8s.io versions we speak, preferred first


@dataclass
class ApiClient:
    """A connection pool to one API server and the credentials for it."""

    config: ApiConfig
    pool: urllib3.PoolManager
    tls_context: ssl.SSLContext | None = None  # also for the loop's GETs (driver/kube/asyncclient.py)

    def url(self, path: str, query: dict | None = None) -> str:
        url = self.config.server + path
        return f"{url}?{urllib.parse.urlencode(query)}" if query else url

    def headers(self, extra: dict[str, str]) -> dict[str, str]:
        return {"User-Agent": USER_AGENT, **self.config.headers(), **extra}


def api_client(kubeconfig: Path | None, connections: int = 16) -> ApiClient:
    """A client for `kubeconfig`'s current context, or the in-cluster service account."""
    config = from_kubeconfig(Path(kubeconfig)) if kubeconfig is not None else in_cluster()
    try:
        context = _tls_context(config) if config.server.startswith("https://") else None
    except (ssl.SSLError, OSError, ValueError) as err:
        raise ClientConfigError(f"{config.source}: cannot use its TLS settings: {err}") from err
    # Keep-alive connections, enough for concurrent prepares and the publisher (more in
    # flight than this would each open a connection and then close it again). No
    # retries here: a GET is retried once by `_once_more_if_dropped`, a write never.
    options: dict[str, Any] = {"maxsize": connections, "retries": False}
    if context is not None:
        options["ssl_context"] = context
        if config.tls_server_name:
            options["server_hostname"] = config.tls_server_name
        if not config.verify:
            options["cert_reqs"] = ssl.CERT_NONE
            options["assert_hostname"] = False
            # Said once here, as one event, rather than by urllib3 on every request.
            structlog.get_logger(component="kube").warning(
                "api_server_certificate_not_verified", source=config.source, server=config.server,
                hint="insecure-skip-tls-verify is set; anyone on the path can read and answer")
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    if config.proxy:
        if config.proxy.startswith("socks"):
            try:
                from urllib3.contrib.socks import SOCKSProxyManager  # noqa: PLC0415
            except ImportError as err:
                raise ClientConfigError(f"{config.source}: proxy {config.proxy} is a SOCKS "
                                        "proxy, which needs PySocks (pip install pysocks)") from err
            return ApiClient(config, SOCKSProxyManager(config.proxy, **options), context)
        return ApiClient(config, urllib3.ProxyManager(config.proxy, **options), context)
    return ApiClient(config, urllib3.PoolManager(**options), context)


def _tls_context(config: ApiConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=config.ca_file, cadata=config.ca_pem)
    if not config.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.cert_file and config.key_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return context


@dataclass
class Kube:
    client: ApiClient | None  # None until `connect` made it (deferred)
    timeout: float = DEFAULT_TIMEOUT
    make_client: Callable[[], ApiClient] | None = None  # how a deferred Kube makes its client
    _resource_version: str | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _connecting: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def deferred(cls, kubeconfig: Path | None, connections: int = 16) -> "Kube":
        """A Kube whose client is made by `connect`, or by the first request."""
        return cls(None, make_client=lambda: api_client(kubeconfig, connections))

    def connect(self) -> None:
        """Make the client now. Raises ClientConfigError for an unusable configuration."""
        with self._connecting:
            if self.client is None:
                assert self.make_client is not None
                self.client = self.make_client()

    def ensure_client(self, method: str, path: str) -> ApiClient:
        """The client, made now if it was not yet; an unusable configuration is an
        ApiError of the request (`method` `path`) that needed it."""
        if self.client is None:
            try:
                self.connect()
            except ClientConfigError as err:
                raise ApiError(0, f"{method} {path}: {err}") from err
        return self.client

    def request(self, method: str, path: str, query: dict | None = None, body: Any = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        client = self.ensure_client(method, path)
        extra = {"Accept": "application/json"}
        payload = None
        if body is not None:
            extra["Content-Type"] = content_type
            # Objects as JSON for every content type we send (apply-patch+yaml too: JSON
            # is YAML); a body already serialized goes as it is.
            payload = (body if isinstance(body, bytes) else body.encode() if isinstance(body, str)
                       else json.dumps(body).encode())
        try:
            response = _once_more_if_dropped(method, lambda: client.pool.request(
                method, client.url(path, query), body=payload, headers=client.headers(extra),
                # The whole request, not each read: a server that trickles its answer
                # must not hold a prepare longer than this.
                timeout=urllib3.Timeout(total=timeout or self.timeout), retries=False))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, f"{method} {path}: {_reason(err)}") from err
        return answer(method, path, response.status, response.reason, response.data,
                      response.headers.get("Retry-After"))

    def stream(self, path: str, query: dict, timeout: float) -> Iterator[dict]:
        """A watch: yields decoded events until the server closes or `timeout` passes."""
        client = self.ensure_client("GET", path)
        method = "GET"
        try:
            response = _once_more_if_dropped(method, lambda: client.pool.request(
                method, client.url(path, query), headers=client.headers({"Accept": "application/json"}),
                preload_content=False, retries=False,
                timeout=urllib3.Timeout(connect=self.timeout, read=timeout),
            ))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, f"watch {path}: {_reason(err)}") from err
        complete = False  # the whole response read: the connection may serve another
        try:
            if response.status != 200:
                data = response.read()  # all of it; see `finally`
                complete = True
                raise ApiError(response.status, f"watch {path}: {_message(data, response.reason)}")
            buffer = b""
            for chunk in response.stream(4096):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield _event(path, line)
            complete = True
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, f"watch {path}: {err}") from err
        finally:
            if not complete:
                # Left mid-response (the caller stopped early, a read failed): the rest of
                # it is still on the connection, and pooled as it is, the next request
                # would read that instead of its own answer. Closed, the pool reconnects.
                response.close()
            response.release_conn()

    def server_version(self) -> tuple[int, int]:
        """(major, minor) of the API server, from /version ("36+" reads as 36)."""
        info = self.request("GET", "/version") or {}
        try:
            return (int("".join(c for c in str(info.get("major", "")) if c.isdigit())),
                    int("".join(c for c in str(info.get("minor", "")) if c.isdigit())))
        except ValueError as err:
            raise ApiError(0, f"GET /version: unreadable version {info!r}") from err

    def served_resource_versions(self) -> list[str]:
        """Which resource.k8s.io versions the API server serves, in our preference order."""
        group = self.request("GET", f"/apis/{API_GROUP}")
        served = {v.get("version") for v in (group or {}).get("versions", [])}
        return [v for v in API_VERSIONS if v in served]

    def known_resource_version(self) -> str | None:
        """The version `resource_version` chose, if it was asked already."""
        return self._resource_version

    def resource_version(self) -> str:
        """The resource.k8s.io version to use (v1, else v1beta2, else v1beta1), asked once
        and shared by claim reads and slice writes."""
        with self._lock:
            if self._resource_version is None:
                served = self.served_resource_versions()
                if not served:
                    raise NoResourceApi(0, f"the API server serves no {API_GROUP} version this driver "
                                        f"knows ({', '.join(API_VERSIONS)})")
                self._resource_version = served[0]
            return self._resource_version


def answer(method: str, path: str, status: int, reason: str | None, data: bytes,
           retry_after: str | None = None) -> Any:
    """A whole answer as the caller gets it: its JSON, NotFound, or ApiError."""
    if status == 404:
        raise NotFound(404, f"{method} {path}: not found")
    if not 200 <= status < 300:
        raise ApiError(status, f"{method} {path}: {_message(data, reason)}", _seconds(retry_after))
    try:
        return json.loads(data) if data else None
    except ValueError as err:  # a proxy's page with a 200, a cut-off body
        raise ApiError(0, f"{method} {path}: the answer is not JSON: {data[:80]!r}") from err


def _seconds(retry_after: str | None) -> float | None:
    """Retry-After as delay-seconds (what the API server sends); an HTTP date or anything
    else unreadable counts as not said."""
    try:
        return max(0.0, float(retry_after)) if retry_after else None
    except ValueError:
        return None


def _once_more_if_dropped(method: str, send: Callable[[], Any]) -> Any:
    """`send()`, and for a GET once more when the connection closed without an answer.

    A server or proxy may close an idle keep-alive connection just as a request goes out on
    it; the request then fails with "Connection aborted" although the server is fine, and
    client-go retries such a GET as well. Only a GET: whether a write arrived is unknown.
    A timeout is not retried (it would double the wait), nor is a refused connection."""
    try:
        return send()
    except urllib3.exceptions.ProtocolError:
        if method != "GET":
            raise
    return send()


def _reason(err: BaseException) -> str:
    """urllib3 wraps the cause (refused, reset, a certificate that does not verify); the
    cause is what a human needs."""
    cause = getattr(err, "reason", None) or err.__cause__ or err.__context__
    return f"{err}" if cause is None or str(cause) in str(err) else f"{err}: {cause}"


def _message(data: bytes, reason: str | None) -> str:
    """What a failed request's body says (a metav1.Status carries `message`), else the
    HTTP reason phrase."""
    try:
        payload = json.loads(data) if data else None
    except ValueError:
        payload = None
    message = payload.get("message") if isinstance(payload, dict) else None
    return str(message) if message else str(reason or "no reason given")


def _event(path: str, line: bytes) -> dict:
    """One watch event; a line that is not one (a proxy's page, a cut-off line) is an
    ApiError like any other failed watch, so the watcher backs off and lists again."""
    try:
        event = json.loads(line)
    except ValueError as err:
        raise ApiError(0, f"watch {path}: not a watch event: {line[:80]!r}") from err
    if not isinstance(event, dict):
        raise ApiError(0, f"watch {path}: not a watch event: {line[:80]!r}")
    return event
