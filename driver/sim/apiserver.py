"""An in-process stand-in for the Kubernetes API server, enough for this driver.

It serves resource.k8s.io discovery, ResourceClaims (GET), ResourceSlices (list with field
selectors, get, create, update, delete, watch) and Nodes over real HTTP (or HTTPS), so the
driver's client code path runs unchanged. Like the real server it authenticates every
request but /version (a bearer token it knows, or a client certificate its CA signed:
401 otherwise), validates slices
(driver/scheduling/k8s_limits.py), stores quantities canonically (`40960Mi` comes back as `40Gi`,
driver/kube/quantity.py), enforces resourceVersion and UID on updates and delete
preconditions (409), and disables Nagle.
Tests can inject faults (status codes, delays) and read write counters.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from driver.kube import quantity
from driver.sim import claimstatus, events
from driver.scheduling.k8s_limits import slice_errors

GROUP = "resource.k8s.io"
# On a claim made from a template: the pod's name for the claim (resourceclaim controller)
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
TOKEN = "test-token"  # the token of the kubeconfig that `kubeconfig()` writes
# What the real server serves to anyone (the system:public-info-viewer role).
PUBLIC = ("/version", "/healthz", "/livez", "/readyz")


@dataclass
class Fault:
    method: str  # "GET", "POST", "PUT", "DELETE" or "*"
    path: str  # regex on the path
    status: int = 500  # 0: no status, just a delay (timeout)
    delay: float = 0.0
    times: int = 1
    # Seconds between the error's headers and its body. A real server's body may arrive in
    # a later segment (or HTTP/2 frame) than its headers, and a client that hands the
    # connection back to its pool on the headers alone then reads this body as the answer
    # to its next request.
    body_delay: float = 0.0
    # An HTML page instead of a Status: what a proxy or load balancer in front of the API
    # server answers with (a 502 or 504 page).
    page: str = ""
    # Close the connection without an answer: a server or proxy that closed an idle
    # keep-alive connection just as the client sent a request on it.
    drop: bool = False
    # A Retry-After header on the error (seconds), as API Priority and Fairness sends with
    # its 429s ("1"). The emulator never throttles by itself: only an injected fault does.
    retry_after: str = ""
    # Requests inside this fault's delay now, and the most at once (how parallel a client is).
    held: int = 0
    peak: int = 0


@dataclass
class State:
    versions: list[str] = field(default_factory=lambda: ["v1", "v1beta2", "v1beta1"])
    claims: dict[tuple[str, str], dict] = field(default_factory=dict)
    slices: dict[str, dict] = field(default_factory=dict)
    nodes: dict[str, dict] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict] = field(default_factory=dict)
    # Read-only objects for clients that only read them (`dra-driver explain`):
    # (resource, namespace or "", name) -> object; resources: deviceclasses,
    # resourceclaimtemplates, devicetaintrules, namespaces.
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    # (namespace, claim) -> status.devices entry key -> field managers (server-side apply)
    status_owners: dict[tuple[str, str], dict[tuple, set[str]]] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)  # events.k8s.io/v1, as created
    # (namespace, claim, HTTP status) of each PATCH of resourceclaims/status, in order
    status_patches: list[tuple[str, str, int]] = field(default_factory=list)
    # Drivers whose status.devices entries the client may not change: RBAC without
    # associated-node:patch (or arbitrary-node:patch) on resourceclaims/driver for them.
    status_denied: set[str] = field(default_factory=set)
    # Nodes whose pods something runs (driver/sim/pods.py, the kubelet's part): there a
    # deleted pod stays, terminating, until its processes are gone; elsewhere it goes at once.
    pod_nodes: set[str] = field(default_factory=set)
    resource_version: int = 100
    faults: list[Fault] = field(default_factory=list)
    writes: list[tuple[str, str]] = field(default_factory=list)  # (verb, slice name)
    requests: int = 0
    access: set = field(default_factory=set)  # (verb, apiGroup, resource): what RBAC must allow
    watchers: list = field(default_factory=list)
    # Slice events by resourceVersion, for watches that resume from one; the real server
    # keeps a window too (etcd compaction, the watch cache) and answers an older one with
    # 410 Expired.
    history: list = field(default_factory=list)
    compacted: int = 0  # watches from an older resourceVersion get 410 Expired
    bookmarks: bool = True  # a watch that asks for bookmarks ends with one
    # Feature gates that change what the server keeps of a slice: a disabled gate's
    # fields are dropped on write without an error, as the real server does.
    gates: dict[str, bool] = field(default_factory=lambda: {"DRAConsumableCapacity": True,
                                                             "DRADeviceTaints": True,
                                                             "DRAPartitionableDevices": True})
    server_version: tuple[int, int] = (1, 36)  # /version; the shared-counter layout follows it
    # Bearer tokens it accepts; a client certificate that the TLS context verified is
    # accepted too (the TLS context decides whether one is asked for).
    tokens: set[str] = field(default_factory=lambda: {TOKEN})
    unauthorized: int = 0  # requests answered 401
    user_agents: set[str] = field(default_factory=set)
    connections: int = 0  # TCP connections accepted (keep-alive reuse shows here)
    # Close each connection, without notice, after this many answers: what a client sees
    # of a server's or load balancer's idle timeout (the next request on it gets nothing).
    answers_per_connection: int | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = None

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The socketserver default is a listen backlog of 5: a client that opens more
    # connections at once sees the rest wait for SYN retransmits (1 s and more). Go's
    # server listens with the kernel's limit.
    request_queue_size = 4096


class ApiServer:
    def __init__(self, versions: list[str] | None = None,
                 gates: dict[str, bool] | None = None,
                 server_version: tuple[int, int] = (1, 36),
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: serve HTTPS with this server context (tests/tls.py makes one)."""
        self.state = State(server_version=server_version)
        if versions:
            self.state.versions = versions
        self.state.gates.update(gates or {})
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.tls = tls
        if tls is not None:
            # The handshake happens on the handler's thread, at its first read.
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True,
                                                do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "ApiServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": self.url}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
            "users": [{"name": "emu", "user": {"token": TOKEN}}],
        }))
        return path

    # -- test helpers ----------------------------------------------------------------------
    def add_node(self, name: str, labels: dict[str, str] | None = None,
                 allocatable: dict[str, str] | None = None, kubelet_version: str | None = None) -> dict:
        """A Node as its kubelet registers it; the kubelet's version is the control plane's
        unless given (a kubelet may be up to three minors older)."""
        major, minor = self.state.server_version
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels or {})},
                "status": {"allocatable": dict(allocatable or {}),
                           "nodeInfo": {"kubeletVersion": kubelet_version or f"v{major}.{minor}.0"}}}
        with self.state.lock:
            self.state.nodes[name] = node
        return node

    def put_claim(self, claim: dict) -> None:
        meta = claim["metadata"]
        with self.state.lock:
            self.state.claims[(meta["namespace"], meta["name"])] = copy.deepcopy(claim)

    def put_object(self, resource: str, obj: dict) -> None:
        """Store a DeviceClass, ResourceClaimTemplate, DeviceTaintRule or Namespace."""
        meta = obj["metadata"]
        with self.state.lock:
            self.state.objects[(resource, meta.get("namespace", ""), meta["name"])] = copy.deepcopy(obj)

    def delete_claim(self, namespace: str, name: str) -> None:
        with self.state.lock:
            self.state.claims.pop((namespace, name), None)
            self.state.status_owners.pop((namespace, name), None)  # a new claim starts afresh

    def deny_status_writes(self, driver: str, denied: bool = True) -> None:
        """Take away (or give back) the client's grant to change `driver`'s entries of
        status.devices (from 1.36, with DRAResourceClaimGranularStatusAuthorization)."""
        with self.state.lock:
            (self.state.status_denied.add if denied else self.state.status_denied.discard)(driver)

    def claim_for_pod(self, namespace: str, pod_name: str, pod_uid: str, pod_claim: str,
                      uid: str, results: list[dict], config: list[dict] | None = None) -> dict:
        """A claim as kube-controller-manager's resourceclaim controller makes it from a
        pod's ResourceClaimTemplate (named `<pod>-<pod claim>-<suffix>`, the pod its
        controlling owner, the pod claim's name in an annotation), stored allocated.
        Returns it."""
        claim = claim_allocated(namespace, f"{pod_name}-{pod_claim}-{uid[:5]}"[:253], uid, results, config)
        claim["metadata"]["annotations"] = {POD_CLAIM_ANNOTATION: pod_claim}
        claim["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod_name,
                                                 "uid": pod_uid, "controller": True,
                                                 "blockOwnerDeletion": True}]
        self.put_claim(claim)
        return claim

    def pod_done(self, namespace: str, pod_uid: str) -> list[str]:
        """What the resourceclaim controller does once a pod is done (Succeeded or Failed,
        or deleted): the claims it generated for that pod are deleted. On a real cluster
        this races with the kubelet's NodeUnprepareResources, and the driver's status
        apply after the unprepare then gets 404 (tests/cluster). Returns their names."""
        with self.state.lock:
            gone = [key for key, claim in self.state.claims.items()
                    if key[0] == namespace and POD_CLAIM_ANNOTATION in (claim["metadata"].get("annotations") or {})
                    and any(o.get("uid") == pod_uid and o.get("controller")
                            for o in claim["metadata"].get("ownerReferences") or [])]
        for ns, name in gone:
            self.delete_claim(ns, name)
        return [name for _, name in gone]

    def inject(self, fault: Fault) -> None:
        with self.state.lock:
            self.state.faults.append(fault)

    def slices(self) -> list[dict]:
        with self.state.lock:
            return [copy.deepcopy(s) for _, s in sorted(self.state.slices.items())]

    def writes(self) -> list[tuple[str, str]]:
        with self.state.lock:
            return list(self.state.writes)

    def reset_writes(self) -> None:
        with self.state.lock:
            self.state.writes.clear()

    def delete_slice(self, name: str) -> None:
        """An outside actor (the kubelet, an admin) deletes a slice."""
        with self.state.lock:
            obj = self.state.slices.pop(name)
            self.state.resource_version += 1
            _notify(self.state, "DELETED", obj)

    def edit_slice(self, name: str, mutate) -> None:
        with self.state.lock:
            obj = self.state.slices[name]
            mutate(obj)
            self.state.resource_version += 1
            obj["metadata"]["resourceVersion"] = str(self.state.resource_version)
            _notify(self.state, "MODIFIED", obj)

    def compact(self) -> None:
        """What etcd compaction does to watches: none may resume from before now."""
        with self.state.lock:
            self.state.history.clear()
            self.state.compacted = self.state.resource_version

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.state.changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.state.changed.wait(remaining)
        return True


HISTORY = 1000  # slice events kept for resuming watches


def _notify(state: State, kind: str, obj: dict) -> None:
    event = {"type": kind, "object": copy.deepcopy(obj)}
    if kind == "DELETED":  # the real server reports a deletion at the deletion's version
        event["object"]["metadata"]["resourceVersion"] = str(state.resource_version)
    state.history.append((state.resource_version, event))
    if len(state.history) > HISTORY:
        state.compacted = state.history[-HISTORY - 1][0]
        del state.history[:-HISTORY]
    for watcher in list(state.watchers):
        watcher.append(event)
    state.changed.notify_all()


def claim_allocated(namespace: str, name: str, uid: str, results: list[dict],
                    config: list[dict] | None = None, version: str = "v1") -> dict:
    """A claim as the real scheduler leaves it allocated: `config` is the allocation's
    (FromClass entries and the claim's own FromClaim ones), and the claim's spec carries
    the FromClaim ones as written."""
    requests = [{"name": r["request"].split("/")[0]} for r in results]
    spec: dict = {"requests": requests}
    written = [{**({"requests": list(c["requests"])} if c.get("requests") else {}), "opaque": c["opaque"]}
               for c in config or [] if c.get("source") == "FromClaim"]
    if written:
        spec["config"] = written
    return {
        "apiVersion": f"{GROUP}/{version}", "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": spec},
        "status": {"allocation": {"devices": {"results": results,
                                              "config": scheduler_config(requests, results, config or [])}}},
    }


def scheduler_config(requests: list[dict], results: list[dict], config: list[dict]) -> list[dict]:
    """The allocation's configs as the real scheduler writes them: `requests` cleared where
    they name every request of the claim, or its chosen subrequest `req/sub` ("empty means
    all", k8s.io/dynamic-resource-allocation structured/internal/*/allocator_*.go), so a
    config aimed at every request reads like a claim-wide one."""
    chosen = {r["request"].split("/", 1)[0]: r["request"] for r in results if "/" in r["request"]}

    def names_all(named: list[str]) -> bool:
        return all(r["name"] in named or chosen.get(r["name"]) in named for r in requests)

    # nil on the scheduler's side: the field is left out of the stored object
    return [{k: v for k, v in c.items() if k != "requests"}
            if c.get("requests") and names_all(c["requests"]) else c for c in config]


_SLICES = re.compile(rf"^/apis/{re.escape(GROUP)}/(v1|v1beta2|v1beta1)/resourceslices(?:/([^/]+))?$")
_CLAIM = re.compile(rf"^/apis/{re.escape(GROUP)}/(v1|v1beta2|v1beta1)/namespaces/([^/]+)/resourceclaims/([^/]+)$")
_CLAIM_STATUS = re.compile(rf"^/apis/{re.escape(GROUP)}/(v1|v1beta2|v1beta1)/namespaces/([^/]+)/resourceclaims/([^/]+)/status$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_NAMESPACE = re.compile(r"^/api/v1/namespaces/([^/]+)$")
# Reads of other resource.k8s.io objects: lists, and named GETs.
_READS = re.compile(rf"^/apis/{re.escape(GROUP)}/(v1|v1beta2|v1beta1|v1alpha3)/(?:namespaces/([^/]+)/)?"
                    r"(deviceclasses|resourceclaimtemplates|resourceclaims|devicetaintrules)(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$")
_EVENTS = re.compile(r"^/apis/events\.k8s\.io/v1/namespaces/([^/]+)/events$")


# Go's net/http sends a handler's answer with a Content-Length only when it is written
# whole before its 2 KiB buffer fills; anything longer goes chunked.
GO_CHUNKING_BYTES = 2048


class _Handler(BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"
    # The real API server sets TCP_NODELAY; without it every response stalls ~40 ms on
    # delayed ACKs and all latency figures would be fiction.
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing --------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self._answers = 0
        with self.state.lock:
            self.state.connections += 1

    def _send(self, status: int, body: dict | None = None, body_delay: float = 0.0,
              headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        # As Go's net/http (the API server sets no length): a body that does not fit its
        # 2 KiB buffer goes chunked, a smaller one with its length.
        chunked = len(data) > GO_CHUNKING_BYTES
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()  # flushes the headers
        if body_delay:
            time.sleep(body_delay)
        if chunked:
            for at in range(0, len(data), 4096):  # Go flushes its 4 KiB writer as it fills
                part = data[at:at + 4096]
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(data)
        self._answered()

    def _answered(self) -> None:
        self._answers += 1
        limit = self.state.answers_per_connection
        if limit is not None and self._answers >= limit:
            self.wfile.flush()
            self.close_connection = True  # silently: no "Connection: close" was sent

    def _status(self, code: int, message: str, reason: str = "", body_delay: float = 0.0,
                headers: dict[str, str] | None = None) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "message": message, "reason": reason, "code": code}, body_delay, headers)

    def _page(self, code: int, page: str) -> None:
        data = page.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self._answered()

    def _authenticated(self) -> bool:
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme == "Bearer" and token in self.state.tokens:
            return True
        getpeercert = getattr(self.connection, "getpeercert", None)
        return bool(getpeercert and getpeercert())  # verified by the TLS context

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else {}

    def _fault(self, method: str, path: str) -> bool:
        with self.state.lock:
            self.state.requests += 1
            for fault in self.state.faults:
                if fault.times > 0 and fault.method in (method, "*") and re.search(fault.path, path):
                    fault.times -= 1
                    fault.held += 1
                    fault.peak = max(fault.peak, fault.held)
                    break
            else:
                return False
        try:
            if fault.delay:
                time.sleep(fault.delay)
        finally:
            with self.state.lock:
                fault.held -= 1
        if fault.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return True
        if fault.status and fault.page:
            self._page(fault.status, fault.page)
            return True
        if fault.status:
            self._status(fault.status, f"injected fault {fault.status}", body_delay=fault.body_delay,
                         headers={"Retry-After": fault.retry_after} if fault.retry_after else None)
            return True
        return False

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        body = self._body() if method in ("POST", "PUT", "DELETE", "PATCH") else None
        if self._fault(method, url.path):
            return
        with self.state.lock:
            self.state.user_agents.add(self.headers.get("User-Agent") or "")
        if url.path not in PUBLIC and not self._authenticated():
            with self.state.lock:
                self.state.unauthorized += 1
            return self._status(401, "Unauthorized", "Unauthorized")
        if method == "GET" and url.path == f"/apis/{GROUP}":
            versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in self.state.versions]
            return self._send(200, {"kind": "APIGroup", "apiVersion": "v1", "name": GROUP,
                                    "versions": versions, "preferredVersion": versions[0]})
        if method == "GET" and url.path == "/version":
            major, minor = self.state.server_version
            return self._send(200, {"major": str(major), "minor": str(minor),
                                    "gitVersion": f"v{major}.{minor}.0"})
        self._record(method, url.path, query)
        if method == "GET" and url.path == "/api/v1/nodes":
            with self.state.lock:
                items = copy.deepcopy(list(self.state.nodes.values()))
            return self._send(200, {"apiVersion": "v1", "kind": "NodeList", "items": items,
                                    "metadata": {"resourceVersion": str(self.state.resource_version)}})
        if m := _NODE.match(url.path):
            node = self.state.nodes.get(m.group(1))
            return self._send(200, node) if node else self._status(404, "node not found", "NotFound")
        if m := _PODS.match(url.path):
            return self._pods(method, m.group(1), m.group(2), query, body)
        if m := _EVENTS.match(url.path):
            return self._events(method, m.group(1), body)
        if m := _CLAIM_STATUS.match(url.path):
            return self._claim_status(method, *m.groups(), query, body)
        if m := _CLAIM.match(url.path):
            version, namespace, name = m.groups()
            if version not in self.state.versions:
                return self._status(404, "version not served", "NotFound")
            with self.state.lock:
                claim = copy.deepcopy(self.state.claims.get((namespace, name)))
            if claim is None or method != "GET":
                return self._status(404, f"resourceclaims {name!r} not found", "NotFound")
            claim["apiVersion"] = f"{GROUP}/{version}"
            return self._send(200, claim)
        if m := _SLICES.match(url.path):
            version, name = m.groups()
            if version not in self.state.versions:
                return self._status(404, "version not served", "NotFound")
            return self._slices(method, version, name, query, body)
        if method == "GET" and (m := _NAMESPACE.match(url.path)):
            with self.state.lock:
                found = copy.deepcopy(self.state.objects.get(("namespaces", "", m.group(1))))
            return self._send(200, found) if found else self._status(404, "namespace not found", "NotFound")
        if method == "GET" and (m := _READS.match(url.path)):
            return self._read(*m.groups())
        self._status(404, f"no route for {method} {url.path}", "NotFound")

    def _claim_status(self, method: str, version: str, namespace: str, name: str, query: dict,
                      body) -> None:
        if version not in self.state.versions:
            return self._status(404, "version not served", "NotFound")
        if method != "PATCH":
            return self._status(405, f"{method} on resourceclaims/status is not emulated", "MethodNotAllowed")
        with self.state.lock:
            claim = self.state.claims.get((namespace, name))
            if claim is None:
                self.state.status_patches.append((namespace, name, 404))
                return self._status(404, f'resourceclaims.{GROUP} "{name}" not found', "NotFound")
            owners = self.state.status_owners.setdefault((namespace, name), {})
            try:
                if self.state.status_denied and self._granular_status_authorization():
                    # The API server's own authorization check inside the write: the
                    # drivers whose entries the apply would change need the verb. A
                    # refusal is a field error of the object (422), not a 403.
                    trial = copy.deepcopy(claim)
                    claimstatus.apply(trial, copy.deepcopy(owners), body, query.get("fieldManager"),
                                      query.get("force") in ("true", "1"), self.headers.get("Content-Type", ""))
                    for driver in sorted(claimstatus.modified_drivers(claim, trial) & self.state.status_denied):
                        raise claimstatus.ApplyError(422, "Invalid", claimstatus.driver_forbidden(name, driver, namespace))
                claimstatus.apply(claim, owners, body, query.get("fieldManager"),
                                  query.get("force") in ("true", "1"),
                                  self.headers.get("Content-Type", ""))
            except claimstatus.ApplyError as err:
                self.state.status_patches.append((namespace, name, err.code))
                return self._status(err.code, err.message, err.reason)
            self.state.status_patches.append((namespace, name, 200))
            self.state.resource_version += 1
            claim["metadata"]["resourceVersion"] = str(self.state.resource_version)
            reply = copy.deepcopy(claim)
        reply["apiVersion"] = f"{GROUP}/{version}"
        return self._send(200, reply)

    def _read(self, version: str, namespace: str | None, resource: str, name: str | None) -> None:
        # devicetaintrules is alpha (v1alpha3) before 1.36; the rest follow the served versions.
        served = self.state.versions + (["v1alpha3"] if resource == "devicetaintrules" else [])
        if version not in served:
            return self._status(404, "version not served", "NotFound")
        with self.state.lock:
            if resource == "resourceclaims":
                found = [c for (ns, _), c in self.state.claims.items() if namespace in (None, ns)]
            else:
                found = [o for (r, ns, _), o in self.state.objects.items()
                         if r == resource and namespace in (None, ns or None)]
            found = copy.deepcopy([o for o in found if name in (None, o["metadata"]["name"])])
        for obj in found:
            obj["apiVersion"] = f"{GROUP}/{version}"
        if name is not None:
            if not found:
                return self._status(404, f"{resource} {name!r} not found", "NotFound")
            return self._send(200, found[0])
        kind = {"deviceclasses": "DeviceClassList", "resourceclaimtemplates": "ResourceClaimTemplateList",
                "resourceclaims": "ResourceClaimList", "devicetaintrules": "DeviceTaintRuleList"}[resource]
        self._send(200, {"apiVersion": f"{GROUP}/{version}", "kind": kind, "items": found,
                         "metadata": {"resourceVersion": str(self.state.resource_version)}})

    def _granular_status_authorization(self) -> bool:
        return self.state.server_version >= (1, 36) and self.state.gates.get(
            "DRAResourceClaimGranularStatusAuthorization", True)

    def _record(self, method: str, path: str, query: dict) -> None:
        if path == "/api/v1/nodes":
            access = ("list", "", "nodes")
        elif _NODE.match(path):
            access = ("get" if method == "GET" else method.lower(), "", "nodes")
        elif m := _PODS.match(path):
            verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}.get(method)
            if method == "GET":
                verb = "get" if m.group(2) else "list"
            access = (verb, "", "pods")
        elif _EVENTS.match(path):
            access = ({"POST": "create", "GET": "list"}.get(method, method.lower()), "events.k8s.io", "events")
        elif _CLAIM_STATUS.match(path):
            access = (method.lower(), GROUP, "resourceclaims/status")
            if self._granular_status_authorization():
                # 1.36: writing status.devices also needs this verb on the driver
                # subresource, for the driver names of the entries (resourceNames).
                with self.state.lock:
                    self.state.access.add(("associated-node:" + method.lower(), GROUP, "resourceclaims/driver"))
        elif _CLAIM.match(path):
            access = ({"GET": "get", "PUT": "update", "DELETE": "delete"}.get(method, method), GROUP, "resourceclaims")
        elif m := _SLICES.match(path):
            named = m.group(2) is not None
            if method == "GET":
                verb = "get" if named else ("watch" if query.get("watch") in ("1", "true") else "list")
            else:
                verb = {"POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}[method]
            access = (verb, GROUP, "resourceslices")
        elif m := _READS.match(path):
            access = ("get" if m.group(4) else "list", GROUP, m.group(3))
        elif _NAMESPACE.match(path):
            access = ("get", "", "namespaces")
        else:
            return  # discovery: non-resource URLs every authenticated user may read
        with self.state.lock:
            self.state.access.add(access)

    # -- events ------------------------------------------------------------------------------
    def _events(self, method: str, namespace: str, body) -> None:
        if method == "GET":
            with self.state.lock:
                items = [e for e in self.state.events if e["metadata"]["namespace"] == namespace]
            return self._send(200, {"kind": "EventList", "apiVersion": "events.k8s.io/v1",
                                    "items": copy.deepcopy(items)})
        if method != "POST":
            return self._status(405, f"{method} on events is not emulated", "MethodNotAllowed")
        problems = events.errors(body, namespace)
        if problems:
            return self._status(422, "Event.events.k8s.io is invalid: " + "; ".join(problems), "Invalid")
        with self.state.lock:
            if any(e["metadata"]["name"] == body["metadata"]["name"]
                   and e["metadata"]["namespace"] == namespace for e in self.state.events):
                return self._status(409, f"events {body['metadata']['name']!r} already exists",
                                    "AlreadyExists")
            stored = copy.deepcopy(body)
            stored["metadata"]["namespace"] = namespace
            self.state.resource_version += 1
            stored["metadata"]["resourceVersion"] = str(self.state.resource_version)
            stored["metadata"]["uid"] = str(uuid.uuid4())
            self.state.events.append(stored)
        return self._send(201, stored)

    # -- pods --------------------------------------------------------------------------------
    def _pods(self, method: str, namespace: str, name: str | None, query: dict, body) -> None:
        state = self.state
        with state.lock:
            if method == "GET" and name is None:
                items = [copy.deepcopy(p) for (ns, _), p in sorted(state.pods.items())
                         if ns == namespace and _labels_match(p, query.get("labelSelector", ""))]
                return self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": items,
                                        "metadata": {"resourceVersion": str(state.resource_version)}})
            pod = state.pods.get((namespace, name)) if name else None
            if method == "GET":
                return self._send(200, pod) if pod else \
                    self._status(404, f'pods "{name}" not found', "NotFound")
            if method == "DELETE":
                if pod is None:
                    return self._status(404, f'pods "{name}" not found', "NotFound")
                if pod["spec"].get("nodeName") in state.pod_nodes:
                    pod["metadata"].setdefault("deletionTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ"))
                else:
                    del state.pods[(namespace, name)]
                state.resource_version += 1
                state.changed.notify_all()
                return self._send(200, pod)
            if method != "POST" or name is not None:
                return self._status(405, f"{method} on pods is not served", "MethodNotAllowed")
            errors = _pod_errors(body, namespace)
            if errors:
                return self._status(422, "Pod is invalid: " + "; ".join(errors), "Invalid")
            key = (namespace, body["metadata"]["name"])
            if key in state.pods:
                return self._status(409, f'pods "{key[1]}" already exists', "AlreadyExists")
            stored = copy.deepcopy(body)
            state.resource_version += 1
            stored["metadata"].update(uid=str(uuid.uuid4()), namespace=namespace,
                                      resourceVersion=str(state.resource_version))
            stored["status"] = {"phase": "Pending"}
            state.pods[key] = stored
            state.changed.notify_all()
            return self._send(201, copy.deepcopy(stored))

    # -- slices ----------------------------------------------------------------------------
    def _selected(self, obj: dict, query: dict) -> bool:
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            key, _, value = term.partition("=")
            field_name = key.removeprefix("spec.")
            if obj["spec"].get(field_name) != value:
                return False
        return True

    def _slices(self, method: str, version: str, name: str | None, query: dict, body) -> None:
        state = self.state
        if method == "GET" and name is None and query.get("watch") in ("1", "true"):
            return self._watch(version, query)
        with state.lock:
            if method == "GET" and name is None:
                items = [_as_version(s, version) for _, s in sorted(state.slices.items())
                         if self._selected(s, query)]
                return self._send(200, {"kind": "ResourceSliceList", "apiVersion": f"{GROUP}/{version}",
                                        "metadata": {"resourceVersion": str(state.resource_version)},
                                        "items": items})
            if method == "GET":
                obj = state.slices.get(name)
                return self._send(200, _as_version(obj, version)) if obj else \
                    self._status(404, f"resourceslices {name!r} not found", "NotFound")
            if method == "DELETE":
                obj = state.slices.get(name)
                if obj is None:
                    return self._status(404, f"resourceslices {name!r} not found", "NotFound")
                failed = _precondition_failure((body or {}).get("preconditions") or {}, obj)
                if failed:
                    return self._status(409, failed, "Conflict")
                del state.slices[name]
                state.writes.append(("delete", name))
                state.resource_version += 1
                _notify(state, "DELETED", obj)
                return self._send(200, {"kind": "Status", "status": "Success"})
            # create / update
            if body.get("apiVersion") != f"{GROUP}/{version}" or body.get("kind") != "ResourceSlice":
                return self._status(400, "body apiVersion/kind do not match the URL", "BadRequest")
            errors = slice_errors(body, server=state.server_version)
            if not errors:
                errors = _canonicalize_quantities(body)
            _drop_disabled_fields(body, state.gates)
            if errors:
                return self._status(422, "ResourceSlice is invalid: " + "; ".join(errors), "Invalid")
            meta = body.setdefault("metadata", {})
            if method == "POST":
                if meta.get("name") in state.slices:
                    return self._status(409, f"resourceslices {meta['name']!r} already exists", "AlreadyExists")
                meta["uid"] = str(uuid.uuid4())
                verb = "create"
            else:
                current = state.slices.get(name)
                if current is None:
                    return self._status(404, f"resourceslices {name!r} not found", "NotFound")
                if meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return self._status(409, "the object has been modified", "Conflict")
                failed = _precondition_failure({"uid": meta.get("uid")}, current)
                if failed:
                    return self._status(409, failed, "Conflict")
                meta["uid"] = current["metadata"]["uid"]
                verb = "update"
            state.resource_version += 1
            meta["resourceVersion"] = str(state.resource_version)
            stored = _to_v1(body, version)
            state.slices[meta["name"]] = stored
            state.writes.append((verb, meta["name"]))
            _notify(state, "ADDED" if verb == "create" else "MODIFIED", stored)
            return self._send(201 if verb == "create" else 200, _as_version(stored, version))

    def _watch(self, version: str, query: dict) -> None:
        """As the real server: without a resourceVersion (or "0") the watch starts with an
        ADDED event per existing object; from a resourceVersion it sends what happened
        after it, or one ERROR event (410 Expired) when that is older than its window;
        with allowWatchBookmarks a BOOKMARK with the current version ends it."""
        events: list = []
        timeout = float(query.get("timeoutSeconds", 30))
        since = query.get("resourceVersion", "")
        with self.state.lock:
            state = self.state
            if since in ("", "0"):
                events += [{"type": "ADDED", "object": copy.deepcopy(s)}
                           for _, s in sorted(state.slices.items())]
            elif not since.isdigit():
                return self._status(400, f"invalid resourceVersion {since!r}", "BadRequest")
            elif int(since) < state.compacted:
                events.append({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired",
                    "message": f"too old resource version: {since} ({state.compacted})"}})
            else:
                events += [e for rv, e in state.history if rv > int(since)]
            self.state.watchers.append(events)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                with self.state.changed:
                    if not events:
                        self.state.changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                    batch, events[:] = list(events), []
                for event in batch:
                    if event["type"] == "ERROR":
                        self._chunk(event)
                        deadline = 0.0  # the server ends a watch after its error
                        break
                    if not self._selected(event["object"], query):
                        continue
                    self._chunk({"type": event["type"], "object": _as_version(event["object"], version)})
            if query.get("allowWatchBookmarks") in ("1", "true") and deadline and self.state.bookmarks:
                with self.state.lock:
                    current = str(self.state.resource_version)
                self._chunk({"type": "BOOKMARK", "object": {
                    "apiVersion": f"{GROUP}/{version}", "kind": "ResourceSlice",
                    "metadata": {"resourceVersion": current}}})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with self.state.lock:
                # By identity: list.remove compares by value, and two idle watches' queues
                # are equal ([]), so it took another watch's queue away, which then saw no
                # more events (and failed its own removal later with a ValueError).
                self.state.watchers[:] = [w for w in self.state.watchers if w is not events]
        # A watch that ended cleanly leaves its connection open for the next request, as
        # the real server's does. (Closing it without a "Connection: close" made a client
        # that reused it at once race the close: "Connection aborted", now and then.)

    def _chunk(self, event: dict) -> None:
        line = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.flush()


def _labels_match(obj: dict, selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _pod_errors(pod: dict, namespace: str) -> list[str]:
    """The parts of Pod validation a driver-made pod can get wrong."""
    errors = []
    meta = pod.get("metadata") or {}
    name = meta.get("name", "")
    if pod.get("apiVersion") != "v1" or pod.get("kind") != "Pod":
        errors.append("apiVersion/kind must be v1/Pod")
    if not (name and len(name) <= 253 and re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name)):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    if meta.get("namespace", namespace) != namespace:
        errors.append("metadata.namespace does not match the URL")
    for key, value in (meta.get("labels") or {}).items():
        if len(str(value)) > 63 or not re.match(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", str(value)):
            errors.append(f"metadata.labels[{key}]: {value!r} is not a label value")
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        errors.append("spec.containers: Required value")
    volumes = {v.get("name") for v in spec.get("volumes") or []}
    for i, container in enumerate(containers):
        if not container.get("image"):
            errors.append(f"spec.containers[{i}].image: Required value")
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") not in volumes:
                errors.append(f"spec.containers[{i}].volumeMounts: volume {mount.get('name')!r} not found")
    return errors


def _precondition_failure(preconditions: dict, obj: dict) -> str | None:
    """The real server's answer when a UID or resourceVersion precondition does not hold."""
    meta = obj["metadata"]
    for key in ("uid", "resourceVersion"):
        want = preconditions.get(key)
        if want and want != meta.get(key):
            label = "UID" if key == "uid" else "ResourceVersion"
            return (f"Precondition failed: {label} in precondition: {want}, "
                    f"{label} in object meta: {meta.get(key)}")
    return None


def _canonicalize_quantities(body: dict) -> list[str]:
    """Rewrite every quantity as the server stores it; errors for unparsable ones."""
    errors = []

    def fix(holder: dict, key: str, where: str) -> None:
        try:
            holder[key] = quantity.canonical(str(holder[key]))
        except quantity.QuantityError as err:
            errors.append(f"{where}: {err}")

    spec = body.get("spec") or {}
    for i, device in enumerate(spec.get("devices") or []):
        fields = device.get("basic", device)
        for name, cap in (fields.get("capacity") or {}).items():
            if isinstance(cap, dict) and "value" in cap:
                fix(cap, "value", f"spec.devices[{i}].capacity[{name}].value")
            policy = cap.get("requestPolicy") if isinstance(cap, dict) else None
            if isinstance(policy, dict):
                where = f"spec.devices[{i}].capacity[{name}].requestPolicy"
                if policy.get("default") is not None:
                    fix(policy, "default", f"{where}.default")
                for key in ("min", "max", "step"):
                    if isinstance(policy.get("validRange"), dict) and key in policy["validRange"]:
                        fix(policy["validRange"], key, f"{where}.validRange.{key}")
                for j in range(len(policy.get("validValues") or [])):
                    fix(policy["validValues"], j, f"{where}.validValues[{j}]")
        for j, use in enumerate(fields.get("consumesCounters") or []):
            for name, counter in (use.get("counters") or {}).items():
                if isinstance(counter, dict) and "value" in counter:
                    fix(counter, "value", f"spec.devices[{i}].consumesCounters[{j}].counters[{name}].value")
    for i, counter_set in enumerate(spec.get("sharedCounters") or []):
        for name, counter in (counter_set.get("counters") or {}).items():
            if isinstance(counter, dict) and "value" in counter:
                fix(counter, "value", f"spec.sharedCounters[{i}].counters[{name}].value")
    return errors


def _drop_disabled_fields(body: dict, gates: dict[str, bool]) -> None:
    """What the real server's field strategy does for a gate that is off."""
    if not gates.get("DRAPartitionableDevices", True):
        (body.get("spec") or {}).pop("sharedCounters", None)
    for device in (body.get("spec") or {}).get("devices") or []:
        fields = device.get("basic", device)
        if not gates.get("DRADeviceTaints", True):
            fields.pop("taints", None)
        if not gates.get("DRAPartitionableDevices", True):
            fields.pop("consumesCounters", None)
        if not gates.get("DRAConsumableCapacity", True):
            fields.pop("allowMultipleAllocations", None)
            for capacity in (fields.get("capacity") or {}).values():
                if isinstance(capacity, dict):
                    capacity.pop("requestPolicy", None)


def _to_v1(obj: dict, version: str) -> dict:
    """Store slices in v1 shape, converting v1beta1's `basic` nesting."""
    obj = copy.deepcopy(obj)
    obj["apiVersion"] = f"{GROUP}/v1"
    if version == "v1beta1":
        obj["spec"]["devices"] = [{"name": d["name"], **d.get("basic", {})} for d in obj["spec"].get("devices", [])]
    return obj


def _as_version(obj: dict, version: str) -> dict:
    obj = copy.deepcopy(obj)
    obj["apiVersion"] = f"{GROUP}/{version}"
    if version == "v1beta1":
        obj["spec"]["devices"] = [{"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}}
                                  for d in obj["spec"].get("devices", [])]
    return obj
