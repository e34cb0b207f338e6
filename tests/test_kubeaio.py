"""driver/kube/asyncclient.py: Prepare's claim GETs on the event loop.

Against the API emulator (which answers as Go's net/http does: chunked above 2 KiB, and
it can drop connections or close them after each answer), over HTTP and HTTPS, and
against a raw socket server for answers the emulator never gives (HTTP/1.0, trailers,
a 100 Continue, malformed ones). Every answer must read as driver/kube/client.py's threaded
client reads it, and a connection goes back to the pool only after a whole answer."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
import urllib.parse

import pytest
import trustme

from driver.prepare.claims import ClaimError, ClaimReader, ClaimRef
from driver.kube.client import ApiClient, ApiError, Kube, NotFound, api_client
from driver.kube.asyncclient import MAX_BODY_BYTES, LoopGets
from driver.kube.kubeconfig import ApiConfig
from driver.sim.apiserver import GO_CHUNKING_BYTES, TOKEN, ApiServer, Fault, claim_allocated
from tests.test_kubeconfig import b64, server_context, write_kubeconfig

CLAIM = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c"


def big_claim(uid: str = "uid-c") -> dict:
    claim = claim_allocated("default", "c", uid, [])
    # A claim well over Go's 2 KiB buffer: the emulator sends it chunked, in 4 KiB parts.
    claim["metadata"]["annotations"] = {f"example.com/note-{i}": "x" * 200 for i in range(60)}
    return claim


@pytest.fixture
def api():
    with ApiServer() as server:
        server.put_claim(claim_allocated("default", "c", "uid-c", []))
        yield server


def loop_gets(api: ApiServer, tmp_path, connections: int = 4, timeout: float = 10.0) -> LoopGets:
    return LoopGets(Kube(api_client(api.kubeconfig(tmp_path)), timeout=timeout), connections)


def run(*coroutines):
    async def main():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    return asyncio.run(main())


def test_a_small_and_a_chunked_answer_read_as_the_threaded_client_reads_them(api, tmp_path):
    gets = loop_gets(api, tmp_path)
    threaded = Kube(api_client(api.kubeconfig(tmp_path)))
    (small,) = run(gets.get(CLAIM))
    assert small == threaded.request("GET", CLAIM)
    api.put_claim(big_claim())
    raw = http.client.HTTPConnection(urllib.parse.urlsplit(api.url).netloc)
    raw.request("GET", CLAIM, headers={"Authorization": f"Bearer {TOKEN}"})
    answer = raw.getresponse()
    assert answer.getheader("Transfer-Encoding") == "chunked"  # the emulator is as strict as Go
    assert len(answer.read()) > 2 * 4096 > GO_CHUNKING_BYTES
    (big,) = run(gets.get(CLAIM))
    assert big == threaded.request("GET", CLAIM)
    assert len(big["metadata"]["annotations"]) == 60
    assert any(agent.startswith("dra-driver/") for agent in api.state.user_agents)


def test_gets_share_keep_alive_connections_and_never_exceed_their_number(api, tmp_path):
    gets = loop_gets(api, tmp_path, connections=3)
    held = Fault("GET", "resourceclaims", status=0, delay=0.3, times=9)

    async def sequential_then_together():
        one_by_one = [await gets.get(CLAIM) for _ in range(30)]
        opened = api.state.connections
        api.inject(held)
        together = await asyncio.gather(*(gets.get(CLAIM) for _ in range(9)))
        return one_by_one, opened, together
    before = api.state.connections
    ((one_by_one, opened, together),) = run(sequential_then_together())
    assert len(one_by_one) == 30 and opened - before == 1
    assert all(a["metadata"]["uid"] == "uid-c" for a in together)
    assert held.peak == 3  # at most `connections` in flight; the rest waited for one
    assert api.state.connections - before == 3  # the first one among them


def test_a_dropped_connection_is_tried_once_more_and_a_second_drop_is_one_error(api, tmp_path):
    gets = loop_gets(api, tmp_path)
    dropped = Fault("GET", "resourceclaims", drop=True, times=1)
    api.inject(dropped)
    (answer,) = run(gets.get(CLAIM))
    assert answer["metadata"]["uid"] == "uid-c" and dropped.times == 0
    twice = Fault("GET", "resourceclaims", drop=True, times=2)
    api.inject(twice)
    (failed,) = run(gets.get(CLAIM))
    assert isinstance(failed, ApiError) and failed.status == 0
    assert str(failed) == f"GET {CLAIM}: the server closed the connection without an answer"
    (answer,) = run(gets.get(CLAIM))  # and the pool holds nothing broken
    assert answer["metadata"]["uid"] == "uid-c"


def test_connections_the_server_closes_after_each_answer_are_not_trusted_again(api, tmp_path):
    api.state.answers_per_connection = 1  # an idle timeout that always wins the race
    gets = loop_gets(api, tmp_path)

    async def sequential():
        answers = []
        for _ in range(5):
            answers.append(await gets.get(CLAIM))
            await asyncio.sleep(0.05)  # the server's close arrives while it is idle
        return answers
    (answers,) = run(sequential())
    assert [a["metadata"]["uid"] for a in answers] == ["uid-c"] * 5


def test_errors_read_as_the_threaded_clients(api, tmp_path):
    gets = loop_gets(api, tmp_path)
    threaded = Kube(api_client(api.kubeconfig(tmp_path)))
    missing = CLAIM.replace("/c", "/nope")
    api.inject(Fault("GET", "resourceclaims/c$", status=503, times=2))
    api.inject(Fault("GET", "resourceclaims/html$", status=502, times=2, page="<html>bad gateway</html>"))
    html = CLAIM.replace("/c", "/html")
    results = run(gets.get(missing), gets.get(CLAIM), gets.get(html))
    expected = []
    for path in (missing, CLAIM, html):
        try:
            threaded.request("GET", path)
        except ApiError as err:
            expected.append(err)
    assert [type(e) for e in results] == [NotFound, ApiError, ApiError]
    assert [(str(e), e.status) for e in results] == [(str(e), e.status) for e in expected]
    assert str(results[1]) == f"HTTP 503: GET {CLAIM}: injected fault 503"

    api.state.tokens = {"another-token"}
    (unauthorized,) = run(gets.get(CLAIM))
    assert isinstance(unauthorized, ApiError) and unauthorized.status == 401


def test_no_answer_within_the_timeout_is_an_error_and_the_connection_is_not_reused(api, tmp_path):
    gets = loop_gets(api, tmp_path, connections=1, timeout=0.3)
    # The headers come at once, the body late: a half-read answer must not stay in the pool.
    api.inject(Fault("GET", "resourceclaims", status=500, body_delay=1.0))
    started = time.monotonic()
    (failed,) = run(gets.get(CLAIM))
    assert isinstance(failed, ApiError) and str(failed) == f"GET {CLAIM}: no answer within 0.3 s"
    assert time.monotonic() - started < 0.9
    time.sleep(1.0)  # the late body has been sent by now
    (answer,) = run(gets.get(CLAIM))
    assert answer["metadata"]["uid"] == "uid-c"


def test_https_with_a_ca_a_client_certificate_and_a_server_name(tmp_path):
    ca, clients = trustme.CA(), trustme.CA()
    cert = clients.issue_cert("node-a.example")
    user = {"client-certificate-data": b64(cert.cert_chain_pems[0].bytes()),
            "client-key-data": b64(cert.private_key_pem.bytes())}
    with ApiServer(tls=server_context(ca, "kubernetes.default.svc", client_ca=clients)) as api:
        api.put_claim(big_claim())
        trusted = {"certificate-authority-data": b64(ca.cert_pem.bytes())}
        named = write_kubeconfig(tmp_path, api.url, {**trusted, "tls-server-name": "kubernetes.default.svc"},
                                 user, name="named")
        (answer,) = run(LoopGets(Kube(api_client(named)), 2).get(CLAIM))
        assert answer["metadata"]["uid"] == "uid-c" and api.state.unauthorized == 0
        unnamed = write_kubeconfig(tmp_path, api.url, trusted, user, name="unnamed")
        (failed,) = run(LoopGets(Kube(api_client(unnamed)), 2).get(CLAIM))
        assert isinstance(failed, ApiError) and failed.status == 0
        assert str(failed).startswith(f"GET {CLAIM}: TLS: ") and "127.0.0.1" in str(failed)
        other = write_kubeconfig(tmp_path, api.url,
                                 {"certificate-authority-data": b64(trustme.CA().cert_pem.bytes()),
                                  "tls-server-name": "kubernetes.default.svc"}, user, name="other")
        (failed,) = run(LoopGets(Kube(api_client(other)), 2).get(CLAIM))
        assert "CERTIFICATE_VERIFY_FAILED" in str(failed)


def test_a_proxy_in_the_configuration_leaves_the_get_to_the_threaded_client(api, tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    path = write_kubeconfig(tmp_path, api.url, {"proxy-url": f"http://127.0.0.1:{port}"})
    (failed,) = run(LoopGets(Kube(api_client(path)), 2).get(CLAIM))
    # Direct, the GET would have worked: the error is the proxy's, from urllib3.
    assert isinstance(failed, ApiError) and "proxy" in str(failed).lower()


def test_credentials_that_may_run_a_plugin_are_asked_for_off_the_loop(api):
    asked_on = []

    def headers():
        asked_on.append(threading.current_thread())
        return {"Authorization": f"Bearer {TOKEN}"}
    import urllib3

    def client(may_block: bool) -> Kube:
        return Kube(ApiClient(ApiConfig(api.url, headers, headers_may_block=may_block),
                              urllib3.PoolManager()))
    (answer, ) = run(LoopGets(client(True), 1).get(CLAIM))
    (again, ) = run(LoopGets(client(False), 1).get(CLAIM))
    assert answer == again
    assert asked_on[0] is not threading.main_thread() and asked_on[1] is threading.main_thread()


def test_the_claim_reader_names_the_claim_in_its_errors(api, tmp_path):
    reader = ClaimReader(Kube.deferred(api.kubeconfig(tmp_path)), connections=2)
    ok, missing = ClaimRef("default", "c", "uid-c"), ClaimRef("default", "gone", "uid-g")
    claim, failed = run(reader.read(ok), reader.read(missing))
    assert claim == reader.get(ok)
    assert isinstance(failed, ClaimError) and str(failed) == "claim default/gone not found"


# -- answers the emulator never gives ------------------------------------------------------
class RawServer:
    """Answers every request on a connection with the next of `answers`, as bytes."""

    def __init__(self, *answers: bytes) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                while self.answers:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        data = conn.recv(65536)
                        if not data:
                            break
                        request += data
                    if not request:
                        break
                    self.requests.append(request)
                    answer = self.answers.pop(0)
                    conn.sendall(answer)
                    if b"Content-Length" not in answer and b"chunked" not in answer:
                        break  # the body ends with the connection

    def get(self, path: str = "/x"):
        config = ApiConfig(self.url, lambda: {"Authorization": "Bearer t"})
        import urllib3
        (result,) = run(LoopGets(Kube(ApiClient(config, urllib3.PoolManager()), timeout=3), 1).get(path))
        return result


def test_answers_of_every_framing_read_alike():
    server = RawServer(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"b\": 2}",
    )
    assert server.get() == {"a": 1}
    assert server.get() == {"b": 2}
    request = server.requests[0].decode()
    assert request.startswith("GET /x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert "Authorization: Bearer t\r\n" in request and "Accept: application/json\r\n" in request


@pytest.mark.parametrize("answer, message", [
    (b"SSH-2.0-OpenSSH\r\n", "not an HTTP answer: b'SSH-2.0-OpenSSH\\r\\n'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n{}}", "two different Content-Length headers"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1),
     f"an answer of {MAX_BODY_BYTES + 1} bytes (at most {MAX_BODY_BYTES} are read)"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", "an answer in Content-Encoding 'gzip'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size line b'zz\\r\\n'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "the connection ended in the middle of the answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!", "the answer is not JSON: b'not json!'"),
])
def test_malformed_answers_are_one_error_that_names_the_get(answer, message):
    failed = RawServer(answer).get()
    assert isinstance(failed, ApiError) and failed.status == 0
    assert str(failed) == f"GET /x: {message}"
