"""A small JSON layer over the `kubernetes` client's ApiClient.

We talk to three resource.k8s.io versions whose typed models differ (v1beta1 nests device
fields under `basic`), so requests go through the client's own serialization, auth and
connection pool, and bodies stay plain dicts that look like the YAML users read.

The `kubernetes` package is imported when a client is first made, not with this module:
importing it costs ~0.2 s (its package imports every API model), and the plugin offers its
registration socket before it needs the API server (`Kube.deferred`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import urllib3
import yaml

from driver.slices import API_GROUP, API_VERSIONS

DEFAULT_TIMEOUT = 10.0


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status  # 0: no answer (connection refused, timeout)


class NotFound(ApiError):
    pass


class ClientConfigError(Exception):
    """No usable API server configuration; the message says which file or why, with a hint."""


def unusable_kubeconfig(kubeconfig: Path, err: BaseException) -> str:
    """The one line for a kubeconfig file that cannot be used (preflight and the loader)."""
    detail = " ".join(str(err).split()) or type(err).__name__
    return f"kubeconfig {kubeconfig}: not a usable kubeconfig file: {detail}"


def not_in_cluster(why: object) -> str:
    """The one line for no kubeconfig outside a cluster (preflight and the loader)."""
    return (f"not in a cluster and no kubeconfig given ({why}); set --kubeconfig or "
            "$KUBECONFIG to run outside a cluster")


def api_client(kubeconfig: Path | None, connections: int = 16) -> Any:
    """A kubernetes.client.ApiClient for `kubeconfig`, or the in-cluster configuration."""
    from kubernetes import client as k8s  # noqa: PLC0415 - see the module docstring
    from kubernetes import config as k8s_config  # noqa: PLC0415

    configuration = k8s.Configuration()
    if kubeconfig is not None:
        try:
            k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        except (k8s_config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError,
                AttributeError) as err:
            # A file that parses to a list or a string fails inside the loader with
            # TypeError/AttributeError.
            raise ClientConfigError(unusable_kubeconfig(kubeconfig, err)) from err
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException as err:
            raise ClientConfigError(not_in_cluster(err)) from err
    # Keep-alive connections, enough for concurrent prepares and the publisher (more in
    # flight than this would each open a connection and then close it again).
    configuration.connection_pool_maxsize = connections
    configuration.retries = False
    return k8s.ApiClient(configuration)


@dataclass
class Kube:
    client: Any  # kubernetes.client.ApiClient; None until `connect` made it (deferred)
    timeout: float = DEFAULT_TIMEOUT
    make_client: Callable[[], Any] | None = None  # how a deferred Kube makes its client
    _resource_version: str | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _connecting: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def deferred(cls, kubeconfig: Path | None, connections: int = 16) -> "Kube":
        """A Kube whose client (and the `kubernetes` import) is made by `connect`, or by
        the first request."""
        return cls(None, make_client=lambda: api_client(kubeconfig, connections))

    def connect(self) -> None:
        """Make the client now. Raises ClientConfigError for an unusable configuration."""
        with self._connecting:
            if self.client is None:
                assert self.make_client is not None
                self.client = self.make_client()

    def _api(self, method: str, path: str) -> Any:
        if self.client is None:
            try:
                self.connect()
            except ClientConfigError as err:
                raise ApiError(0, f"{method} {path}: {err}") from err
        return self.client

    def request(self, method: str, path: str, query: dict | None = None, body: Any = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        from kubernetes.client import ApiException  # noqa: PLC0415 - imported by now: cheap

        client = self._api(method, path)
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        # The body is left out here: the client would walk all of it to turn its model
        # objects into dicts, and ours are plain JSON already (a slice of 128 devices took
        # a few ms). Its REST layer encodes it as it is.
        method, url, headers, _, post = client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers,
            auth_settings=["BearerToken"],
        )
        try:
            response = _once_more_if_dropped(method, lambda: client.call_api(
                method, url, header_params=headers, body=body, post_params=post,
                _request_timeout=timeout or self.timeout))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, f"{method} {path}: {err}") from err
        except ApiException as err:
            raise ApiError(err.status or 0, f"{method} {path}: {err.reason}") from err
        data = response.read()
        if response.status == 404:
            raise NotFound(404, f"{method} {path}: not found")
        if not 200 <= response.status < 300:
            raise ApiError(response.status, f"{method} {path}: {_message(data, response.reason)}")
        try:
            return json.loads(data) if data else None
        except ValueError as err:  # a proxy's page with a 200, a cut-off body
            raise ApiError(0, f"{method} {path}: the answer is not JSON: {data[:80]!r}") from err

    def stream(self, path: str, query: dict, timeout: float) -> Iterator[dict]:
        """A watch: yields decoded events until the server closes or `timeout` passes."""
        client = self._api("GET", path)
        method, url, headers, _, _ = client.param_serialize(
            "GET", path, query_params=list(query.items()),
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        )
        try:
            response = _once_more_if_dropped(method, lambda: client.rest_client.pool_manager.request(
                method, url, headers=headers, preload_content=False,
                timeout=urllib3.Timeout(connect=self.timeout, read=timeout),
            ))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, f"watch {path}: {err}") from err
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

    def resource_version(self) -> str:
        """The resource.k8s.io version to use (v1, else v1beta2, else v1beta1), asked once
        and shared by claim reads and slice writes."""
        with self._lock:
            if self._resource_version is None:
                served = self.served_resource_versions()
                if not served:
                    raise ApiError(0, f"the API server serves no {API_GROUP} version this driver knows")
                self._resource_version = served[0]
            return self._resource_version


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
